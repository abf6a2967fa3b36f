"""The `precursor` early warning: a layer's precursor of divergence (max attention logit,
attention entropy, block output RMS, Adam's update-to-epsilon ratio, output log Z) near its
critical level and heading there fast, read on the sampled steps before the loss moves."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from trainguard.config import FALLING_PRECURSORS, PrecursorWarningConfig
from trainguard.detectors.base import Detector, MetricPoint, fmt
from trainguard.detectors.stats import MAD_TO_SIGMA
from trainguard.events import Event, EventKind

if TYPE_CHECKING:
    from trainguard.detectors.series import MetricSeries

SLOWING = 0.5  # a trend whose newer half rises at under this share of its older half's slows


class PrecursorWarningDetector(Detector):
    """Per layer and signal, over the latest `window` samples: the value within `margin` of its
    critical level, a robust trend (Theil-Sen) rising at over `trend_noise` times the noise
    about it and not slowing, that reaches critical within `horizon` steps, or the value past
    critical after a sample held was outside `margin` of it (even before `window` samples);
    `confirm` samples in a row warn, once an episode (it ends after `window` samples that fail
    the rules)."""

    name = EventKind.PRECURSOR.value
    _state = ("samples", "streaks", "warned", "quiet", "passed")

    def __init__(self, config: PrecursorWarningConfig | None = None) -> None:
        self.config = config or PrecursorWarningConfig()
        # "signal/layer" -> [[step, value towards critical], ...], the latest `window`
        self.samples: dict[str, list[list[float]]] = {}
        self.streaks: dict[str, int] = {}  # samples in a row that met every rule
        self.warned: dict[str, bool] = {}  # a warning was given in the episode going on
        self.quiet: dict[str, int] = {}  # samples in a row since, that met no rule
        # past its critical level since it was last outside `margin` of it (warned of once)
        self.passed: dict[str, bool] = {}

    def update(self, point: MetricPoint) -> list[Event]:
        if not point.precursors:
            return []
        events: list[Event] = []
        for signal, layers in point.precursors.items():
            critical = self.config.critical.get(signal)
            if critical is None or not layers:
                continue
            for layer, value in layers.items():
                event = self._judge(point, signal, str(layer), float(value), critical)
                if event is not None:
                    events.append(event)
        return events

    def advance(self, series: MetricSeries, start: int) -> int:
        """Steps without a precursor sample change nothing: they are taken in bulk."""
        end = series.chunk_end(start)
        column = series.precursors
        if not column:
            return end
        for i in range(start, end):
            if column[i]:
                return i
        return end

    def _judge(
        self, point: MetricPoint, signal: str, layer: str, value: float, critical: float
    ) -> Event | None:
        key = f"{signal}/{layer}"
        if not math.isfinite(value):  # the non-finite detectors speak for this step
            return None
        held = [s for s in self.samples.get(key, []) if s[0] < point.step]  # a rollback undid
        held.append([float(point.step), _towards(signal, value)])
        cfg = self.config
        self.samples[key] = held = held[-cfg.window :]
        target = _towards(signal, critical)
        now = _towards(signal, value)
        past = now >= target
        if not _near(now, target, cfg.margin):
            self.passed[key] = False  # far from critical again (a preemptive rescale): re-armed
        if past and self.warned.get(key, False) and not self.passed.get(key, False):
            # warned of earlier in this episode and now past critical (again): said once more
            self.passed[key] = True
            return self._warning(point, signal, layer, value, critical, 0, 0.0, len(held))
        trend = self._trend(held, target)
        if trend is None and self._arrived_past(held, target):
            # no trend to read yet (or a jump): the level says it, its `confirm` samples counted
            trend = (self._slope(held), 0)
            self.streaks[key] = max(self.streaks.get(key, 0), cfg.confirm - 1)
        if trend is None:
            self.streaks[key] = 0
            self.quiet[key] = self.quiet.get(key, 0) + 1
            if self.quiet[key] >= cfg.window:
                self.warned[key] = False
            return None
        self.quiet[key] = 0
        self.streaks[key] = self.streaks.get(key, 0) + 1
        if self.streaks[key] < cfg.confirm or self.warned.get(key, False):
            return None
        self.warned[key] = True
        self.passed[key] = past
        slope, steps_left = trend
        return self._warning(point, signal, layer, value, critical, steps_left, slope, len(held))

    def _warning(
        self,
        point: MetricPoint,
        signal: str,
        layer: str,
        value: float,
        critical: float,
        steps_left: int,
        slope: float,
        samples: int,
    ) -> Event:
        """The `precursor` warning of one layer's signal: heading for its critical level, with
        the steps left at its trend, or already past it."""
        falling = signal in FALLING_PRECURSORS
        heading = "falling" if falling else "rising"
        past = _towards(signal, value) >= _towards(signal, critical)
        where = (
            f"is past its critical level {fmt(critical)}"
            if past
            else f"is {heading} towards its critical level {fmt(critical)}: about {steps_left} "
            f"steps left at its trend over the last {samples} samples"
        )
        return self.event(
            point,
            "warning",
            f"{signal} of {_named(layer)} at {fmt(value)} {where}; act before the loss moves "
            "(lower the LR, QK-norm or max-logit clipping for attention logits, z-loss for log "
            "Z; precursors.preempt.actions lets the guard act)",
            {
                "layer": layer,
                "signal": signal,
                "value": value,
                "critical": critical,
                "steps_left": 0 if past else steps_left,
                "slope_per_step": -slope if falling else slope,
                "samples": samples,
            },
        )

    def _arrived_past(self, held: list[list[float]], target: float) -> bool:
        """Whether the latest `confirm` samples are all past critical and an earlier sample
        held lay outside `margin` of it: it got there within the samples held, whether the
        trend window is full yet (the first `window` samples of a run) or not."""
        cfg = self.config
        latest = held[-cfg.confirm :]
        if len(held) <= cfg.confirm or any(s[1] < target for s in latest):
            return False
        return any(not _near(s[1], target, cfg.margin) for s in held[: -cfg.confirm])

    @staticmethod
    def _slope(held: list[list[float]]) -> float:
        """The Theil-Sen slope a step of the samples held."""
        slope, _ = theil_sen(np.array([s[0] for s in held]), np.array([s[1] for s in held]))
        return slope

    def _trend(self, held: list[list[float]], target: float) -> tuple[float, int] | None:
        """(slope a step, steps left) where the samples meet every rule, else None."""
        cfg = self.config
        if len(held) < cfg.window:
            return None
        steps = np.array([s[0] for s in held])
        values = np.array([s[1] for s in held])
        now = float(values[-1])
        if not _near(now, target, cfg.margin):
            return None
        slope, intercept = theil_sen(steps, values)
        if not slope > 0:
            return None
        noise = MAD_TO_SIGMA * float(np.median(np.abs(values - (slope * steps + intercept))))
        if slope * float(steps[-1] - steps[0]) <= cfg.trend_noise * noise:
            return None
        half = len(held) // 2
        older, _ = theil_sen(steps[:half], values[:half])
        newer, _ = theil_sen(steps[half:], values[half:])
        if newer < SLOWING * older:
            return None
        steps_left = max(0, math.ceil((target - now) / slope))
        if steps_left > cfg.horizon:
            return None
        return slope, steps_left


def _named(layer: str) -> str:
    """A layer as the message names it: 'layer 1', 'the output'."""
    return "the output" if layer == "output" else f"layer {layer}"


def _towards(signal: str, value: float) -> float:
    """The value on a scale that rises towards critical: negated for the falling signals, the
    size of log Z."""
    if signal in FALLING_PRECURSORS:
        return -value
    if signal == "log_z":
        return abs(value)
    return value


def _near(now: float, target: float, margin: float) -> bool:
    """Whether `now` (on the rising scale) lies within `margin` x of `target`: over target /
    margin for a rising signal, under -target * margin (a value under target x margin) for a
    falling one."""
    if target > 0:
        return now >= target / margin
    return now >= target * margin


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The Theil-Sen line through (x, y): the median of the pairwise slopes, and the median
    intercept; robust to nearly 3 in 10 outliers."""
    i, j = np.triu_indices(len(x), 1)
    dx = x[j] - x[i]
    ok = dx != 0
    if not ok.any():
        return 0.0, float(np.median(y))
    slope = float(np.median((y[j] - y[i])[ok] / dx[ok]))
    return slope, float(np.median(y - slope * x))
