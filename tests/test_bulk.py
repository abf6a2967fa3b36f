"""`DetectorSuite.run`: the bulk path over a whole series raises exactly the events, in the same
order, and leaves exactly the state, that `update` step by step does."""

from __future__ import annotations

import math

import numpy as np
import pytest

import trainguard as tg
from test_real_curves import CURVES
from trainguard.analysis import read_log
from trainguard.detectors import DetectorSuite
from trainguard.detectors.series import MetricSeries


def faulty_curve(n: int, seed: int) -> MetricSeries:
    """An LM-like curve with heavy-tailed noise, warm restarts, toxic batches, a slow rise with
    a growing grad norm, a growing oscillation and a final plateau."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    loss = 2 + 8 / np.sqrt(1 + t / 50) + 0.05 * rng.standard_t(5, n)
    grad = 1 + 0.1 * rng.standard_normal(n) ** 2
    lr = np.where(t % 5000 < 100, 1e-4 * (t % 5000) / 100, 1e-4)
    for s in rng.integers(500, n - 500, n // 3000):
        loss[s] += 3
    mid = n // 2
    loss[mid : mid + 300] += np.linspace(0, 4, 300)
    grad[mid + 10 : mid + 16] *= np.geomspace(1, 50, 6)
    o = n // 4
    loss[o : o + 400] += 0.5 * np.sin(np.arange(400) * 2 * np.pi / 20) * np.linspace(0.1, 1, 400)
    loss[-3000:] = loss[-3000] + 0.01 * rng.standard_normal(3000)
    return MetricSeries(t.astype(np.int64), loss, grad, lr)


def step_by_step(series: MetricSeries, config: tg.GuardConfig | None = None):
    suite = DetectorSuite(config)
    events = []
    for i in range(len(series)):
        events += suite.update(series.point(i))
    return events, suite.state_dict()


def assert_same(series: MetricSeries, config: tg.GuardConfig | None = None) -> list[tg.Event]:
    expected, state = step_by_step(series, config)
    bulk = DetectorSuite(config)
    got = bulk.run(series)
    assert [(e.step, e.kind, e.type) for e in got] == [(e.step, e.kind, e.type) for e in expected]
    for a, b in zip(got, expected, strict=True):
        assert (a.severity, a.message, a.confidence) == (b.severity, b.message, b.confidence)
        assert_close(a.to_dict()["metrics"], b.to_dict()["metrics"])
    assert_close(bulk.state_dict(), state)
    return got


def assert_close(a: object, b: object, path: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_close(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12, nan_ok=True), path
    else:
        assert a == b, path


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planted_faults_give_the_same_events_and_state(seed):
    events = assert_same(faulty_curve(20_000, seed))
    kinds = {e.kind for e in events}
    assert {"loss_spike", "grad_explosion", "oscillation", "stall"} <= kinds


def test_non_finite_values_overflow_and_missing_columns():
    series = faulty_curve(6_000, 3)
    series.loss[[700, 2500]] = [math.nan, math.inf]
    series.grad_norm[[900, 901, 3000]] = [math.nan, math.inf, math.nan]  # NaN marks missing
    series.lr[1000:1200] = math.nan
    series.overflow = np.zeros(6_000, dtype=bool)
    series.overflow[[1500, 1501, 1502, 4000]] = True
    series.loss_scale = np.where(np.arange(6_000) < 1500, 65536.0, 32768.0)
    series.nonfinite_grads = np.zeros(6_000, dtype=np.int64)
    series.nonfinite_grads[5000] = 3
    events = assert_same(series)
    assert {e.step for e in events if e.kind in ("nonfinite", "fp16_overflow")} >= {700, 2500}
    bare = MetricSeries(series.steps, series.loss)
    assert_same(bare)


def test_a_tight_config_with_many_events():
    config = tg.GuardConfig.from_dict(
        {
            "loss_spike": {"z_threshold": 4, "window": 40, "noise_horizon": 50},
            # no tail nor log-scale floor: the bare ratio, for many events
            "grad_spike": {"ratio_threshold": 1.3, "reach_steps": 100, "min_log_z": 0},
            "oscillation": {"growth": 1.1, "min_acf": 0.2},
            "divergence": {"window": 100, "z_threshold": 2},
        }
    )
    events = assert_same(faulty_curve(12_000, 4), config)
    assert len(events) > 100


def test_long_runs_cross_the_tail_histogram_halving():
    # 45k armed steps: the |z| histogram halves at 20k counts and the tail is recomputed
    events = assert_same(faulty_curve(45_000, 5))
    assert any(e.kind == "loss_spike" for e in events)


@pytest.mark.parametrize(
    "name",
    [
        *sorted(p.name for p in CURVES.glob("*.csv") if not p.name.startswith("pythia")),
        "pythia-160m-seed6.csv",
    ],
)
def test_real_curves_give_the_same_events(name):
    assert_same(read_log(CURVES / name).series())
