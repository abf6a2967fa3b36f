"""`Monitor`: the guard's pipeline without a model: numbers in, detectors, policy, enrichment,
sinks; its decisions are advice."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from trainguard.config import ConfigInput, GuardConfig
from trainguard.detectors import DetectorSuite, MetricPoint
from trainguard.detectors.base import EvalPoint
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
from trainguard.signals.host_reads import read_now
from trainguard.sinks import Sink

TargetCheck = bool | Callable[[int], bool]


class Monitor:
    """Watches a run from plain numbers (`observe(step, loss=...)`) and records what it finds;
    nothing is stepped or skipped, and a halt is logged and returned, not raised.

    Each step goes one way: detectors -> policy -> enrichment -> sinks.
    """

    def __init__(
        self,
        config: ConfigInput = None,
        run_dir: str | Path | None = None,
        sinks: Sequence[Sink] = (),
        *,
        device: torch.device | None = None,
    ) -> None:
        """`device` is where a distributed run's collectives keep their tensors."""
        self.config = GuardConfig.of(config)
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
        self._last_evaluation: int | None = None  # the step of the last `evaluate`
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
            token_accuracy=_as_float(checked_token_accuracy(token_accuracy)),
            precursors=_precursors(precursors),
        )
        decision, events = self._decide(point, batch_ids)
        decision = self._finish(point, decision, events, None)
        self.global_step = point.step + 1
        if decision.action == "halt":
            decision = self._halt(decision, raise_error=False)
        return decision

    def evaluate(self, step: int, values: Mapping[str, Any]) -> list[Event]:
        """Feed evaluations of the model made after the training steps up to `step`, as
        `{"val_loss": 2.1, "mmlu": 0.41}` (a loss, perplexity or error is lower-is-better,
        anything else higher-is-better): the detectors judge each (`eval_decline`: forgetting),
        they go to `evals.jsonl` and the sinks, and the events found are returned: warnings at
        most, as an evaluation never skips, rolls back or halts."""
        step = _evaluation_step(step)
        named = _evaluation_values(step, values)
        restored = self.policy.restored_to  # a rollback replays steps: evaluations with them
        if (
            self._last_evaluation is not None
            and step < self._last_evaluation
            and not (restored is not None and step >= restored)
        ):
            raise TrainguardError(
                f"evaluation at step {step} after one at step {self._last_evaluation}: "
                "evaluation steps must not go back; pass the training step each was made at"
            )
        # a step past the training's (an epoch or sample count passed by mistake) is taken as
        # it is, but later evaluations are held only to the training step, not refused
        self._last_evaluation = min(step, self.global_step) if self.global_step else step
        events: list[Event] = []
        for name, value in named.items():
            point = EvalPoint.of(step, name, value)
            events += self.policy.on_evaluation(point, self.detectors.evaluate(point))
        self.recorder.record_evaluation(step, named)
        return self._publish(events)

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
            "last_evaluation": self._last_evaluation,
            **self.recorder.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.detectors.load_state_dict(state["detectors"])
        self.policy.load_state_dict(state["policy"])
        self.recorder.load_state_dict(state)
        last = state.get("last_evaluation")  # absent from checkpoints of older versions
        self._last_evaluation = int(last) if last is not None else None

    def flush(self) -> None:
        """Return once `metrics.jsonl`, `events.jsonl` and `evals.jsonl` hold every line
        recorded so far (a writer thread writes them; `close` and critical events flush)."""
        self.recorder.flush()

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


EXAMPLE = "{'val_loss': 2.1, 'mmlu': 0.41}"


def _evaluation_step(step: object) -> int:
    """An evaluation's step: a whole number, not negative; a one-line error otherwise."""
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        whole = int(step)
    else:
        raise TrainguardError(
            f"guard.evaluate: step {step!r} is not a whole number; pass the training step the "
            "evaluation was made at, such as guard.global_step"
        )
    if whole < 0:
        raise TrainguardError(f"guard.evaluate: step {whole} is negative; steps count from 0")
    return whole


def _evaluation_values(step: int, values: object) -> dict[str, float]:
    """The evaluations of one `evaluate` call as floats by name; a one-line error for anything
    that is not a non-empty mapping of names to numbers."""
    if not isinstance(values, Mapping):
        raise TrainguardError(
            f"guard.evaluate at step {step}: takes a mapping of evaluation name to number, "
            f"such as {EXAMPLE}, not a {type(values).__name__}"
        )
    if not values:
        raise TrainguardError(
            f"guard.evaluate at step {step}: no evaluations given; pass at least one, such "
            f"as {EXAMPLE}"
        )
    named: dict[str, float] = {}
    for name, value in values.items():
        if not isinstance(name, str) or not name.strip():
            raise TrainguardError(
                f"guard.evaluate at step {step}: evaluation name {name!r} is not a non-empty "
                f"string; name each evaluation, such as {EXAMPLE}"
            )
        number = _evaluation_number(value)
        if number is None:
            raise TrainguardError(
                f"guard.evaluate at step {step}: evaluation {name!r} is {_shown(value)} "
                f"({type(value).__name__}), not a number; pass a float, such as {EXAMPLE}"
            )
        named[name] = number
    return named


def _evaluation_number(value: object) -> float | None:
    """A number, a one-element tensor or array as a float; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return float(read_now(value)[0])
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:  # an integer past 1e308
            return math.inf if str(value)[0] != "-" else -math.inf
    return None


def checked_token_accuracy(value: object) -> torch.Tensor | float | None:
    """A token accuracy as passed to `step` or `observe`: None, a one-element tensor (left on
    the device), or a number in [0, 1]; anything else is a one-line error."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        share = float(value)
        if 0.0 <= share <= 1.0:
            return share
    raise TrainguardError(
        f"token_accuracy={_shown(value)} ({type(value).__name__}): pass the share of tokens "
        "whose argmax is the target, a number in [0, 1] or a one-element tensor (the mean over "
        "the batch)"
    )


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


def _as_float(value: torch.Tensor | float | None) -> float | None:
    if isinstance(value, torch.Tensor):  # a one-element tensor: one host read
        return float(read_now(value)[0])
    return None if value is None else float(value)


def _shown(value: object) -> str:
    """`repr(value)` cut to 40 characters, for a one-line error."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
