"""`DetectorSuite`: the detectors a config enables, run in a fixed order on each point; the set
is an open registry (`register_detector`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from trainguard.config import GuardConfig
from trainguard.detectors.base import Detector, EvalPoint, MetricPoint
from trainguard.detectors.evals import EvalDeclineDetector
from trainguard.detectors.gradients import (
    GradExplosionDetector,
    GradSpikeDetector,
    VanishingGradientDetector,
)
from trainguard.detectors.health import HealthThresholdDetector
from trainguard.detectors.loss_ema import LossEmaDetector, loss_ema_routed
from trainguard.detectors.loss_spike import LossSpikeDetector
from trainguard.detectors.nonfinite import NonFiniteDetector
from trainguard.detectors.precursors import PrecursorWarningDetector
from trainguard.detectors.ranks import RankOutlierDetector, StragglerDetector
from trainguard.detectors.replicas import ReplicaDivergenceDetector
from trainguard.detectors.routing import RoutingCollapseDetector
from trainguard.detectors.series import MAX_SPAN, MIN_SPAN, MetricSeries
from trainguard.detectors.token_accuracy import TokenAccuracyDetector
from trainguard.detectors.trends import DivergenceDetector, OscillationDetector, StallDetector
from trainguard.detectors.weights import WeightJumpDetector
from trainguard.events import Event, TrainguardError

DetectorFactory = Callable[[GuardConfig], Detector | None]
"""Builds a detector from a run's config, or None where the config leaves it off."""

_REGISTRY: list[tuple[Any, DetectorFactory]] = []  # (what was registered, its factory)

Registered = TypeVar("Registered", bound="type[Detector] | DetectorFactory")


def register_detector(factory: Registered) -> Registered:
    """Add a detector to every `DetectorSuite` built from now on, after those registered before:
    a `Detector` subclass (built with no arguments; usable as a class decorator) or a factory
    taking the `GuardConfig`. Returns it unchanged."""
    if isinstance(factory, type):
        detector_class: type[Detector] = factory
        _REGISTRY.append((factory, lambda _config: detector_class()))
    else:
        _REGISTRY.append((factory, factory))
    return factory


def unregister_detector(factory: type[Detector] | DetectorFactory) -> None:
    """Remove what `register_detector` added (the same class or factory); nothing if absent."""
    for i, (registered, _) in enumerate(_REGISTRY):
        if registered is factory:
            del _REGISTRY[i]
            return


def _build(registered: Any, factory: DetectorFactory, config: GuardConfig) -> Detector | None:
    try:
        return factory(config)
    except TypeError as exc:  # a class whose constructor wants arguments, most often
        name = getattr(registered, "__name__", repr(registered))
        raise TrainguardError(
            f"the registered detector {name} could not be built ({exc}): a class is built with "
            "no arguments; register a factory instead, such as lambda config: "
            f"{name}(...)"
        ) from None


def _enabled(build: Callable[[GuardConfig], Detector], on: Callable[[GuardConfig], bool]) -> None:
    """Register a built-in detector that its config section switches on and off."""
    register_detector(lambda cfg: build(cfg) if on(cfg) else None)


