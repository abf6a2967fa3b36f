"""`StepDiagnosis`: what a guarded run learns about a bad step after its decision: the set-up
lint, the samples behind a loss spike, the module that made a NaN, and each flagged rank's
verdict (suspect or transient)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainguard.actions.snapshots import rng_state, set_rng_state
from trainguard.config import GuardConfig
from trainguard.detectors.ranks import METRICS, OwnRule, RankOutlierDetector
from trainguard.diagnosis.lint import Finding, lint
from trainguard.diagnosis.nonfinite_trace import NonFiniteReport, trace_nonfinite
from trainguard.diagnosis.spike_samples import blame_samples
from trainguard.distributed import LocalGradNorm, RankContext
from trainguard.events import Decision, Event, EventKind
from trainguard.recovery import plain_id
from trainguard.signals.host_reads import read_now


class StepDiagnosis:
    """Replays and inspects a step the policy already ruled on, from the step's own starting
    state, and puts back what the replay touched (buffers, random state, gradients)."""

    def __init__(
        self,
        config: GuardConfig,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer,
        ranks: RankContext | None,
        local_norm: LocalGradNorm | None,
        rank_judge: RankOutlierDetector,
    ) -> None:
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.ranks = ranks
        self.local_norm = local_norm
        self.rank_judge = rank_judge  # the live detector: it judges by what the run taught it
        self.findings: list[Finding] = []
        self.replay_rng: dict[str, Any] | None = rng_state()  # where the next forward starts
        self.last_trace = -(10**9)

    def state_dict(self) -> dict[str, Any]:
        """When the last replay ran (`diagnosis.trace_every` counts from it)."""
        return {"last_trace": self.last_trace}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_trace = int(state.get("last_trace", self.last_trace))

    def lint(self, model: nn.Module, scheduler: Any, scaler: Any) -> list[Event]:
        """Check the set-up once, before the first step, with `scheduler`'s LR schedule; each
        finding is an info event."""
        cfg = self.config.diagnosis
        dtype = getattr(torch, cfg.autocast_dtype) if cfg.autocast_dtype else None
        self.findings = lint(
            model,
            self.optimizer,
            scheduler,
            scaler,
            self.config.max_grad_norm,
            cfg.total_steps,
            dtype,
        )
        return [
            Event(
                step=0,
                kind=EventKind.LINT,
                severity="info",
                message=f"{finding.message}; fix: {finding.fix}",
                metrics=finding.to_dict(),
            )
            for finding in self.findings
        ]

    def blame(
        self,
        decision: Decision,
        per_sample_losses: torch.Tensor | Callable[[], torch.Tensor],
        ids: Iterable[Any] | None,
        text: Sequence[str] | None,
    ) -> tuple[list[Any], list[Event]]:
        """The samples that carry a loss spike: their ids (for the quarantine) and the event."""
        cfg = self.config.diagnosis
        if callable(per_sample_losses) and not isinstance(per_sample_losses, torch.Tensor):
            with torch.no_grad():
                per_sample_losses = per_sample_losses()
        values = read_now(per_sample_losses.float())  # a spike's step only
        id_list = [plain_id(i) for i in ids] if ids is not None else None
        samples = blame_samples(
            values,
            id_list,
            text,
            cfg.sample_z,
            cfg.sample_perplexity,
            baseline=_spike_baseline(decision, values),
            min_excess=cfg.sample_min_excess,
            relative_spread=cfg.sample_relative_spread,
        )
        if not samples:
            return [], []
        shown = ", ".join(f"{s.id} ({s.loss:.4g})" for s in samples[:10])
        event = Event(
            step=decision.step,
            kind=EventKind.SPIKE_SAMPLES,
            severity="warning",
            message=(
                f"{len(samples)} of {len(values)} samples carry the loss spike: {shown}; the "
                f"batch median is {sorted(values)[len(values) // 2]:.4g}"
            ),
            metrics={"samples": [s.to_dict() for s in samples], "batch_size": len(values)},
            action=decision.action,
        )
        return [s.id for s in samples], [event]

    def after_step(
        self, decision: Decision, replay: Callable[[], torch.Tensor] | None
    ) -> list[Event]:
        """Trace a non-finite step, or judge the ranks a per-rank check flagged, by replaying it
        (when `replay` is given and `diagnosis.trace_every` allows); the events found."""
        kinds = {e.kind for e in decision.events}
        outlier = self.ranks is not None and EventKind.RANK_OUTLIER in kinds
        events: list[Event] = []
        if replay is not None:
            if EventKind.NONFINITE in kinds or outlier:
                traced = self._trace(decision, replay)
                if traced is None:
                    if outlier:
                        events += self._no_verdict(
                            decision, "the last replay was under diagnosis.trace_every steps ago"
                        )
                else:
                    events += traced
            self.replay_rng = rng_state()  # the next step's forward starts from here
        elif outlier:
            events += self._no_verdict(decision, "no replay= closure was passed to guard.step")
        return events

    def _trace(self, decision: Decision, replay: Callable[[], torch.Tensor]) -> list[Event] | None:
        """Re-run the failing step from its starting state with every module and op watched;
        in a distributed run every rank replays its own batch, without gradient sync, and the
        flagged ranks get a verdict. None when `diagnosis.trace_every` held the replay back."""
        model = self.model
        if model is None:
            return None
        if decision.step - self.last_trace < self.config.diagnosis.trace_every:
            return None
        self.last_trace = decision.step
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        now = rng_state()
        if self.replay_rng is not None:
            set_rng_state(self.replay_rng)
        losses: list[float] = []

        def watched() -> torch.Tensor:
            loss = replay()
            losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else loss)
            return loss

        own_norm = math.nan
        self.optimizer.zero_grad(set_to_none=True)  # the replay's gradients alone, to measure
        try:
            with self._local_gradients(model):
                report = trace_nonfinite(model, watched)
            if self.local_norm is not None:  # DDP: this rank's own gradients, as the hook saw
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                if grads:
                    own_norm = float(torch.nn.utils.get_total_norm(grads))
        finally:
            set_rng_state(now)
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])
            self.optimizer.zero_grad(set_to_none=True)
        if self.ranks is None:
            return [_origin_event(decision, report, None)]
        mine = (
            losses[0] if losses else math.nan,
            own_norm,
            report.transient,
            report.describe(),
            origin_metrics(report),
            [vars(self.rank_judge.own_rule(m)) for m in METRICS],  # its own line (reduce)
        )
        everyone: list[Any] = [None] * self.ranks.world_size
        torch.distributed.all_gather_object(everyone, mine, group=self.ranks.group)
        events = [
            _origin_event(decision, report, rank, text, metrics)
            for rank, (loss, _, transient, text, metrics, _) in enumerate(everyone)
            if not transient or not math.isfinite(loss)
        ]
        rules = [[OwnRule(**rule) for rule in e[5]] for e in everyone]
        return events + self._judge_ranks(
            decision, [float(e[0]) for e in everyone], [float(e[1]) for e in everyone], rules
        )

    def _judge_ranks(
        self,
        decision: Decision,
        losses: list[float],
        grad_norms: list[float],
        rules: list[list[OwnRule]],
    ) -> list[Event]:
        """Each rank a per-rank check named: suspect when its replayed loss or own grad norm is
        out of line again by the run's learned rule (a lasting fault: silent data corruption,
        bad hardware or a bad data shard), transient when both are back in line."""
        replayed = {"loss": losses, "grad_norm": grad_norms}
        if all(math.isnan(v) for v in grad_norms):  # no DDP hook: only the loss can be judged
            del replayed["grad_norm"]
        again: dict[int, list[str]] = {}
        reduced = self.config.ranks.exchange == "reduce"
        for metric, values in replayed.items():
            if reduced:  # each rank's own line, against the others' geometric mean
                own = [rank_rules[METRICS.index(metric)] for rank_rules in rules]
                found = self.rank_judge.judge_replay(metric, values, own)
            else:
                found = [rank for rank, *_ in self.rank_judge.judge(metric, values)]
            for rank in found:
                again.setdefault(rank, []).append(metric)
        judged = " and ".join(m.replace("_", " ") for m in replayed)
        judged += " were" if len(replayed) > 1 else " was"
        events: list[Event] = []
        for rank in _flagged_ranks(decision):
            suspect = rank in again
            message = (
                f"rank {rank} is suspect: its {' and '.join(again[rank]).replace('_', ' ')} "
                "was out of line again when the step was replayed (a lasting fault: silent "
                "data corruption, a bad device, or a bad data shard); the step was "
                f"{_done(decision.action)} on every rank"
                if suspect
                else f"rank {rank} was transient: the replayed step's {judged} in line with "
                f"the other ranks; the step was {_done(decision.action)} on every rank"
            )
            events.append(
                Event(
                    step=decision.step,
                    kind=EventKind.RANK_OUTLIER,
                    severity="critical" if suspect else "info",
                    message=message,
                    metrics={
                        "ranks": [rank],
                        "suspect": suspect,
                        "replayed_losses": losses,
                        "replayed_grad_norms": grad_norms,
                    },
                    action=decision.action,
                    rank=rank,
                )
            )
        return events

    @staticmethod
    def _no_verdict(decision: Decision, why: str) -> list[Event]:
        """The ranks a per-rank check named, when the step could not be replayed: no verdict."""
        return [
            Event(
                step=decision.step,
                kind=EventKind.RANK_OUTLIER,
                severity="info",
                message=(
                    f"rank {rank}: no verdict (suspect or transient) could be reached, since "
                    f"{why}; the step was {_done(decision.action)} on every rank"
                ),
                metrics={"ranks": [rank], "suspect": None},
                action=decision.action,
                rank=rank,
            )
            for rank in _flagged_ranks(decision)
        ]

    @contextlib.contextmanager
    def _local_gradients(self, model: nn.Module) -> Iterator[None]:
        """A replay keeps its gradients on this rank: DDP's no_sync, FSDP2's gradient sync off."""
        if self.ranks is None:
            yield
        elif isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        elif callable(sync := getattr(model, "set_requires_gradient_sync", None)):
            sync(False)
            try:
                yield
            finally:
                sync(True)
        else:
            yield


def _flagged_ranks(decision: Decision) -> list[int]:
    return sorted(
        {r for e in decision.events if e.kind == EventKind.RANK_OUTLIER for r in e.metrics["ranks"]}
    )


def _origin_event(
    decision: Decision,
    report: NonFiniteReport,
    rank: int | None,
    text: str | None = None,
    metrics: dict[str, Any] | None = None,
) -> Event:
    message = text if text is not None else report.describe()
    metrics = metrics if metrics is not None else origin_metrics(report)
    return Event(
        step=decision.step,
        kind=EventKind.NAN_ORIGIN,
        severity="warning" if metrics["transient"] else "critical",
        message=message if rank is None else f"rank {rank}: {message}",
        metrics=metrics,
        action=decision.action,
        rank=rank,
    )


def _spike_baseline(decision: Decision, values: list[float]) -> float | None:
    """The loss level before the spike, in the per-sample losses' units (their mean over the
    step's loss rescales it, should they be sums or the step's loss hold other terms)."""
    spike = next((e for e in decision.events if e.kind == EventKind.LOSS_SPIKE), None)
    if spike is None:
        return None
    level, loss = spike.metrics.get("level"), spike.metrics.get("loss")
    finite = [v for v in values if math.isfinite(v)]
    if not finite or not isinstance(level, (int, float)) or not isinstance(loss, (int, float)):
        return None
    if not (math.isfinite(level) and math.isfinite(loss)):
        return None
    mean = sum(finite) / len(finite)
    return float(level) * (mean / loss) if loss > 0 and mean > 0 else float(level)


def origin_metrics(report: NonFiniteReport) -> dict[str, Any]:
    """A NaN trace's origin as the plain metrics of a `nan_origin` event."""
    origin = report.origin
    return {
        "transient": report.transient,
        "module": origin.module if origin else None,
        "module_type": origin.module_type if origin else None,
        "direction": origin.direction if origin else None,
        "op": origin.op if origin else None,
        "input_absmax": origin.input_absmax if origin else None,
        "dtype": origin.dtype if origin else None,
        "frames": origin.frames if origin else [],
        "inputs": [i.to_dict() for i in report.inputs],
    }


def _done(action: str) -> str:
    return {"step": "applied", "skip": "skipped", "rollback": "rolled back", "halt": "halted"}.get(
        action, action
    )
