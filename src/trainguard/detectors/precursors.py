"""The `precursor` early warning: a layer's precursor of divergence (max attention logit,
attention entropy, block output RMS, Adam's update-to-epsilon ratio, output log Z) near its
critical level and heading there fast, read on the sampled steps before the loss moves. Log Z is
judged by its distance from ln(vocabulary); an attention collapse (max logit, entropy, block
RMS) warns where it has an effect (the loss or grad norm responds, or it runs on far past
critical), and is `info` where the run learns on regardless."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trainguard.config import FALLING_PRECURSORS, VOCAB_SIZE, PrecursorWarningConfig
from trainguard.detectors.base import Detector, MetricPoint, fmt
from trainguard.detectors.stats import MAD_TO_SIGMA
from trainguard.events import Event, EventKind, Severity

if TYPE_CHECKING:
    from trainguard.detectors.series import MetricSeries

SLOWING = 0.5  # a trend whose newer half rises at under this share of its older half's slows
# the signals of an attention collapse, weighed by its effect: a model may learn on with one
# head's attention on one token (a warning where the loss or grad norm responds, else info)
WEIGHED = frozenset({"max_logit", "attn_entropy", "block_rms"})
LOSS_RESPONSE = 0.1  # the loss's recent median this share over its lowest: it responded
LOSS_NOISE = 3.0  # ... and over this many noises of that median
GRAD_RESPONSE = 3.0  # the grad norms' recent median this x over their lowest: they responded
FAR_PAST = 10.0  # a rising signal this x past its critical level runs on: warned, effect or not
MEDIAN_NOISE = 1.2533  # the noise of a median of n samples: this x sigma / sqrt(n)


@dataclass(frozen=True)
class _Reading:
    """One layer's sampled signal as `_judge` read it: its critical level, log Z's base
    (ln(vocabulary); 0 for the others) and how many samples its trend was read over."""

    signal: str
    layer: str
    value: float
    critical: float
    base: float
    samples: int

    @property
    def key(self) -> str:
        return f"{self.signal}/{self.layer}"


class PrecursorWarningDetector(Detector):
    """Per layer and signal, over the latest `window` samples: the value within `margin` of its
    critical level, a robust trend (Theil-Sen) rising at over `trend_noise` times the noise
    about it and not slowing, that reaches critical within `horizon` steps, or the value past
    critical after a sample held was outside `margin` of it (even before `window` samples);
    `confirm` samples in a row warn, once an episode (it ends only once the signal has left:
    `window` samples in a row outside `margin`); past critical again within it after a lasting
    drop (`confirm` samples outside `margin`, or one after the guard's own rescale), said once
    more."""

    name = EventKind.PRECURSOR.value
    _state = (
        "samples",
        "streaks",
        "warned",
        "passed",
        "away",
        "rewritten",
        "given",
        "baselines",
        "losses",
        "grads",
        "lowest",
    )

    def __init__(self, config: PrecursorWarningConfig | None = None) -> None:
        self.config = config or PrecursorWarningConfig()
        # "signal/layer" -> [[step, value towards critical], ...], the latest `window`
        self.samples: dict[str, list[list[float]]] = {}
        self.streaks: dict[str, int] = {}  # samples in a row that met every rule
        self.warned: dict[str, bool] = {}  # a warning was given in the episode going on
        # past its critical level since it was last outside `margin` of it (warned of once)
        self.passed: dict[str, bool] = {}
        self.away: dict[str, int] = {}  # samples in a row outside `margin` of critical
        # the guard rewrote weights (a QK rescale) since the last sampled step
        self.rewritten = False
        self.given: dict[str, str] = {}  # the severity given in the episode going on
        self.baselines: dict[str, float] = {}  # log Z's: ln(vocabulary), else its first sample
        # the sampled steps' losses and grad norms, the latest `window` each, and the lowest
        # median of `window` of them so far ("loss", "grad_norm"): the effect of a collapse
        self.losses: list[float] = []
        self.grads: list[float] = []
        self.lowest: dict[str, float] = {}

    def update(self, point: MetricPoint) -> list[Event]:
        self.rewritten |= point.weights_rewritten
        if not point.precursors:
            return []
        self._follow_effect(point)
        events: list[Event] = []
        for signal, layers in point.precursors.items():
            critical = self.config.critical.get(signal)
            if critical is None or not layers:
                continue
            for layer, value in layers.items():
                event = self._judge(point, signal, str(layer), float(value), critical)
                if event is not None:
                    events.append(event)
        self.rewritten = False
        return events

    def _follow_effect(self, point: MetricPoint) -> None:
        """Keep the sampled step's loss and grad norm, and the lowest median of each."""
        window = self.config.window
        for name, kept, value in (
            ("loss", self.losses, point.loss),
            ("grad_norm", self.grads, point.grad_norm),
        ):
            if value is None or not math.isfinite(value):
                continue
            kept.append(float(value))
            del kept[:-window]
            if len(kept) == window:
                level = float(np.median(kept))
                self.lowest[name] = min(self.lowest.get(name, math.inf), level)

    def _effect(self) -> dict[str, float]:
        """How far the loss's and the grad norms' recent medians lie over their lowest (a share
        of it; NaN where unknown), and the rise in the loss that counts as its response."""
        out = {"loss_over_lowest": math.nan, "grad_over_lowest": math.nan, "loss_response": 0.0}
        window = self.config.window
        if len(self.losses) == window and self.lowest.get("loss", 0) > 0:
            level, lowest = float(np.median(self.losses)), self.lowest["loss"]
            spread = MAD_TO_SIGMA * float(np.median(np.abs(np.array(self.losses) - level)))
            noise = MEDIAN_NOISE * spread / math.sqrt(window)
            out["loss_over_lowest"] = level / lowest - 1
            out["loss_response"] = max(LOSS_RESPONSE, LOSS_NOISE * noise / lowest)
        if len(self.grads) == window and self.lowest.get("grad_norm", 0) > 0:
            out["grad_over_lowest"] = float(np.median(self.grads)) / self.lowest["grad_norm"]
        return out

    def _severity(self, signal: str, value: float, critical: float) -> Severity:
        """A collapse signal's warning where it has an effect: the loss or the grad norms
        respond, or a rising signal runs on far past critical; `info` where the run learns on."""
        if signal not in WEIGHED:
            return "warning"
        effect = self._effect()
        if effect["loss_over_lowest"] > effect["loss_response"]:
            return "warning"
        if effect["grad_over_lowest"] >= GRAD_RESPONSE:
            return "warning"
        if signal not in FALLING_PRECURSORS and value >= FAR_PAST * critical:
            return "warning"
        return "info"

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

    def _baseline(self, point: MetricPoint, key: str, value: float) -> float:
        """Log Z's reference: ln(vocabulary) where the probe sent the vocabulary, else the run's
        first log Z sample (near ln(vocabulary) while the logits are small, at the start)."""
        vocab = ((point.precursors or {}).get(VOCAB_SIZE) or {}).get("output")
        if vocab is not None and math.isfinite(vocab) and vocab > 1:
            self.baselines[key] = math.log(vocab)
        return self.baselines.setdefault(key, value)

    def _judge(
        self, point: MetricPoint, signal: str, layer: str, value: float, critical: float
    ) -> Event | None:
        key = f"{signal}/{layer}"
        if not math.isfinite(value):  # the non-finite detectors speak for this step
            return None
        base = self._baseline(point, key, value) if signal == "log_z" else 0.0
        held = [s for s in self.samples.get(key, []) if s[0] < point.step]  # a rollback undid
        held.append([float(point.step), _towards(signal, value, base)])
        cfg = self.config
        self.samples[key] = held = held[-cfg.window :]
        reading = _Reading(signal, layer, value, critical, base, len(held))
        target = _towards(signal, critical)
        now = _towards(signal, value, base)
        past = now >= target
        near = _near(now, target, cfg.margin)
        self.away[key] = 0 if near else self.away.get(key, 0) + 1
        if self.away[key] >= cfg.window:
            # the episode ends only once the signal has left the critical region: samples that
            # fail the trend rules while it stays far past critical (a collapsed layer) do not
            self.warned[key] = False
        if self.away[key] >= cfg.confirm or (self.away[key] and self.rewritten):
            # far from critical again and staying there, or brought there by the guard's rescale:
            # re-armed (a one-sample dip of a collapsed layer's sampled value is not)
            self.passed[key] = False
        if past and self.warned.get(key, False) and not self.passed.get(key, False):
            # warned of earlier in this episode and now past critical (again): said once more
            self.passed[key] = True
            return self._given(point, reading, 0, 0.0)
        trend = self._trend(held, target)
        if trend is None and self._arrived_past(held, target):
            # no trend to read yet (or a jump): the level says it, its `confirm` samples counted
            trend = (self._slope(held), 0)
            self.streaks[key] = max(self.streaks.get(key, 0), cfg.confirm - 1)
        if trend is None:
            self.streaks[key] = 0
            return self._upgrade(point, reading, near)
        self.streaks[key] = self.streaks.get(key, 0) + 1
        if self.streaks[key] < cfg.confirm or self.warned.get(key, False):
            return self._upgrade(point, reading, near)
        self.warned[key] = True
        self.passed[key] = past
        slope, steps_left = trend
        return self._given(point, reading, steps_left, slope)

    def _given(self, point: MetricPoint, reading: _Reading, steps_left: int, slope: float) -> Event:
        """The episode's event, weighed by its effect; the severity kept for `_upgrade`."""
        severity = self._severity(reading.signal, reading.value, reading.critical)
        self.given[reading.key] = severity
        return self._warning(point, reading, steps_left, slope, severity)

    def _upgrade(self, point: MetricPoint, reading: _Reading, near: bool) -> Event | None:
        """The warning of an episode noted as `info` whose effect shows now (the loss or grad
        norm responds) while the signal is still near critical; once an episode."""
        signal, value, critical = reading.signal, reading.value, reading.critical
        key = reading.key
        if not (near and self.warned.get(key, False) and self.given.get(key) == "info"):
            return None
        if self._severity(signal, value, critical) != "warning":
            return None
        self.given[key] = "warning"
        steps_left = 0 if _towards(signal, value) >= _towards(signal, critical) else -1
        return self._warning(point, reading, steps_left, 0.0, "warning")

    def _warning(
        self,
        point: MetricPoint,
        reading: _Reading,
        steps_left: int,
        slope: float,
        severity: Severity,
    ) -> Event:
        """The `precursor` event of one layer's signal: heading for its critical level, with
        the steps left at its trend (-1: not read), or already past it; log Z's critical level
        is its distance from its base (ln(vocabulary))."""
        signal, layer, value, critical = (
            reading.signal,
            reading.layer,
            reading.value,
            reading.critical,
        )
        base, samples = reading.base, reading.samples
        falling = signal in FALLING_PRECURSORS
        heading = "falling" if falling else "rising"
        past = _towards(signal, value, base) >= _towards(signal, critical)
        level = critical
        if signal == "log_z":
            base = self.baselines.get(f"{signal}/{layer}", base)
            sign = "+" if value >= base else "-"
            level = base + critical if value >= base else base - critical
            critical_text = f"{fmt(level)} (ln(vocabulary) {fmt(base)} {sign} {fmt(critical)})"
        else:
            critical_text = fmt(critical)
        where = (
            f"is past its critical level {critical_text}"
            if past
            else f"is {heading} towards its critical level {critical_text}"
            + (
                f": about {steps_left} steps left at its trend over the last {samples} samples"
                if steps_left >= 0
                else ""
            )
        )
        effect = self._effect()
        metrics: dict[str, Any] = {
            "layer": layer,
            "signal": signal,
            "value": value,
            "critical": level,
            "steps_left": 0 if past else steps_left,
            "slope_per_step": -slope if falling else slope,
            "samples": samples,
            "loss_over_lowest": effect["loss_over_lowest"],
            "grad_over_lowest": effect["grad_over_lowest"],
        }
        if signal == "log_z":
            metrics["ln_vocabulary"] = base
        if severity == "info":
            advice = (
                "the loss and grad norm have not responded and it runs on no further: noted, "
                "no action (a warning follows where they respond)"
            )
        else:
            advice = (
                "act before the loss moves (lower the LR, QK-norm or max-logit clipping for "
                "attention logits, z-loss for log Z; precursors.preempt.actions lets the guard "
                "act)"
            )
        return self.event(
            point,
            severity,
            f"{signal} of {_named(layer)} at {fmt(value)} {where}; {advice}",
            metrics,
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


def _towards(signal: str, value: float, base: float = 0.0) -> float:
    """The value on a scale that rises towards critical: negated for the falling signals, log
    Z's distance from `base` (ln(vocabulary)); a critical level is passed with `base` 0."""
    if signal in FALLING_PRECURSORS:
        return -value
    if signal == "log_z":
        return abs(value - base)
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
