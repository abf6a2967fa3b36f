"""`Monitor`: the guard's pipeline without a model: numbers in, detectors, policy, enrichment,
sinks; its decisions are advice."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from trainguard.config import GuardConfig
from trainguard.detectors import DetectorSuite, MetricPoint
from trainguard.distributed import RankContext
from trainguard.enrichment import EventEnricher
from trainguard.events import (
    Decision,
    Event,
    EventKind,
    TrainguardError,
    TrainingHalted,
    check_kind,
)
from trainguard.policy import StepPolicy
from trainguard.recorder import Recorder
from trainguard.signals.gradients import StepSignals
from trainguard.sinks import Sink

TargetCheck = bool | Callable[[int], bool]


class Monitor:
    """Watches a run from plain numbers (`observe(step, loss=...)`) and records what it finds;
    nothing is stepped or skipped, and a halt is logged and returned, not raised.

    Each step goes one way: detectors -> policy -> enrichment -> sinks.
    """

    def __init__(
        self,
        config: GuardConfig | None = None,
        run_dir: str | Path | None = None,
        sinks: Sequence[Sink] = (),
        *,
        device: torch.device | None = None,
    ) -> None:
        """`device` is where a distributed run's collectives keep their tensors."""
        self.config = config if config is not None else GuardConfig()
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.detectors = DetectorSuite(self.config)
        self.policy = StepPolicy(
            self.config.policy,
            self.config.recovery.sized(self.config.diagnosis.total_steps),
            self.config.precursors.preempt,
        )
        self.ranks = RankContext.detect(device if device is not None else torch.device("cpu"))
        self.enricher = EventEnricher(self.ranks)
        self.global_step = 0
        self._closed = False
        self._open_files()
        try:
            leader = self.ranks is None or self.ranks.is_leader
            self.recorder = Recorder(self.config, self.run_dir, leader, sinks)
        except BaseException:
            self._close_files()
            raise

    # -- the pipeline -------------------------------------------------------------------------
    def observe(
        self,
        step: int,
        loss: float,
        grad_norm: float | None = None,
        lr: float | None = None,
        loss_scale: float | None = None,
        group_grad_norms: dict[str, float] | None = None,
        batch_ids: Iterable[Any] | None = None,
        token_accuracy: torch.Tensor | float | None = None,
        precursors: dict[str, dict[str, float]] | None = None,
    ) -> Decision:
        """Feed the detectors from plain numbers without touching a model; the decision is
        advisory: nothing is stepped or skipped, and a halt is logged and returned.
        `token_accuracy` is the share of tokens whose argmax is the target (a tensor is read
        here: one host transfer); `precursors` (signal -> layer -> value, as `MetricPoint` has
        them) are measured ones of your own."""
        point = MetricPoint(
            step=int(step),
            loss=float(loss),
            grad_norm=None if grad_norm is None else float(grad_norm),
            lr=None if lr is None else float(lr),
            loss_scale=None if loss_scale is None else float(loss_scale),
            group_grad_norms=group_grad_norms,
            token_accuracy=None if token_accuracy is None else float(token_accuracy),
            precursors=_precursors(precursors),
        )
        decision, events = self._decide(point, batch_ids)
        decision = self._finish(point, decision, events, None)
        self.global_step = point.step + 1
        if decision.action == "halt":
            decision = self._halt(decision, raise_error=False)
        return decision

    def _decide(
        self,
        point: MetricPoint,
        batch_ids: Iterable[Any] | None,
        can_roll_back: TargetCheck = False,
        group_report: Callable[[], dict[str, Any]] | None = None,
    ) -> tuple[Decision, list[Event]]:
        """Detect, decide, enrich and record: the policy's decision and its events enriched."""
        events = self.detectors.update(point)
        decision = self.policy.decide(point, events, can_roll_back)
        enriched = self._publish(decision.events, batch_ids, group_report)
        self.recorder.action_counts[decision.action] += 1
        return decision, enriched

    def _publish(
        self,
        events: Sequence[Event],
        batch_ids: Iterable[Any] | None = None,
        group_report: Callable[[], dict[str, Any]] | None = None,
    ) -> list[Event]:
        """Check each event's kind, enrich and record the events; the enriched ones."""
        for event in events:
            check_kind(event.kind)
        enriched = self.enricher.enrich(events, batch_ids, group_report)
        for event in enriched:
            self.recorder.emit(event)
        return enriched

    def _finish(
        self,
        point: MetricPoint,
        decision: Decision,
        events: list[Event],
        signals: StepSignals | None,
    ) -> Decision:
        """Record the step's metrics; what the step did: the policy's decision with every event
        of the step (detected, then reported by actions and diagnosis) and its record."""
        record = self.recorder.record(point, decision.action, events, signals)
        return dataclasses.replace(decision, events=events, metrics=record)

    def _halt(self, decision: Decision, raise_error: bool) -> Decision:
        """Record the halt with its diagnosis; raise `TrainingHalted` or return the decision."""
        diagnosis = f"trainguard halted the run at step {decision.step}: {decision.reason}"
        (event,) = self._publish(
            [
                Event(
                    step=decision.step,
                    kind=EventKind.HALT,
                    severity="critical",
                    message=diagnosis,
                    metrics={"events": [e.kind for e in decision.events]},
                    action="halt",
                )
            ]
        )
        halted = dataclasses.replace(decision, events=[*decision.events, event])
        if raise_error:
            self.close()
            raise TrainingHalted(diagnosis, halted)
        return halted

    # -- what was recorded ----------------------------------------------------------------------
    @property
    def sinks(self) -> list[Sink]:
        return self.recorder.sinks

    @property
    def event_counts(self) -> dict[str, int]:
        return self.recorder.event_counts

    @property
    def action_counts(self) -> dict[str, int]:
        return self.recorder.action_counts

    @property
    def run_lock(self) -> Any:
        return self.recorder.run_lock

    # -- state and lifetime -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Detector and policy state with the step counter: plain data, safe to checkpoint."""
        return {
            "global_step": self.global_step,
            "detectors": self.detectors.state_dict(),
            "policy": self.policy.state_dict(),
            **self.recorder.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.detectors.load_state_dict(state["detectors"])
        self.policy.load_state_dict(state["policy"])
        self.recorder.load_state_dict(state)

    def close(self) -> None:
        """Record a `run_closed` event, flush and close every sink and release the run folder;
        the monitor stays usable for `state_dict`."""
        if self._closed:
            return
        self._closed = True
        self._before_close()
        self._publish(  # how `trainguard watch` tells a finished run from one that was killed
            [
                Event(
                    step=self.global_step,
                    kind=EventKind.RUN_CLOSED,
                    severity="info",
                    message=f"the run closed at step {self.global_step}",
                )
            ]
        )
        self._release_outputs()

    def _open_files(self) -> None:
        """Open the files a subclass writes beside the recorder's (before the run folder lock)."""

    def _close_files(self) -> None:
        """Close what `_open_files` opened."""

    def _before_close(self) -> None:
        """Finish what must be recorded before the `run_closed` event."""

    def _release_outputs(self) -> None:
        """Close the sinks and other files, then unlock the run folder (last, so that no other
        writer starts while these still write)."""
        self.recorder.close(then=self._close_files)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _precursors(given: dict[str, dict[str, float]] | None) -> dict[str, dict[str, float]] | None:
    """Precursors passed to `observe`, as plain floats (a one-line error where malformed)."""
    if given is None:
        return None
    try:
        return {
            str(signal): {str(layer): float(v) for layer, v in layers.items()}
            for signal, layers in given.items()
        }
    except (AttributeError, TypeError, ValueError):
        raise TrainguardError(
            "observe(precursors=...) takes {signal: {layer: number}}, such as "
            "{'max_logit': {'0': 12.5}}"
        ) from None
