"""`LossEmaDetector`: the loss over `alerts.loss_ema_ratio` times its exponential moving average,
the original alert check, raised as an `info` event that the policy takes no action on."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from trainguard.config import AlertsConfig
from trainguard.detectors.base import Detector, MetricPoint, fmt
from trainguard.detectors.series import MetricSeries, ema, ema_one, first_true, stop_at
from trainguard.events import SEVERITY_RANK, Event

KIND = "loss_above_ema"
WARMUP = 20  # finite losses seen before the check starts: the EMA needs a few to settle


def loss_ema_routed(config: AlertsConfig) -> bool:
    """Whether an alert rule can match a `loss_above_ema` event (the default rules do); the
    detector runs only then."""
    return any(
        (not rule.kinds or KIND in rule.kinds) and SEVERITY_RANK[rule.min_severity] == 0
        for rule in config.rules
    )


class LossEmaDetector(Detector):
    """Raises `loss_above_ema` (info) at a finite loss over `loss_ema_ratio` x the EMA of the
    finite losses before it (smoothing `loss_ema_alpha`), from the 21st finite loss on."""

    name: ClassVar[str] = KIND
    _state: ClassVar[tuple[str, ...]] = ("ema", "seen")

    def __init__(self, config: AlertsConfig) -> None:
        self.ratio = config.loss_ema_ratio
        self.alpha = config.loss_ema_alpha
        self.ema: float | None = None
        self.seen = 0

    def _emas(self, losses: np.ndarray) -> np.ndarray:
        """The EMA before each of `losses` (finite ones) and after the last: NaN while none."""
        if self.ema is not None:
            return ema(losses, self.ema, self.alpha)
        if len(losses) == 0:
            return np.full(1, np.nan)
        return np.concatenate(([np.nan], ema(losses[1:], float(losses[0]), self.alpha)))

    def _over(self, seen_before: Any, losses: Any, before: Any) -> Any:
        """The rule, once for both paths: a loss over `ratio` x the EMA before it (NaN while
        none), from the `WARMUP + 1`-th finite loss on; arrays, or one step's figures."""
        return (seen_before >= WARMUP) & (losses > self.ratio * before)

    def update(self, point: MetricPoint) -> list[Event]:
        if not math.isfinite(point.loss):
            return []
        loss = point.loss
        before = self.ema
        over = bool(self._over(self.seen, loss, math.nan if before is None else before))
        self.ema = float(loss) if before is None else ema_one(float(loss), before, self.alpha)
        self.seen += 1
        if not over or before is None:
            return []
        message = f"loss {fmt(loss)} is over {self.ratio:g} x its EMA {fmt(before)}"
        return [
            self.event(point, "info", message, {"loss": loss, "ema": before, "ratio": self.ratio})
        ]

    def advance(self, series: MetricSeries, start: int) -> int:
        idx, losses = series.finite_losses(start)
        if len(losses) == 0:
            return series.chunk_end(start)
        emas = self._emas(losses)
        with np.errstate(invalid="ignore"):
            over = self._over(self.seen + np.arange(len(losses)), losses, emas[:-1])
        first = first_true(over)
        f = len(losses) if first is None else first
        if f > 0:
            self.ema = float(emas[f])
            self.seen += f
        return stop_at(idx, first, series, start)
