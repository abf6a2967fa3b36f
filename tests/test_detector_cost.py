"""The live detectors' float fast path: `update` judges one step in plain floats through the same
rule functions that `advance` runs on arrays, with the very figures the one-element array path
gives, so the events are those the code gave before it (recorded in data/detector_events.json
from 2acceae, the commit before the fast path)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import trainguard as tg
from test_bulk import faulty_curve
from trainguard.detectors import DetectorSuite
from trainguard.detectors.gradients import GradExplosionDetector, GradSpikeDetector
from trainguard.detectors.loss_ema import LossEmaDetector
from trainguard.detectors.loss_spike import LossSpikeDetector
from trainguard.detectors.series import MetricSeries
from trainguard.detectors.trends import OscillationDetector, _median_and_spread

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from detector_cost import make_points

GOLDEN = Path(__file__).parent / "data" / "detector_events.json"


def _series(name: str) -> MetricSeries:
    """The synthetic streams: flat runs, NaN/Inf, level shifts, heavy tails, swings."""
    rng = np.random.default_rng(7)
    n = 6000
    t = np.arange(n)
    steps = t.astype(np.int64)
    if name == "plateau":  # an exactly constant loss (no noise at all), spikes, NaN, Inf
        loss = np.full(n, 2.5)
        loss[1000], loss[2000:2005], loss[3000:], loss[3500] = 5.0, np.nan, 3.5, np.inf
        loss[4000:4400] += 0.01 * rng.standard_normal(400)
        loss[5000] = 30.0
        grad = np.full(n, 1.0)
        grad[1000], grad[2500:2510], grad[2600], grad[4500] = 40.0, 0.0, np.nan, np.inf
        grad[3100:3107] *= np.geomspace(1, 100, 7)
        return MetricSeries(steps, loss, grad, np.full(n, 1e-3))
    if name == "shifts":  # elevated stretches of every length: persistence and rebaselining
        loss = 3 + 0.02 * rng.standard_normal(n)
        for s0 in range(600, n - 200, 700):
            loss[s0 : s0 + int(rng.integers(2, 200))] += rng.choice([0.08, 0.12, 0.3, 1.0])
        grad = 1 + 0.1 * rng.standard_normal(n) ** 2
        return MetricSeries(steps, loss, grad, np.geomspace(1e-5, 1e-3, n))
    if name == "heavy":  # Student-t noise (nu = 2), a growing swing, Cauchy grad norms
        swing = 0.2 * np.sin(t * 2 * np.pi / 30) * np.linspace(0, 2, n)
        loss = 2 + 0.05 * rng.standard_t(2, n) + swing
        return MetricSeries(steps, loss, np.abs(rng.standard_cauchy(n)) + 0.1, None)
    assert name == "nonfinite"
    series = faulty_curve(n, 3)
    assert series.grad_norm is not None and series.lr is not None
    series.loss[[700, 2500]] = [math.nan, math.inf]
    series.grad_norm[[900, 901, 3000]] = [math.nan, math.inf, math.nan]
    series.lr[1000:1200] = math.nan
    series.overflow = np.zeros(n, dtype=bool)
    series.overflow[[1500, 1501, 1502, 4000]] = True
    series.loss_scale = np.where(t < 1500, 65536.0, 32768.0)
    series.nonfinite_grads = np.zeros(n, dtype=np.int64)
    series.nonfinite_grads[5000] = 3
    return series


SMALL = {
    "loss_spike": {"window": 16, "warmup": 8, "level_window": 3, "persist_steps": 2},
    "grad_spike": {"window": 12, "warmup": 4, "abs_limit": 20.0},
    "grad_explosion": {"abs_limit": 20.0},
}
TIGHT = {
    "loss_spike": {"z_threshold": 4, "window": 40, "noise_horizon": 50},
    "grad_spike": {"ratio_threshold": 1.3, "reach_steps": 100, "min_log_z": 0},
    "oscillation": {"growth": 1.1, "min_acf": 0.2},
    "divergence": {"window": 100, "z_threshold": 2},
}
STREAMS: dict[str, tuple[str, dict[str, Any]]] = {
    "bench": ("bench", {}),
    "plateau": ("plateau", {}),
    "shifts": ("shifts", {}),
    "heavy": ("heavy", {}),
    "nonfinite": ("nonfinite", {}),
    "small-heavy": ("heavy", SMALL),
    "tight-shifts": ("shifts", TIGHT),
}


def _points(name: str) -> list[tg.MetricPoint]:
    if name == "bench":
        return make_points(20_000)
    series = _series(name)
    return [series.point(i) for i in range(len(series))]


def _plain(value: Any) -> Any:
    """An event's figures as JSON keeps them, a float as its repr (exact)."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def live_events(stream: str) -> list[list[Any]]:
    """Every event of a live suite fed the stream one step at a time, in plain form."""
    source, config = STREAMS[stream]
    suite = DetectorSuite(tg.GuardConfig.from_dict(config))
    events: list[list[Any]] = []
    for point in _points(source):
        for e in suite.update(point):
            events.append(
                [e.kind, e.step, e.severity, e.type, e.confidence, e.message, _plain(e.metrics)]
            )
    return events