register_detector(lambda cfg: NonFiniteDetector(cfg.overflow))
_enabled(lambda c: LossSpikeDetector(c.loss_spike), lambda c: c.loss_spike.enabled)
_enabled(lambda c: GradSpikeDetector(c.grad_spike), lambda c: c.grad_spike.enabled)
_enabled(lambda c: GradExplosionDetector(c.grad_explosion), lambda c: c.grad_explosion.enabled)
_enabled(lambda c: VanishingGradientDetector(c.vanishing), lambda c: c.vanishing.enabled)
_enabled(lambda c: WeightJumpDetector(c.weight_jump), lambda c: c.weight_jump.enabled)
_enabled(lambda c: StallDetector(c.stall), lambda c: c.stall.enabled)
_enabled(lambda c: DivergenceDetector(c.divergence), lambda c: c.divergence.enabled)
_enabled(lambda c: OscillationDetector(c.oscillation), lambda c: c.oscillation.enabled)
_enabled(lambda c: HealthThresholdDetector(c.health), lambda c: c.health.enabled)
_enabled(lambda c: RankOutlierDetector(c.ranks), lambda c: c.ranks.enabled)
_enabled(lambda c: StragglerDetector(c.straggler), lambda c: c.straggler.enabled)
_enabled(lambda c: ReplicaDivergenceDetector(), lambda c: c.replicas.every > 0)
_enabled(lambda c: RoutingCollapseDetector(c.routing), lambda c: c.routing.enabled)
_enabled(lambda c: LossEmaDetector(c.alerts), lambda c: loss_ema_routed(c.alerts))
_enabled(lambda c: EvalDeclineDetector(c.eval_decline), lambda c: c.eval_decline.enabled)
_enabled(lambda c: TokenAccuracyDetector(c.token_accuracy), lambda c: c.token_accuracy.enabled)
_enabled(
    lambda c: PrecursorWarningDetector(c.precursors.warning),
    lambda c: c.precursors.enabled and c.precursors.warning.enabled,
)


class DetectorSuite:
    """Runs every registered detector the config enables on a `MetricPoint`, in the order they
    were registered; the same code online and offline."""

    def __init__(self, config: GuardConfig | None = None) -> None:
        cfg = config or GuardConfig()
        built = (_build(registered, factory, cfg) for registered, factory in _REGISTRY)
        self.detectors: list[Detector] = [d for d in built if d is not None]

    def update(self, point: MetricPoint) -> list[Event]:
        events: list[Event] = []
        for detector in self.detectors:
            events.extend(detector.update(point))
        return events

    def evaluate(self, point: EvalPoint) -> list[Event]:
        """The events every detector raises on an evaluation of the model, in their order."""
        events: list[Event] = []
        for detector in self.detectors:
            events.extend(detector.evaluate(point))
        return events

    def run(self, series: MetricSeries) -> list[Event]:
        """Every event the detectors raise over a whole series, as `update` step by step (and
        `evaluate` at each of `series.evals`, after the steps up to its own) would raise them
        and in the same order, with the quiet stretches taken in bulk."""
        evals = sorted(series.evals, key=lambda e: e.step)  # stable: same-step order kept
        # where each evaluation comes: before the first training step past its own
        at = np.searchsorted(series.steps, [e.step for e in evals], side="right").tolist()
        cuts = sorted(set(at) | {0, len(series)})
        parts = (
            [(0, series)]
            if len(cuts) == 2
            else [(a, series.part(a, b)) for a, b in itertools.pairwise(cuts)]
        )
        found: list[tuple[int, int, int, int, Event]] = []
        for order, detector in enumerate(self.detectors):
            k = 0
            for offset, part in parts:
                while k < len(evals) and at[k] <= offset:  # the evaluations before this part
                    found.extend((at[k], 0, k, order, e) for e in detector.evaluate(evals[k]))
                    k += 1
                found.extend((offset + i, 1, 0, order, e) for i, e in self._run_one(detector, part))
            for j in range(k, len(evals)):  # after the last step
                found.extend((at[j], 0, j, order, e) for e in detector.evaluate(evals[j]))
        found.sort(key=lambda item: item[:4])
        return [item[4] for item in found]

    @staticmethod
    def _run_one(detector: Detector, series: MetricSeries) -> list[tuple[int, Event]]:
        """One detector's events over a series of training steps, by index."""
        found: list[tuple[int, Event]] = []
        n = len(series)
        i, series.span = 0, MIN_SPAN
        while i < n:
            start, i = i, detector.advance(series, i)
            quiet = i >= series.chunk_end(start)
            series.span = (
                min(2 * series.span, MAX_SPAN) if quiet else max(2 * (i - start), MIN_SPAN)
            )
            if i < n:
                found.extend((i, e) for e in detector.update(series.point(i)))
                i += 1
        return found

    def state_dict(self) -> dict[str, Any]:
        return {d.name: d.state_dict() for d in self.detectors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for d in self.detectors:
            if d.name in state:
                d.load_state_dict(state[d.name])
