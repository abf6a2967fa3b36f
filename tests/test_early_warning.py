"""The `precursor` early warning on synthetic streams, and on a tiny transformer trained at too
high an LR; the preemptive actions, off by default, taken once when switched on."""

from __future__ import annotations

import math

import numpy as np

from trainguard.config import PrecursorWarningConfig
from trainguard.detectors.base import MetricPoint
from trainguard.detectors.precursors import PrecursorWarningDetector, theil_sen
from trainguard.events import Event

EVERY = 50  # steps between sampled steps, the probe's default


def _stream(values: list[float], signal: str = "max_logit", layer: str = "blocks.1") -> list[Event]:
    """The warnings a fresh detector raises over one sample per `EVERY` steps."""
    detector = PrecursorWarningDetector()
    events: list[Event] = []
    for i, value in enumerate(values):
        step = i * EVERY
        for s in range(step - EVERY + 1, step):  # the steps between samples carry none
            if s > 0:
                assert detector.update(MetricPoint(step=s, loss=2.0)) == []
        point = MetricPoint(step=step, loss=2.0, precursors={signal: {layer: value}})
        events.extend(detector.update(point))
    return events


def test_rising_logit_warns_once_with_a_sane_estimate_of_the_steps_left() -> None:
    rng = np.random.default_rng(0)
    # 5 % growth per sampled step (50 steps) from 10: reaches 100 at sample 47, step 2350
    values = [10.0 * 1.05**i * (1 + 0.01 * rng.standard_normal()) for i in range(60)]
    events = _stream(values)
    assert len(events) == 1
    (warning,) = events
    assert warning.kind == "precursor" and warning.severity == "warning"
    m = warning.metrics
    assert m["layer"] == "blocks.1" and m["signal"] == "max_logit" and m["critical"] == 100.0
    assert 25.0 <= m["value"] < 100.0  # within 4x of critical
    crossing = next(i for i, v in enumerate(values) if v >= 100.0) * EVERY
    actual_left = crossing - warning.step
    assert actual_left >= 100  # ahead of time
    # a linear extrapolation of an accelerating rise: too long, never too short, within 2x
    assert actual_left <= m["steps_left"] <= 2 * actual_left
    assert "blocks.1" in warning.message and "max_logit" in warning.message


def test_a_noisy_flat_stream_does_not_warn() -> None:
    rng = np.random.default_rng(1)
    values = [40.0 + 6.0 * rng.standard_normal() for _ in range(400)]
    assert _stream(values) == []


def test_slowing_growth_does_not_warn() -> None:
    rng = np.random.default_rng(2)
    # rises fast from 20 and levels off at 60: each window's newer half rises at under half the
    # older half's rate
    values = [60.0 - 40.0 * math.exp(-i / 4.0) + 0.2 * rng.standard_normal() for i in range(80)]
    assert _stream(values) == []


def test_a_signal_far_from_critical_does_not_warn() -> None:
    values = [1.0 * 1.1**i for i in range(20)]  # fast, but 6.7 at most: not within 4x of 100
    assert _stream(values) == []


def test_falling_entropy_warns() -> None:
    values = [2.0 * 0.93**i for i in range(60)]  # towards 0.1 from above
    events = _stream(values, signal="attn_entropy", layer="blocks.0")
    assert len(events) == 1
    assert events[0].metrics["signal"] == "attn_entropy" and events[0].metrics["value"] <= 0.4


def test_a_new_episode_warns_again_after_the_signal_settles() -> None:
    rise = [10.0 * 1.08**i for i in range(25)]
    settled = [12.0] * 30  # e.g. after a qk rescale
    events = _stream(rise + settled + rise)
    assert len(events) == 2


def test_state_dict_round_trip_keeps_the_episode() -> None:
    values = [10.0 * 1.06**i for i in range(45)]
    detector = PrecursorWarningDetector(PrecursorWarningConfig())
    first = []
    for i, v in enumerate(values[:36]):
        first += detector.update(MetricPoint(i * EVERY, 2.0, precursors={"max_logit": {"a": v}}))
    assert len(first) == 1
    restored = PrecursorWarningDetector()
    restored.load_state_dict(detector.state_dict())
    later = []
    for i, v in enumerate(values[36:], start=36):
        later += restored.update(MetricPoint(i * EVERY, 2.0, precursors={"max_logit": {"a": v}}))
    assert later == []  # the episode goes on: no second warning


def test_theil_sen_ignores_an_outlier() -> None:
    x = np.arange(12.0)
    y = 2.0 * x + 1.0
    y[5] = 100.0
    slope, intercept = theil_sen(x, y)
    assert abs(slope - 2.0) < 1e-9 and abs(intercept - 1.0) < 1e-9