def _same_figures(got: Any, want: Any, path: str) -> None:
    """Equal, floats (kept as reprs) within 1e-12: bitwise on the machine that recorded them,
    and no more than last-digit apart where another machine's libm or BLAS rounds otherwise."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            _same_figures(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _same_figures(a, b, f"{path}[{i}]")
    elif isinstance(want, str) and isinstance(got, str) and got != want:
        try:
            a, b = float(got), float(want)
        except ValueError:
            raise AssertionError(f"{path}: {got!r} != {want!r}") from None
        assert a == pytest.approx(b, rel=1e-12, abs=1e-300, nan_ok=True), path
    else:
        assert got == want, path


@pytest.mark.parametrize("stream", list(STREAMS))
def test_live_events_are_those_recorded_before_the_fast_path(stream: str) -> None:
    want = json.loads(GOLDEN.read_text())[stream]
    got = live_events(stream)
    assert [e[:6] for e in got] == [e[:6] for e in want]  # kind, step, severity, type, conf, text
    for g, w in zip(got, want, strict=True):
        _same_figures(g[6], w[6], f"{w[0]}@{w[1]}")


def _check_loss_spike(det: LossSpikeDetector, loss: float) -> None:
    """`_measure_one` gives `_measure`'s figures of a one-element chunk, bit for bit, and
    `_rules` the same decisions on them."""
    one, chunk = det._measure_one(loss), det._measure(np.array([loss]))
    for field in ("losses", "base_mean", "short", "drift", "level", "sigma", "jump", "z"):
        assert repr(float(getattr(one, field))) == repr(float(getattr(chunk, field)[0])), field
    for field in ("z_noise", "below", "ratio"):
        assert repr(float(getattr(one, field))) == repr(float(getattr(chunk, field)[0])), field
    assert repr(float(one.noise_var)) == repr(float(chunk.noise_var[0]))
    rules = (det.tail, det.reach, det.doublings)
    got, want = det._rules(one, *rules), det._rules(chunk, *rules)
    assert [bool(x) for x in got[:3]] == [bool(x[0]) for x in want[:3]] and got[3] == want[3]


def _check_grad_spike(det: GradSpikeDetector, g: float) -> None:
    level, ratio, limit, over_ratio, over_abs = det._judge_one(g)
    held, levels, ratios = det._levels(np.array([g]))
    limits, over_ratios, over_abss = det._passes(held, ratios, np.array([g]), 0, 1)
    assert [repr(float(x)) for x in (level, ratio, limit)] == [
        repr(float(x[0])) for x in (levels, ratios, limits)
    ]
    assert (over_ratio, over_abs) == (bool(over_ratios[0]), bool(over_abss[0]))


@pytest.mark.parametrize("stream", ["plateau", "shifts", "heavy", "nonfinite", "small-heavy"])
def test_the_float_path_gives_the_one_element_array_path_figures(stream: str) -> None:
    """Step by step through a suite: before each `update`, the float figures of the spike and
    grad detectors and the decisions of the others equal those of the array path."""
    source, config = STREAMS[stream]
    suite = DetectorSuite(tg.GuardConfig.from_dict(config))
    checked = 0
    for point in _points(source):
        for det in suite.detectors:
            armed = point.loss_finite
            if isinstance(det, LossSpikeDetector) and armed:
                if len(det.window) >= det.config.warmup:
                    _check_loss_spike(det, point.loss)
                    checked += 1
            elif isinstance(det, GradSpikeDetector) and point.grads_finite and point.grad_norm:
                _check_grad_spike(det, point.grad_norm)
            elif isinstance(det, GradExplosionDetector) and point.grads_finite and point.grad_norm:
                growing, over = det._tests(np.array([point.grad_norm]))
                was = det.active
                det.update(point)
                assert det.active == bool(growing[0] or over[0]), was
                continue
            elif isinstance(det, LossEmaDetector) and armed:
                emas = det._emas(np.array([point.loss]))
                want = bool(det._over(det.seen + np.arange(1), np.array([point.loss]), emas[:-1]))
                before = math.nan if det.ema is None else det.ema
                assert bool(det._over(det.seen, point.loss, before)) == want
            elif isinstance(det, OscillationDetector) and armed:
                assert (det._first_check() == 0) == bool(len(det._checks(1)))
            det.update(point)
    assert checked > 1000


def test_a_blocks_median_and_spread_in_floats_are_numpys() -> None:
    """`divergence` reads a live block in floats: the same median and spread as numpy's, signed
    zeros included."""
    rng = np.random.default_rng(3)
    for size in (1, 2, 3, 4, 5, 19, 20):
        for _ in range(200):
            block = rng.choice([-0.0, 0.0, 1.0, -1.0, 2.5], size).tolist()
            if rng.random() < 0.5:
                block = rng.standard_normal(size).tolist()
            centre, spread = _median_and_spread(block)
            centres, spreads = _median_and_spread(np.asarray([block]))
            assert (repr(centre), repr(spread)) == (
                repr(float(centres[0])),
                repr(float(spreads[0])),
            )


def write_golden() -> None:
    """Record the live events of every stream (run against the code they are to pin)."""
    GOLDEN.write_text(json.dumps({s: live_events(s) for s in STREAMS}, separators=(",", ":")))


if __name__ == "__main__":
    write_golden()
