"""`RoutingCollapseDetector`: a mixture-of-experts router that stops spreading tokens."""

from __future__ import annotations

import math

from trainguard.config import RoutingConfig
from trainguard.detectors.base import Detector, MetricPoint, fmt
from trainguard.detectors.series import MetricSeries
from trainguard.detectors.stats import median
from trainguard.events import Event


class RoutingCollapseDetector(Detector):
    """Routing entropy below `entropy_fraction` of its early level (the median of the first
    `reference_steps`), or one expert taking over `max_share` of the tokens, for `patience`
    steps; reported once until it recovers."""

    name = "routing_collapse"
    _state = ("early", "reference", "below", "reported")

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self.early: list[float] = []
        self.reference: float | None = None
        self.below = 0
        self.reported = False

    def advance(self, series: MetricSeries, start: int) -> int:
        return len(series)  # a loss log carries no routing figures

    def update(self, point: MetricPoint) -> list[Event]:
        r = point.routing
        if not r:
            return []
        cfg = self.config
        entropy = r.get("entropy", math.nan)
        if self.reference is None and math.isfinite(entropy):
            self.early.append(entropy)
            if len(self.early) >= cfg.reference_steps:
                self.reference = median(self.early)
                self.early = []
        low = (
            self.reference is not None
            and math.isfinite(entropy)
            and entropy < cfg.entropy_fraction * self.reference
        )
        hogged = r.get("max_share", 0.0) > cfg.max_share
        if not (low or hogged):
            self.below = 0
            self.reported = False
            return []
        self.below += 1
        if self.below < cfg.patience or self.reported:
            return []
        self.reported = True
        why = []
        if low:
            why.append(
                f"routing entropy {fmt(entropy)} fell under {cfg.entropy_fraction:.0%} of "
                f"its early {fmt(self.reference)}"
            )
        if hogged:
            why.append(f"one expert takes {r['max_share']:.0%} of the tokens")
        message = "routing collapse: " + " and ".join(why) + f" for {self.below} steps"
        return [self.event(point, "warning", message, dict(r))]
