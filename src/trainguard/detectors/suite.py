"""`DetectorSuite`: the detectors a config enables, run in a fixed order on each point."""

from __future__ import annotations

from typing import Any

from trainguard.config import GuardConfig
from trainguard.detectors.base import Detector, MetricPoint
from trainguard.detectors.gradients import (
    GradExplosionDetector,
    GradSpikeDetector,
    VanishingGradientDetector,
)
from trainguard.detectors.health import HealthThresholdDetector
from trainguard.detectors.loss_ema import LossEmaDetector, loss_ema_routed
from trainguard.detectors.loss_spike import LossSpikeDetector
from trainguard.detectors.nonfinite import NonFiniteDetector
from trainguard.detectors.ranks import RankOutlierDetector, StragglerDetector
from trainguard.detectors.routing import RoutingCollapseDetector
from trainguard.detectors.series import MAX_SPAN, MIN_SPAN, MetricSeries
from trainguard.detectors.trends import DivergenceDetector, OscillationDetector, StallDetector
from trainguard.detectors.weights import WeightJumpDetector
from trainguard.events import Event


class DetectorSuite:
    """Runs every enabled detector on a `MetricPoint`; the same code online and offline."""

    def __init__(self, config: GuardConfig | None = None) -> None:
        cfg = config or GuardConfig()
        detectors: list[Detector] = [NonFiniteDetector(cfg.overflow)]
        optional: list[tuple[bool, Detector]] = [
            (cfg.loss_spike.enabled, LossSpikeDetector(cfg.loss_spike)),
            (cfg.grad_spike.enabled, GradSpikeDetector(cfg.grad_spike)),
            (cfg.grad_explosion.enabled, GradExplosionDetector(cfg.grad_explosion)),
            (cfg.vanishing.enabled, VanishingGradientDetector(cfg.vanishing)),
            (cfg.weight_jump.enabled, WeightJumpDetector(cfg.weight_jump)),
            (cfg.stall.enabled, StallDetector(cfg.stall)),
            (cfg.divergence.enabled, DivergenceDetector(cfg.divergence)),
            (cfg.oscillation.enabled, OscillationDetector(cfg.oscillation)),
            (cfg.health.enabled, HealthThresholdDetector(cfg.health)),
            (cfg.ranks.enabled, RankOutlierDetector(cfg.ranks)),
            (cfg.straggler.enabled, StragglerDetector(cfg.straggler)),
            (cfg.routing.enabled, RoutingCollapseDetector(cfg.routing)),
            (loss_ema_routed(cfg.alerts), LossEmaDetector(cfg.alerts)),
        ]
        detectors.extend(d for enabled, d in optional if enabled)
        self.detectors = detectors

    def update(self, point: MetricPoint) -> list[Event]:
        events: list[Event] = []
        for detector in self.detectors:
            events.extend(detector.update(point))
        return events

    def run(self, series: MetricSeries) -> list[Event]:
        """Every event the detectors raise over a whole series, as `update` step by step would
        raise them and in the same order, with the quiet stretches taken in bulk."""
        found: list[tuple[int, int, Event]] = []
        n = len(series)
        for order, detector in enumerate(self.detectors):
            i, series.span = 0, MIN_SPAN
            while i < n:
                start, i = i, detector.advance(series, i)
                quiet = i >= series.chunk_end(start)
                series.span = (
                    min(2 * series.span, MAX_SPAN) if quiet else max(2 * (i - start), MIN_SPAN)
                )
                if i < n:
                    found.extend((i, order, e) for e in detector.update(series.point(i)))
                    i += 1
        found.sort(key=lambda item: (item[0], item[1]))
        return [e for _, _, e in found]

    def state_dict(self) -> dict[str, Any]:
        return {d.name: d.state_dict() for d in self.detectors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for d in self.detectors:
            if d.name in state:
                d.load_state_dict(state[d.name])
