"""`Guard`: one call per optimizer step that measures, detects, decides and acts."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainguard.actions import OptimizerActions
from trainguard.actions.checkpoint_files import DamagedCheckpoint, passed_over
from trainguard.actions.checkpoints import (
    CheckpointStore,
    check_rng,
    load_sharded,
    prepare_restore,
    sharded_training_state,
    training_state,
)
from trainguard.actions.data import GuardedBatches, default_batch_ids, sized_skip
from trainguard.actions.quarantine import Quarantine
from trainguard.actions.snapshots import SnapshotRing, budget_interval, rng_state, set_rng_state
from trainguard.config import GuardConfig
from trainguard.detectors import DetectorSuite, MetricPoint
from trainguard.detectors.loss_spike import LossSpikeDetector
from trainguard.detectors.ranks import RankOutlierDetector
from trainguard.diagnosis import NonFiniteReport, blame_samples, trace_nonfinite
from trainguard.diagnosis.lint import Finding, lint
from trainguard.distributed import (
    LocalGradNorm,
    RankContext,
    StepExchange,
    local_grad_norm_hook,
)
from trainguard.events import (
    Decision,
    Event,
    TrainguardError,
    TrainingHalted,
    _json_number,
    _utc_now,
)
from trainguard.line_file import write_small_file
from trainguard.moe.routing import RoutingStats
from trainguard.policy import StepPolicy
from trainguard.run_lock import RunLock
from trainguard.signals import GradientStats, StepSignals
from trainguard.signals.gradients import Measurement
from trainguard.sinks import ConsoleSink, EventLog, MetricsLog, Sink
from trainguard.sinks.factory import sinks_from_config

MAX_BATCH_IDS = 64
POSITIONS_KEPT = 8192  # steps whose data position is remembered, to map incidents to batches
UNREWOUND_CONFIRM_STEPS = 2  # far-up steps that confirm an explosion where data goes on
STEP_TIMES_KEPT = 32  # recent step times whose median sizes the snapshot interval


class Guard:
    """Watches every step of a training loop and steps, skips or halts it.

    `step(loss)` replaces `clip_grad_norm_` + `optimizer.step()` + `scheduler.step()`;
    `observe(step, loss=...)` only watches numbers, for logging-only use and offline analysis.
    `lint_scheduler`, a schedule a framework steps (not the guard), is what the lint traces.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        config: GuardConfig | None = None,
        run_dir: str | Path | None = None,
        sinks: Sequence[Sink] = (),
        lint_scheduler: Any = None,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TrainguardError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TrainguardError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.config = config if config is not None else GuardConfig()
        self.model = model
        self.optimizer = optimizer
        self.detectors = DetectorSuite(self.config)
        # the recovery sizes for this run's length (diagnosis.total_steps; len() of the data)
        self.recovery = self.config.recovery.sized(self.config.diagnosis.total_steps)
        self.policy = StepPolicy(self.config.policy, self.recovery)
        self.stats: GradientStats | None = None
        self.actions: OptimizerActions | None = None
        if optimizer is not None:
            self.stats = GradientStats(
                model,
                optimizer,
                self.config.group_patterns,
                self.config.stats_every,
                weight_norms=self.config.weight_jump.enabled,
            )
            self.actions = OptimizerActions(
                optimizer,
                scheduler,
                scaler,
                self.config.max_grad_norm,
            )
        self.scheduler = scheduler
        self.scaler = scaler
        self.ring = SnapshotRing(self.config.recovery.snapshots)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        device = self.stats.device if self.stats is not None else torch.device("cpu")
        self.ranks = RankContext.detect(device)
        self.exchange = StepExchange(self.ranks) if self.ranks is not None else None
        self._local_norm: LocalGradNorm | None = None
        if self.ranks is not None and isinstance(model, DistributedDataParallel):
            self._local_norm = LocalGradNorm(self.ranks.group)
            model.register_comm_hook(self._local_norm, local_grad_norm_hook)
        leader = self.ranks is None or self.ranks.is_leader
        quarantine_name = (
            "quarantine.jsonl" if self.ranks is None else f"quarantine-rank{self.ranks.rank}.jsonl"
        )
        self.quarantine = Quarantine(
            self.run_dir / quarantine_name if self.run_dir is not None else None, _report
        )
        self._batches: GuardedBatches | None = None
        self._size_confirmation()
        self._resume_data: dict[str, Any] | None = None
        self._positions: dict[int, int] = {}
        self._last_incident = -(10**9)
        self._last_good_checkpoint: int | None = None
        self._continues_a_run = False  # resumed, or given a state: the checkpoints are its own
        self._replay_rng: dict[str, Any] | None = rng_state()  # where the first forward starts
        self._last_trace = -(10**9)
        rec = self.config.recovery
        self.checkpoints: CheckpointStore | None = None
        if self.run_dir is not None and model is not None and optimizer is not None:
            self.checkpoints = CheckpointStore(
                self.run_dir / "checkpoints",
                rec.keep_checkpoints,
                rec.async_checkpoints,
                self.ranks,
            )
        self.sinks: list[Sink] = []
        self.run_lock: RunLock | None = None
        try:
            if self.run_dir is not None and leader:  # one writer in a distributed run: rank 0
                self.run_lock = RunLock.take(self.run_dir, _report)
                self.sinks += [
                    EventLog(self.run_dir / "events.jsonl", _report),
                    MetricsLog(self.run_dir / "metrics.jsonl", _report),
                ]
                write_small_file(
                    self.run_dir / "config.json", self.config.to_json() + "\n", _report
                )
            if self.config.console and leader:
                self.sinks.append(
                    ConsoleSink(
                        status=self.config.console_status,
                        total_steps=self.config.diagnosis.total_steps,
                    )
                )
            if leader:
                self.sinks.extend(sinks_from_config(self.config.alerts, _report))
                self.sinks.extend(sinks)
        except BaseException:  # a sink that cannot start: free what was taken, for a retry
            self._release_outputs()
            raise
        self.global_step = 0
        self.event_counts: dict[str, int] = {}
        self.action_counts: dict[str, int] = {"step": 0, "skip": 0, "rollback": 0, "halt": 0}
        self._started = time.perf_counter()
        self._last_step_time: float | None = None
        self._step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self._snapshot_seconds: float | None = None  # what the last snapshot took
        self._closed = False
        self.findings: list[Finding] = []
        if self.config.diagnosis.lint and model is not None and optimizer is not None:
            self._lint(lint_scheduler if lint_scheduler is not None else scheduler)

    # -- the training loop ------------------------------------------------------------------
    def step(
        self,
        loss: torch.Tensor | float,
        batch_ids: Iterable[Any] | None = None,
        sample_ids: Iterable[Any] | None = None,
        replay: Callable[[], torch.Tensor] | None = None,
        per_sample_losses: torch.Tensor | Callable[[], torch.Tensor] | None = None,
        sample_text: Sequence[str] | None = None,
        routing: RoutingStats | None = None,
    ) -> Decision:
        """Measure this step's gradients after `loss.backward()`, run the detectors, and step,
        skip or halt (raising `TrainingHalted`); with a GradScaler pass the unscaled loss.

        `replay`, a closure that recomputes this step's loss, lets the guard trace where NaN/Inf
        first appeared; `per_sample_losses` (one per sample, left on the device and read only
        on a spike; or a closure computing them, called only on a spike) and `sample_text` let
        it name the samples behind a loss spike; `routing` (`trainguard.moe.routing_stats`)
        feeds the routing-collapse detector."""
        if self.stats is None or self.actions is None or self.optimizer is None:
            raise TrainguardError(
                "guard.step needs an optimizer: build Guard(model, optimizer, ...), "
                "or use guard.observe(step, loss=...) to only watch numbers"
            )
        step = self.global_step
        if self._batches is not None and self._batches.current is not None:
            self._remember_position(step, self._batches.current)
        self.actions.unscale()
        measurement = self.stats.measure(loss, self.optimizer, self.scaler)
        if self.exchange is not None:
            self._exchange(measurement)
        self.actions.clip(measurement.grads, measurement.total_norm)
        signals = self.stats.resolve(measurement)
        point = _point_from_signals(step, signals)
        if routing is not None:
            point.routing = routing.to_point()
        if self.exchange is not None:
            _add_rank_figures(point, signals.extra, self.exchange.context.world_size)
        decision = self._decide(point, batch_ids, can_roll_back=self._has_target)
        if per_sample_losses is not None and any(e.kind == "loss_spike" for e in decision.events):
            blamed = self._blame(decision, per_sample_losses, sample_ids or batch_ids, sample_text)
            if blamed:
                sample_ids = blamed
        self._quarantine(decision, signals.loss, batch_ids, sample_ids)
        self.global_step += 1
        if decision.action == "step":
            self.stats.before_optimizer_step(step)
            self.actions.step(signals.loss)
            self.stats.after_optimizer_step(step)
            if decision.lr_factor is not None:
                self._cut_lr(decision)
            self._maybe_snapshot()
            self._maybe_checkpoint()
        elif decision.action == "rollback":
            self.stats.discard_update()
            self.actions.skip()
            self._roll_back(decision)
        else:
            self.stats.discard_update()
            self.actions.skip()
            if decision.lr_factor is not None and decision.action == "skip":
                self._cut_lr(decision)
        if self.checkpoints is not None and self.checkpoints.errors:  # a background write failed
            for error in self._checkpoint_errors():
                self._warn(error)
        outlier = self.ranks is not None and any(e.kind == "rank_outlier" for e in decision.events)
        if replay is not None:
            kinds = {e.kind for e in decision.events}
            if ("nonfinite" in kinds or outlier) and not self._trace(decision, replay) and outlier:
                self._no_verdict(
                    decision, "the last replay was under diagnosis.trace_every steps ago"
                )
            self._replay_rng = rng_state()  # the next step's forward starts from here
        elif outlier:
            self._no_verdict(decision, "no replay= closure was passed to guard.step")
        self._record(point, decision, signals)
        if decision.action == "halt":
            self._halt(decision, raise_error=True)
        return decision

    def batches(
        self,
        source: Iterable[Any],
        ids: Callable[[Any], list[Any] | None] = default_batch_ids,
    ) -> GuardedBatches:
        """Wrap the data so a rollback rewinds it and skips the batches that fed the incident,
        and quarantined batches never come back; `ids(batch)` names a batch's samples. A source
        with a `len()` sizes the recovery when `diagnosis.total_steps` is not set."""
        self._batches = GuardedBatches(source, ids, self.quarantine.contains, self._data_ended)
        length = self._batches.length
        if self.config.diagnosis.total_steps is None and length is not None and length > 0:
            self.recovery = self.config.recovery.sized(length)  # at least one pass of the data
            self.policy.recovery = self.recovery
        self._size_confirmation()
        if self._resume_data is not None:
            self._batches.resume(self._resume_data)
            self._resume_data = None
        return self._batches

    def _size_confirmation(self) -> None:
        """`loss_spike.confirm_steps` left to the run: an explosion confirmed after 2 steps
        where a rollback cannot rewind the data (each step waited is lost), after the whole
        window where it replays the data (a fault of a few steps ends first)."""
        if self.config.loss_spike.confirm_steps is not None:
            return
        for detector in self.detectors.detectors:
            if isinstance(detector, LossSpikeDetector):
                detector.confirm_steps = 0 if self.rewinds_data else UNREWOUND_CONFIRM_STEPS

    # -- diagnosis ----------------------------------------------------------------------------
    def _lint(self, scheduler: Any) -> None:
        """Check the set-up once, before the first step, with `scheduler`'s LR schedule; each
        finding is an info event."""
        assert self.model is not None
        cfg = self.config.diagnosis
        dtype = getattr(torch, cfg.autocast_dtype) if cfg.autocast_dtype else None
        self.findings = lint(
            self.model,
            self.optimizer,
            scheduler,
            self.scaler,
            self.config.max_grad_norm,
            cfg.total_steps,
            dtype,
        )
        for finding in self.findings:
            self._emit(
                Event(
                    step=0,
                    kind="lint",
                    severity="info",
                    message=f"{finding.message}; fix: {finding.fix}",
                    metrics=finding.to_dict(),
                )
            )

    def _blame(
        self,
        decision: Decision,
        per_sample_losses: torch.Tensor | Callable[[], torch.Tensor],
        ids: Iterable[Any] | None,
        text: Sequence[str] | None,
    ) -> list[Any]:
        """Name the samples that carry a loss spike; their ids, for the quarantine."""
        cfg = self.config.diagnosis
        if callable(per_sample_losses) and not isinstance(per_sample_losses, torch.Tensor):
            with torch.no_grad():
                per_sample_losses = per_sample_losses()
        values: list[float] = per_sample_losses.detach().float().reshape(-1).tolist()
        id_list = [_plain(i) for i in ids] if ids is not None else None
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
            return []
        shown = ", ".join(f"{s.id} ({s.loss:.4g})" for s in samples[:10])
        event = Event(
            step=decision.step,
            kind="spike_samples",
            severity="warning",
            message=(
                f"{len(samples)} of {len(values)} samples carry the loss spike: {shown}; the "
                f"batch median is {sorted(values)[len(values) // 2]:.4g}"
            ),
            metrics={"samples": [s.to_dict() for s in samples], "batch_size": len(values)},
            action=decision.action,
        )
        decision.events.append(event)
        self._emit(event)
        return [s.id for s in samples]

    def _trace(self, decision: Decision, replay: Callable[[], torch.Tensor]) -> bool:
        """Re-run the failing step from its starting state with every module and op watched;
        in a distributed run every rank replays its own batch, without gradient sync, and
        the ranks the per-rank checks named are marked suspect (out of line again, in loss or
        own grad norm) or transient. False when `diagnosis.trace_every` held the replay back."""
        assert self.model is not None and self.optimizer is not None
        if decision.step - self._last_trace < self.config.diagnosis.trace_every:
            return False
        self._last_trace = decision.step
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        now = rng_state()
        if self._replay_rng is not None:
            set_rng_state(self._replay_rng)
        losses: list[float] = []

        def watched() -> torch.Tensor:
            loss = replay()
            losses.append(float(loss.detach()) if isinstance(loss, torch.Tensor) else loss)
            return loss

        own_norm = math.nan
        self.optimizer.zero_grad(set_to_none=True)  # the replay's gradients alone, to measure
        try:
            with self._local_gradients():
                report = trace_nonfinite(self.model, watched)
            if self._local_norm is not None:  # DDP: this rank's own gradients, as the hook saw
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                if grads:
                    own_norm = float(torch.nn.utils.get_total_norm(grads))
        finally:
            set_rng_state(now)
            with torch.no_grad():
                for name, b in self.model.named_buffers():
                    b.copy_(buffers[name])
            self.optimizer.zero_grad(set_to_none=True)
        if self.ranks is None:
            self._emit_origin(decision, report, None)
            return True
        mine = (
            losses[0] if losses else math.nan,
            own_norm,
            report.transient,
            report.describe(),
            _origin_metrics(report),
        )
        everyone: list[Any] = [None] * self.ranks.world_size
        torch.distributed.all_gather_object(everyone, mine, group=self.ranks.group)
        for rank, (loss, _, transient, text, metrics) in enumerate(everyone):
            if not transient or not math.isfinite(loss):
                self._emit_origin(decision, report, rank, text, metrics)
        self._judge_ranks(
            decision, [float(e[0]) for e in everyone], [float(e[1]) for e in everyone]
        )
        return True

    def _emit_origin(
        self,
        decision: Decision,
        report: NonFiniteReport,
        rank: int | None,
        text: str | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        message = text if text is not None else report.describe()
        metrics = metrics if metrics is not None else _origin_metrics(report)
        event = Event(
            step=decision.step,
            kind="nan_origin",
            severity="warning" if metrics["transient"] else "critical",
            message=message if rank is None else f"rank {rank}: {message}",
            metrics=metrics,
            action=decision.action,
            rank=rank,
        )
        decision.events.append(event)
        self._emit(event)

    def _judge_ranks(
        self, decision: Decision, losses: list[float], grad_norms: list[float]
    ) -> None:
        """Each rank a per-rank check named: suspect when its replayed loss or own grad norm is
        out of line again by the run's learned rule (a lasting fault: silent data corruption,
        bad hardware or a bad data shard), transient when both are back in line."""
        live = [d for d in self.detectors.detectors if isinstance(d, RankOutlierDetector)]
        judge = live[0] if live else RankOutlierDetector(self.config.ranks)
        replayed = {"loss": losses, "grad_norm": grad_norms}
        if all(math.isnan(v) for v in grad_norms):  # no DDP hook: only the loss can be judged
            del replayed["grad_norm"]
        again: dict[int, list[str]] = {}
        for metric, values in replayed.items():
            for rank, *_ in judge.judge(metric, values):
                again.setdefault(rank, []).append(metric)
        flagged = sorted(
            {r for e in decision.events if e.kind == "rank_outlier" for r in e.metrics["ranks"]}
        )
        judged = " and ".join(m.replace("_", " ") for m in replayed)
        judged += " were" if len(replayed) > 1 else " was"
        for rank in flagged:
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
            event = Event(
                step=decision.step,
                kind="rank_outlier",
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
            decision.events.append(event)
            self._emit(event)

    def _no_verdict(self, decision: Decision, why: str) -> None:
        """The ranks a per-rank check named, when the step could not be replayed: no verdict."""
        flagged = sorted(
            {r for e in decision.events if e.kind == "rank_outlier" for r in e.metrics["ranks"]}
        )
        for rank in flagged:
            event = Event(
                step=decision.step,
                kind="rank_outlier",
                severity="info",
                message=(
                    f"rank {rank}: no verdict (suspect or transient) could be reached, since "
                    f"{why}; the step was {_done(decision.action)} on every rank"
                ),
                metrics={"ranks": [rank], "suspect": None},
                action=decision.action,
                rank=rank,
            )
            decision.events.append(event)
            self._emit(event)

    @contextlib.contextmanager
    def _local_gradients(self) -> Iterator[None]:
        """A replay keeps its gradients on this rank: DDP's no_sync, FSDP2's gradient sync off."""
        model = self.model
        if self.ranks is None or model is None:
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

    # -- recovery -----------------------------------------------------------------------------
    def _remember_position(self, step: int, position: int) -> None:
        self._positions.pop(step, None)  # a replayed step moves to the newest end
        self._positions[step] = position
        if len(self._positions) > POSITIONS_KEPT:
            del self._positions[next(iter(self._positions))]

    def _maybe_snapshot(self) -> None:
        """After a step: keep a snapshot every `snapshot_interval` steps, on schedule whatever
        was raised before; whether it serves an incident is judged when one comes
        (`_has_target`)."""
        rec = self.recovery
        step = self.global_step  # the next step: the snapshot is the state at its start
        if not rec.enabled or self.model is None:
            return
        every = self.snapshot_interval
        newest = self.ring.snapshots[-1].step if self.ring.snapshots else None
        due = step % every == 0 if newest is None else step - newest >= every
        if not due:
            return
        assert self.optimizer is not None and self.actions is not None
        started = time.perf_counter()
        guard_state = {
            "detectors": self.detectors.state_dict(),
            "schedule_lrs": copy.deepcopy(self.actions.schedule_lrs()),  # tensor LRs too
        }
        position = self._batches.state() if self._batches is not None else None
        last_warning = None if self._healthy_window(step) else self._last_incident
        self.ring.take(
            step,
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            guard_state,
            position,
            last_warning,
        )
        self._snapshot_seconds = time.perf_counter() - started

    @property
    def rewinds_data(self) -> bool:
        """Whether a rollback rewinds the data (it comes through `guard.batches`); else the
        steps since the rollback target are lost learning."""
        return self._batches is not None

    @property
    def snapshot_interval(self) -> int:
        """Steps between snapshots: `recovery.snapshot_every`, sized to the run; where the data
        cannot be rewound and the interval is left to the run, as short as
        `recovery.snapshot_budget` allows (the last snapshot's cost against the median step
        time), but long enough that the ring still holds one from before a spike's follow-up
        (`classify_window` plus `sudden_margin` steps back)."""
        rec = self.recovery
        every = rec.snapshot_every or 1
        if self.config.recovery.snapshot_every is not None or self.rewinds_data:
            return every
        if self._snapshot_seconds is None or not self._step_times or rec.snapshots < 2:
            return every
        reach = self.config.loss_spike.classify_window + rec.sudden_margin
        shortest = min(every, math.ceil(reach / (rec.snapshots - 1)))
        step_seconds = statistics.median(self._step_times)
        return budget_interval(
            self._snapshot_seconds, step_seconds, rec.snapshot_budget, shortest, every
        )

    def _healthy_window(self, step: int) -> bool:
        """No warning or worse, and no skip or rollback, in the `snapshot_every` steps before."""
        return step - self._last_incident > (self.recovery.snapshot_every or 1)

    def _has_target(self, incident: int) -> bool:
        """Whether a snapshot lies at or before the first step of an incident (for the policy)."""
        rec = self.recovery
        return rec.enabled and self.ring.target_for(incident, rec.rollback_margin) is not None

    def _roll_back(self, decision: Decision) -> None:
        """Restore the snapshot the ring holds for the incident (never one inside it), and skip
        the incident batch and a share of the data sized to what is left (nothing where the
        policy replays the incident)."""
        assert self.model is not None and self.optimizer is not None and self.actions is not None
        assert decision.rollback_to is not None
        incident = decision.incident_step
        start = incident if incident is not None else decision.rollback_to
        snapshot = self.ring.target_for(start, start - decision.rollback_to)
        assert snapshot is not None  # the policy rolls back only when a target exists
        from_step = decision.step
        self._protect_last_good()
        SnapshotRing.restore(snapshot, self.model, self.optimizer, self.scheduler, self.scaler)
        # copies: the detectors go on mutating what they load, and a later rollback may return
        # to this same snapshot
        self.detectors.load_state_dict(copy.deepcopy(snapshot.guard["detectors"]))
        self.actions.restore_schedule_lrs(copy.deepcopy(snapshot.guard["schedule_lrs"]))
        factor = decision.lr_factor or 1.0
        if decision.lr_factor is not None:
            self.actions.cut_lr(factor, decision.rewarm_steps)
        self.ring.drop_after(snapshot.step)
        self.policy.forget_after(snapshot.step)
        self.quarantine.forget_after(snapshot.step)
        self.global_step = snapshot.step
        self._last_incident = snapshot.step
        skipped: tuple[int, int] | None = None
        skip_event: Event | None = None
        if self._batches is not None and snapshot.data_position is not None:
            position = self._positions.get(incident) if incident is not None else None
            if position is not None and not decision.replay_incident:
                skipped, skip_event = self._skip_after(decision, position)
            self._batches.rewind(snapshot.data_position, skipped)
        lost = None if self.rewinds_data else from_step + 1 - snapshot.step
        if skipped:
            note = f"; skipping batches {skipped[0]}..{skipped[1] - 1}"
        elif decision.replay_incident and self.rewinds_data:
            note = (
                "; no batch skipped: the incident's batches are fed again on the restored "
                "weights (a toxic one spikes again and is skipped then)"
            )
        else:
            note = "; no data to skip (iterate with guard.batches(loader) to skip it)"

        if lost is not None:
            note += f"; the data goes on, so the {lost} batches since the state are lost"
        if snapshot.step > decision.rollback_to:
            note += (
                f"; no snapshot {start - decision.rollback_to} steps before the incident was "
                f"kept, so the newest at or before its first step ({start}) was used"
            )
        if snapshot.last_warning is not None:
            note += f" (taken after a warning at step {snapshot.last_warning}, judged since)"
        event = Event(
            step=from_step,
            kind="rollback",
            severity="warning",
            message=(
                f"rolled back from step {from_step} to the state at step {snapshot.step}, "
                f"before the incident ({decision.reason}); "
                + (
                    f"LR kept at x{self.actions.lr_scale:.3g} of the schedule (a sudden "
                    "incident undone; a repeat cuts it)"
                    if decision.lr_factor is None
                    else f"LR x{factor:.3g}, now x{self.actions.lr_scale:.3g} of the schedule, "
                    + (
                        f"climbing back over {decision.rewarm_steps} steps"
                        if decision.rewarm_steps
                        else "kept (a repeated incident, or re-warm off)"
                    )
                )
                + note
            ),
            metrics={
                "from_step": from_step,
                "to_step": snapshot.step,
                "incident_step": decision.incident_step,
                "lr_factor": factor,
                "lr_scale": self.actions.lr_scale,
                "rewarm_steps": decision.rewarm_steps,
                "skipped_batches": list(skipped) if skipped else None,
                "snapshot_after_warning": snapshot.last_warning,
                "lost_batches": lost,
            },
            action="rollback",
        )
        decision.events.append(event)
        self._emit(event)
        if skip_event is not None:
            decision.events.append(skip_event)
            self._emit(skip_event)

    def _skip_after(self, decision: Decision, position: int) -> tuple[tuple[int, int], Event]:
        """The positions a rollback skips, the incident batch and a share of what is left (never
        past the end), and the `data_skipped` event that says so."""
        assert self._batches is not None
        rec = self.recovery
        left = self._batches.left_after(position)
        basis = "batches left in the data"
        total = self.config.diagnosis.total_steps
        if left is None and total is not None:
            left, basis = max(0, total - decision.step - 1), "planned steps left"
        elif left is None:
            left, basis = max(1, decision.step), "steps made so far (the data has no length)"
        share = min(1.0, rec.skip_share * decision.skip_widening)  # a repeat earns a wider skip
        more = sized_skip(decision.skip_after, left, share)
        skipped = (position, position + 1 + more)
        capped = more < decision.skip_after
        message = (
            f"skipping {more + 1} batches ({position}..{position + more}): the one that fed the "
            f"incident at step {decision.incident_step} and {more} after it"
        )
        if capped:
            message += f", not {decision.skip_after}: at most {share:.0%} of the {left} {basis}"
        event = Event(
            step=decision.step,
            kind="data_skipped",
            severity="info",
            message=message,
            metrics={
                "first": position,
                "last": position + more,
                "count": more + 1,
                "wanted": decision.skip_after + 1,
                "left": left,
                "basis": basis,
                "share": share,
            },
            action="rollback",
        )
        return skipped, event

    def _data_ended(self, batches: GuardedBatches) -> None:
        """The data source ran out: one event with what the guard passed over in this pass,
        the pass's length (`len()` of the data, where it has one) and, against
        `diagnosis.total_steps`, whether the run fell short of its plan."""
        total = self.config.diagnosis.total_steps
        short = total is not None and self.global_step < total
        passed = batches.skipped + batches.held_out
        message = (
            f"the data ran out at step {self.global_step} after {batches.position} batches; "
            f"the guard passed over {batches.skipped} skipped by rollbacks and "
            f"{batches.held_out} quarantined"
        )
        if short:
            message += f"; the run planned {total} steps"
        elif total is None and batches.length:  # one pass of several, maybe: no plan to judge
            message += f"; a pass of the data is {batches.length} batches"
        self._emit(
            Event(
                step=self.global_step,
                kind="data_exhausted",
                severity="warning" if short and passed else "info",
                message=message,
                metrics={
                    "batches": batches.position,
                    "skipped": batches.skipped,
                    "quarantined": batches.held_out,
                    "planned_steps": total,
                    "data_length": batches.length,
                },
            )
        )

    def _cut_lr(self, decision: Decision) -> None:
        assert self.actions is not None and decision.lr_factor is not None
        self.actions.cut_lr(decision.lr_factor, decision.rewarm_steps)
        if decision.unrolled_incident is not None:
            unavailable = Event(
                step=decision.step,
                kind="rollback_unavailable",
                severity="warning",
                message=(
                    f"no snapshot at or before step {decision.unrolled_incident}, where the "
                    f"incident began, to roll back to ({decision.reason or 'see the events'}); "
                    f"the LR is cut x{decision.lr_factor:.3g} instead"
                ),
                metrics={"incident_step": decision.unrolled_incident},
                action=decision.action,
            )
            decision.events.append(unavailable)
            self._emit(unavailable)
        event = Event(
            step=decision.step,
            kind="lr_reduced",
            severity="warning",
            message=(
                f"LR x{decision.lr_factor:.3g} ({decision.reason or 'no rollback target'}); now "
                f"x{self.actions.lr_scale:.3g} of the schedule"
            ),
            metrics={"lr_factor": decision.lr_factor, "lr_scale": self.actions.lr_scale},
            action=decision.action,
        )
        decision.events.append(event)
        self._emit(event)

    def _quarantine(
        self,
        decision: Decision,
        loss: float,
        batch_ids: Iterable[Any] | None,
        sample_ids: Iterable[Any] | None,
    ) -> None:
        """Hold this step's batch as a suspect, quarantine a suspect its spike's follow-up
        confirmed, or release one whose spike was re-typed; each for good is an event."""
        if decision.suspect:
            ids = list(batch_ids) if batch_ids is not None else None
            if ids is None and self._batches is not None:
                ids = self._batches.current_ids
            self.quarantine.suspect(
                decision.step,
                decision.reason,
                loss,
                [_plain(i) for i in ids] if ids else None,
                [_plain(i) for i in sample_ids] if sample_ids is not None else None,
            )
        if decision.quarantine_step is not None:
            spike = decision.quarantine_step
            record = self.quarantine.confirm(
                spike, decision.step, "its follow-up confirmed data toxicity"
            )
            if record is not None:
                self._quarantine_event(decision, spike, record, released=False)
        if decision.release_step is not None:
            spike = decision.release_step
            record = self.quarantine.release(
                spike, decision.step, "its spike was re-typed: not data toxicity"
            )
            if record is not None:
                self._quarantine_event(decision, spike, record, released=True)

    def _quarantine_event(
        self, decision: Decision, spike: int, record: dict[str, Any], released: bool
    ) -> None:
        ids = record.get("sample_ids") or record.get("batch_ids") or []
        what = "samples" if record.get("sample_ids") else "batch"
        message = (
            f"released the {what} of step {spike} from the quarantine: its spike was re-typed"
            if released
            else f"quarantined the {what} of step {spike} for good: its spike's follow-up "
            "confirmed data toxicity"
        )
        event = Event(
            step=decision.step,
            kind="quarantine",
            severity="info",
            message=message,
            metrics={"spike_step": spike, "released": released, "ids": ids[:MAX_BATCH_IDS]},
            action=decision.action,
        )
        decision.events.append(event)
        self._emit(event)

    def observe(
        self,
        step: int,
        loss: float,
        grad_norm: float | None = None,
        lr: float | None = None,
        loss_scale: float | None = None,
        group_grad_norms: dict[str, float] | None = None,
        batch_ids: Iterable[Any] | None = None,
    ) -> Decision:
        """Feed the detectors from plain numbers without touching a model.

        The decision is advisory: nothing is stepped or skipped, and a halt is logged and
        returned, not raised.
        """
        point = MetricPoint(
            step=int(step),
            loss=float(loss),
            grad_norm=None if grad_norm is None else float(grad_norm),
            lr=None if lr is None else float(lr),
            loss_scale=None if loss_scale is None else float(loss_scale),
            group_grad_norms=group_grad_norms,
        )
        decision = self._decide(point, batch_ids)
        self._record(point, decision, None)
        self.global_step = point.step + 1
        if decision.action == "halt":
            self._halt(decision, raise_error=False)
        return decision

    # -- distributed ----------------------------------------------------------------------------
    def _exchange(self, m: Measurement) -> None:
        """The step's one collective: every rank's loss, non-finite count, shard norms, own
        gradient norm before the reduction, and timings; the figures become global."""
        assert self.exchange is not None and self.stats is not None
        now = time.perf_counter()
        hook = self._local_norm
        nan = torch.full((), math.nan, device=self.stats.device)
        own_sq = hook.sq if hook is not None and hook.sq is not None else nan
        batches = self._batches
        ready = batches.ready_at if batches is not None else None
        wait = batches.data_wait if batches is not None else 0.0
        start = ready if ready is not None else self._last_step_time
        end = hook.first_ready if hook is not None and hook.first_ready is not None else now
        compute = end - start if start is not None else math.nan
        timing = torch.tensor([wait + compute, wait], device=self.stats.device)
        vector = torch.cat([m.rank_vector(), own_sq.reshape(1), timing])
        gathered = self.exchange.gather(vector)
        m.combine(gathered[:, : vector.numel() - 3])
        m.extra = gathered[:, [0, vector.numel() - 3, vector.numel() - 2, vector.numel() - 1]]
        if hook is not None:
            hook.reset()

    def _name_ranks(self, events: list[Event]) -> None:
        """Each event names the culprit rank a per-rank check found (`_emit` names this rank
        otherwise); per-rank events also name its host."""
        if self.ranks is None:
            return
        culprit = next((e.rank for e in events if e.kind == "rank_outlier"), None)
        for event in events:
            if event.rank is None:
                event.rank = culprit
            if event.kind in ("straggler", "rank_outlier") and event.rank is not None:
                event.metrics["host"] = self.ranks.hosts[event.rank]

    # -- internals ----------------------------------------------------------------------------
    def _decide(
        self,
        point: MetricPoint,
        batch_ids: Iterable[Any] | None,
        can_roll_back: bool | Callable[[int], bool] = False,
    ) -> Decision:
        events = self.detectors.update(point)
        self._name_ranks(events)
        decision = self.policy.decide(point, events, can_roll_back)
        if decision.action != "step" or any(e.severity != "info" for e in events):
            self._last_incident = point.step
        if batch_ids is not None:
            ids = list(batch_ids)
            shown: list[Any] = [_plain(i) for i in ids[:MAX_BATCH_IDS]]
            for event in events:
                event.metrics["batch_ids"] = shown
                if len(ids) > MAX_BATCH_IDS:
                    event.metrics["batch_ids_total"] = len(ids)
        for event in events:
            if self.stats is not None and event.kind in ("grad_spike", "grad_explosion"):
                event.metrics["group_report"] = self.stats.group_report()
            self._emit(event)
        self.action_counts[decision.action] += 1
        return decision

    def _emit(self, event: Event) -> None:
        if self.ranks is not None and event.rank is None:
            event.rank = self.ranks.rank
        self.event_counts[event.kind] = self.event_counts.get(event.kind, 0) + 1
        for sink in self.sinks:
            sink.on_event(event)

    def _record(self, point: MetricPoint, decision: Decision, signals: StepSignals | None) -> None:
        now = time.perf_counter()
        record: dict[str, Any] = {
            "step": point.step,
            "elapsed_s": round(now - self._started, 6),
            "step_time_s": (
                None if self._last_step_time is None else round(now - self._last_step_time, 6)
            ),
            "loss": point.loss,
            "grad_norm": point.grad_norm,
            "lr": point.lr,
            "loss_scale": point.loss_scale,
            "action": decision.action,
        }
        if self._last_step_time is not None:
            self._step_times.append(now - self._last_step_time)
        self._last_step_time = now
        if signals is not None:
            if len(signals.lrs) > 1:
                record["lrs"] = signals.lrs
            record["overflow"] = signals.overflow
            record["nonfinite_grads"] = signals.nonfinite_grads
            record["group_grad_norms"] = signals.group_grad_norms
            if signals.group_param_norms is not None:
                record["group_param_norms"] = signals.group_param_norms
            if signals.update_step is not None:
                record["param_norm"] = signals.param_norm
                record["update_norm"] = signals.update_norm
                record["update_ratio"] = signals.update_ratio
                record["update_step"] = signals.update_step
                record["group_update_ratios"] = signals.group_update_ratios
        elif point.group_grad_norms:
            record["group_grad_norms"] = point.group_grad_norms
        if point.routing is not None:
            record["routing"] = point.routing
        if point.rank_losses is not None:
            record["ranks"] = {
                "loss": point.rank_losses,
                "grad_norm": point.rank_grad_norms,
                "step_time_s": point.rank_step_times,
                "data_wait_s": point.rank_data_waits,
            }
        if decision.events:
            record["events"] = [e.kind for e in decision.events]
        record = _json_number(record)
        decision.metrics = record
        if point.step % self.config.log_every == 0 or decision.events:
            for sink in self.sinks:
                sink.on_metrics(record)

    def _protect_last_good(self) -> None:
        """Keep the newest known-good checkpoint before an incident, whatever the retention."""
        if self.checkpoints is not None and self._last_good_checkpoint is not None:
            self.checkpoints.protected.add(self._last_good_checkpoint)

    # -- durable checkpoints ----------------------------------------------------------------------
    def _maybe_checkpoint(self) -> None:
        every = self.config.recovery.checkpoint_every
        if self.checkpoints is None or not every or self.global_step % every:
            return
        self.save_checkpoint()

    def save_checkpoint(self) -> None:
        """Write a durable checkpoint of the state at the start of the next step (asynchronous
        by default: this blocks only while the tensors are staged)."""
        assert self.model is not None and self.optimizer is not None and self.actions is not None
        if self.checkpoints is None:
            raise TrainguardError("checkpoints need a run_dir: build the Guard with run_dir=...")
        if not self._continues_a_run:
            self._continues_a_run = True
            self._set_aside_earlier_checkpoints()
        step = self.global_step
        known_good = self._healthy_window(step)
        if known_good:
            self._last_good_checkpoint = step
        if self.ranks is None:
            tensors, plain = training_state(self.model, self.optimizer, self.scheduler, self.scaler)
        else:
            tensors, plain = sharded_training_state(
                self.model, self.optimizer, self.scheduler, self.scaler, self.ranks.rank
            )
        plain.update(
            {
                "guard": self.state_dict(),
                "data": self._batches.state() if self._batches is not None else None,
                "protected": sorted(self.checkpoints.protected),
                "last_good_checkpoint": self._last_good_checkpoint,
            }
        )
        manifest = {
            "trainguard_version": _version(),
            "known_good": known_good,
            "incidents": {
                "rollbacks": self.action_counts["rollback"],
                "skips": self.action_counts["skip"],
                "lr_scale": self.actions.lr_scale,
                "quarantined": len(self.quarantine.records),
            },
        }
        self.checkpoints.save(step, tensors, plain, manifest)
        for error in self._checkpoint_errors():
            self._warn(error)

    def _set_aside_earlier_checkpoints(self) -> None:
        """Before a new run's first checkpoint, move an earlier run's checkpoints in the same
        run_dir aside, so that none is replaced: a restart that forgot `Guard.resume` loses
        nothing."""
        assert self.checkpoints is not None
        directory = self.checkpoints.directory
        earlier = self.checkpoints.complete()
        if not earlier or (self.ranks is not None and not self.ranks.is_leader):
            return
        hint = "use tg.Guard.resume(...) to carry on from a run"
        if self.ranks is not None:  # other ranks write into the folder: it cannot move now
            self._warn(
                f"{directory} holds checkpoints of an earlier run (newest {earlier[0].name}); "
                f"this run started at step 0 replaces them as it reaches their steps: {hint}"
            )
            return
        stamp = _utc_now().replace(":", "").replace("+", "")[:17]
        aside = directory.with_name(f"{directory.name}-earlier-{stamp}")
        try:
            os.rename(directory, aside)
        except OSError as exc:
            self._warn(
                f"{directory} holds an earlier run's checkpoints and cannot be moved "
                f"aside ({exc.strerror}); this run replaces them as it goes: {hint}"
            )
            return
        self._warn(
            f"{directory} held checkpoints of an earlier run (newest {earlier[0].name}): moved to "
            f"{aside.name}, so that this run, started at step 0, replaces none of them; {hint}"
        )

    def _checkpoint_errors(self) -> list[str]:
        if self.checkpoints is None or not self.checkpoints.errors:
            return []
        errors, self.checkpoints.errors = self.checkpoints.errors, []
        return errors

    @classmethod
    def resume(
        cls,
        run_dir: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        config: GuardConfig | None = None,
        sinks: Sequence[Sink] = (),
    ) -> Guard:
        """A Guard restored from the newest complete checkpoint in `run_dir`: model, optimizer,
        scheduler, scaler, RNGs, detectors, LR cuts, quarantine and data position."""
        path = Path(run_dir)
        if not path.is_dir():
            raise TrainguardError(
                f"cannot resume: {path} does not exist; start a new run with tg.Guard(...)"
            )
        if config is None and (path / "config.json").is_file():
            config = GuardConfig.load(path / "config.json")
        guard = cls(model, optimizer, scheduler, scaler, config=config, run_dir=path, sinks=sinks)
        guard._continues_a_run = True
        try:
            guard._restore_newest()
        except BaseException:  # a checkpoint that does not fit: release the run folder
            guard.close()
            raise
        return guard

    def _restore_newest(self) -> None:
        assert self.checkpoints is not None and self.model is not None
        assert self.optimizer is not None and self.actions is not None
        if self.ranks is not None:
            found_dist = self._newest_for_all_ranks()
            if found_dist is None:
                return
            manifest, path = found_dist
            plain = load_sharded(
                self.checkpoints,
                path,
                manifest,
                self.model,
                self.optimizer,
                self.scheduler,
                self.scaler,
                self.ranks.rank,
            )
            self._check_guard_state(plain)
        else:

            def fits(
                path: Path, tensors: dict[str, torch.Tensor], plain: dict[str, Any]
            ) -> Callable[[], None]:  # one that does not fit the run raises: all older alike
                assert self.model is not None and self.optimizer is not None
                apply = prepare_restore(
                    path, tensors, plain, self.model, self.optimizer, self.scheduler, self.scaler
                )
                self._check_guard_state(plain)
                return apply

            found = self.checkpoints.load_newest(self._warn, fits)
            if found is None:
                self._warn(
                    f"no usable checkpoint in {self.checkpoints.directory}: starting at step 0"
                )
                return
            manifest, plain, apply = found
            path = Path(manifest["path"])
            apply()
        self.load_state_dict(plain["guard"])
        self.checkpoints.protected = set(plain.get("protected", []))
        self._last_good_checkpoint = plain.get("last_good_checkpoint")
        self._resume_data = plain["data"]
        self._emit(
            Event(
                step=self.global_step,
                kind="resume",
                severity="info",
                message=f"resumed from the checkpoint at step {manifest['step']} ({path.name})",
                metrics={"checkpoint": str(path), "step": manifest["step"]},
                action="step",
            )
        )

    def _check_guard_state(self, plain: dict[str, Any]) -> None:
        """Load a checkpoint's guard state into throwaway copies of the detectors, policy and
        actions: `DamagedCheckpoint` when it does not load, before anything live is touched."""
        state = plain["guard"]
        try:
            DetectorSuite(self.config).load_state_dict(state["detectors"])
            StepPolicy(self.config.policy, self.config.recovery).load_state_dict(state["policy"])
            if self.optimizer is not None and state.get("actions") is not None:
                OptimizerActions(self.optimizer).load_state_dict(state["actions"])
            self._counters(state)
            data = plain["data"]
            if data is not None:
                int(data["position"])
                if "start_rng" in data:
                    check_rng(data["start_rng"], None)
        except DamagedCheckpoint:
            raise
        except Exception as exc:  # a malformed state raises KeyError, TypeError, ValueError...
            raise DamagedCheckpoint(
                f"its guard state is malformed ({type(exc).__name__}: {exc})"
            ) from None

    def _newest_for_all_ranks(self) -> tuple[dict[str, Any], Path] | None:
        """Rank 0 picks the newest checkpoint that verifies; every rank gets its choice."""
        assert self.checkpoints is not None and self.ranks is not None
        choice: list[Any] = [None]
        if self.ranks.is_leader:
            for path in self.checkpoints.complete():
                try:
                    manifest = self.checkpoints.verify(path)
                except DamagedCheckpoint as exc:
                    self._warn(passed_over(path, exc))
                    continue
                manifest["path"] = str(path)
                choice = [manifest]
                break
        torch.distributed.broadcast_object_list(choice, src=0, group=self.ranks.group)
        if choice[0] is None:
            self._warn(f"no usable checkpoint in {self.checkpoints.directory}: starting at step 0")
            return None
        manifest = dict(choice[0])
        return manifest, Path(manifest["path"])

    def _warn(self, message: str) -> None:
        self._emit(
            Event(
                step=self.global_step,
                kind="checkpoint",
                severity="warning",
                message=message,
                metrics={},
            )
        )

    def _halt(self, decision: Decision, raise_error: bool) -> None:
        self._protect_last_good()
        diagnosis = f"trainguard halted the run at step {decision.step}: {decision.reason}"
        event = Event(
            step=decision.step,
            kind="halt",
            severity="critical",
            message=diagnosis,
            metrics={"events": [e.kind for e in decision.events]},
            action="halt",
        )
        decision.events.append(event)
        self._emit(event)
        if raise_error:
            self.close()
            raise TrainingHalted(diagnosis, decision)

    # -- state and lifetime -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Detector and policy state with the step counter: plain data, safe to checkpoint."""
        return {
            "global_step": self.global_step,
            "detectors": self.detectors.state_dict(),
            "policy": self.policy.state_dict(),
            "actions": self.actions.state_dict() if self.actions is not None else None,
            "last_incident": self._last_incident,
            "positions": [[k, v] for k, v in self._positions.items()],
            "action_counts": dict(self.action_counts),
            "quarantine_suspects": self.quarantine.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._continues_a_run = True
        self.global_step = int(state["global_step"])
        self.detectors.load_state_dict(state["detectors"])
        self.policy.load_state_dict(state["policy"])
        if self.actions is not None and state.get("actions") is not None:
            self.actions.load_state_dict(state["actions"])
        self._last_incident, self._positions, counts = self._counters(state)
        self.action_counts.update(counts)
        self.quarantine.load_state_dict(state.get("quarantine_suspects", []))

    def _counters(self, state: dict[str, Any]) -> tuple[int, dict[int, int], dict[str, int]]:
        """The last incident, the data positions and the action counts of a guard state."""
        return (
            int(state.get("last_incident", self._last_incident)),
            {int(k): int(v) for k, v in state.get("positions", [])},
            {str(k): int(v) for k, v in state.get("action_counts", {}).items()},
        )

    def close(self) -> None:
        """Record a `run_closed` event, flush and close every sink and release the run folder;
        the guard stays usable for `state_dict`."""
        if self._closed:
            return
        self._closed = True
        if self.checkpoints is not None:
            self.checkpoints.wait()
            for error in self._checkpoint_errors():
                self._warn(error)
        self._emit(  # how `trainguard watch` tells a finished run from one that was killed
            Event(
                step=self.global_step,
                kind="run_closed",
                severity="info",
                message=f"the run closed at step {self.global_step}",
            )
        )
        self._release_outputs()

    def _release_outputs(self) -> None:
        """Close the sinks and the quarantine file, then unlock the run folder (last, so that
        no other writer starts while these still write)."""
        try:
            for sink in self.sinks:
                sink.close()
            self.quarantine.close()
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _version() -> str:
    from trainguard import __version__

    return __version__


def _report(message: str) -> None:
    """A line about the guard's own outputs (an alert channel failing), on stderr."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(
        f"[yellow]trainguard:[/] {escape(message)}", highlight=False, soft_wrap=True
    )


def _spike_baseline(decision: Decision, values: list[float]) -> float | None:
    """The loss level before the spike, in the per-sample losses' units (their mean over the
    step's loss rescales it, should they be sums or the step's loss hold other terms)."""
    spike = next((e for e in decision.events if e.kind == "loss_spike"), None)
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


def _origin_metrics(report: NonFiniteReport) -> dict[str, Any]:
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


def _add_rank_figures(point: MetricPoint, extra: list[float], world: int) -> None:
    """Per-rank columns of the exchange: loss, own grad norm squared, step time, data wait."""
    rows = [extra[r * 4 : (r + 1) * 4] for r in range(world)]
    point.rank_losses = [r[0] for r in rows]
    if not all(math.isnan(r[1]) for r in rows):  # all NaN: no DDP hook measured them
        point.rank_grad_norms = [math.sqrt(r[1]) if r[1] >= 0 else r[1] for r in rows]
    point.rank_step_times = [r[2] for r in rows]
    point.rank_data_waits = [r[3] for r in rows]


def _point_from_signals(step: int, s: StepSignals) -> MetricPoint:
    return MetricPoint(
        step=step,
        loss=s.loss,
        grad_norm=s.grad_norm,
        lr=s.lrs[0] if s.lrs else None,
        loss_scale=s.loss_scale,
        overflow=s.overflow,
        nonfinite_grads=s.nonfinite_grads,
        nonfinite_params=s.nonfinite_params,
        group_grad_norms=s.group_grad_norms,
        update_ratio=s.update_ratio,
        group_param_norms=s.group_param_norms,
    )


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() != 1 else value.item()
    if isinstance(value, (int, str, bool)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)
