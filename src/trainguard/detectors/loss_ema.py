"""`LossEmaDetector`: the loss over `alerts.loss_ema_ratio` times its exponential moving average,
the original alert check, raised as an `info` event that the policy takes no action on."""

from __future__ import annotations

import math
from typing import ClassVar

from trainguard.config import AlertsConfig
from trainguard.detectors.base import Detector, MetricPoint, fmt
from trainguard.detectors.series import MetricSeries
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

    def update(self, point: MetricPoint) -> list[Event]:
        loss = point.loss
        if not math.isfinite(loss):
            return []
        self.seen += 1
        events: list[Event] = []
        ema = self.ema
        if ema is not None and self.seen > WARMUP and loss > self.ratio * ema:
            events.append(
                self.event(
                    point,
                    "info",
                    f"loss {fmt(loss)} is over {self.ratio:g} x its EMA {fmt(ema)}",
                    {"loss": loss, "ema": ema, "ratio": self.ratio},
                )
            )
        self.ema = loss if ema is None else (1 - self.alpha) * ema + self.alpha * loss
        return events

    def advance(self, series: MetricSeries, start: int) -> int:
        """The same arithmetic as `update` over the chunk, up to the first step it raises at."""
        end = series.chunk_end(start)
        ema, seen, a, ratio = self.ema, self.seen, self.alpha, self.ratio
        i = start
        for loss in series.loss[start:end].tolist():
            if math.isfinite(loss):
                if ema is not None and seen + 1 > WARMUP and loss > ratio * ema:
                    break
                seen += 1
                ema = loss if ema is None else (1 - a) * ema + a * loss
            i += 1
        self.ema, self.seen = ema, seen
        return i
