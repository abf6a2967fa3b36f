"""`Guard`: one call per optimizer step that measures, exchanges, detects, decides, acts and
records, through named components that each own one concern."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainguard.actions import OptimizerActions
from trainguard.actions.checkpoint_files import DamagedCheckpoint
from trainguard.actions.checkpoints import CheckpointStore, check_checkpoint_folders, check_rng
from trainguard.actions.data import GuardedBatches, default_batch_ids
from trainguard.actions.preempt import Preemption
from trainguard.actions.preemptive import PreemptiveActions
from trainguard.actions.quarantine import Quarantine
from trainguard.actions.replicas import ReplicaResync
from trainguard.actions.snapshots import SnapshotRing
from trainguard.actions.user_actions import ActionTarget, build_actions, run_actions
from trainguard.checkpointing import Checkpointing
from trainguard.config import ConfigInput, GuardConfig
from trainguard.detectors import DetectorSuite, MetricPoint
from trainguard.detectors.loss_spike import LossSpikeDetector
from trainguard.detectors.ranks import RankOutlierDetector, StragglerDetector
from trainguard.diagnosis.lint import Finding
from trainguard.diagnosis.step_diagnosis import StepDiagnosis
from trainguard.distributed import LocalGradNorm, StepExchange, local_grad_norm_hook
from trainguard.distributed.reduce import ReduceExchange
from trainguard.distributed.replicas import ReplicaFingerprint
from trainguard.events import Decision, Event, EventKind, Severity, TrainguardError
from trainguard.moe.routing import RoutingStats
from trainguard.monitor import Monitor, checked_token_accuracy
from trainguard.policy import StepPolicy
from trainguard.recorder import action_counts, report
from trainguard.recovery import Recovery
from trainguard.signals import GradientStats, StepSignals
from trainguard.signals.gradients import Measurement
from trainguard.signals.precursors import PrecursorProbe
from trainguard.sinks import Sink

_D = TypeVar("_D")
UNREWOUND_CONFIRM_STEPS = 2  # far-up steps that confirm an explosion where data goes on


@dataclass
class _Training:
    """The parts a guard that steps the optimizer has; a guard built without an optimizer
    only observes."""

    optimizer: torch.optim.Optimizer
    stats: GradientStats
    actions: OptimizerActions
    diagnosis: StepDiagnosis


class Guard(Monitor):
    """Watches every step of a training loop and steps, skips, rolls back or halts it.

    `step(loss)` replaces `clip_grad_norm_` + `optimizer.step()` + `scheduler.step()`;
    `observe(step, loss=...)` only watches numbers (as `Monitor` does). `lint_scheduler`, a
    schedule a framework steps (not the guard), is what the lint traces.
    """

    # a due checkpoint put off while the last is written: (step, clock, warned); and the
    # rollbacks the checkpoint stager was told of (class defaults: subclasses set up their own)
    _deferred_checkpoint: tuple[int, float, bool] | None = None
    _rollbacks_staged = 0

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        config: ConfigInput = None,
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
        cfg = GuardConfig.of(config)
        if run_dir is not None and model is not None and optimizer is not None:
            check_checkpoint_folders(Path(run_dir) / "checkpoints")  # before the lock is taken
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        stats = None
        if optimizer is not None:
            stats = GradientStats(
                model,
                optimizer,
                cfg.group_patterns,
                cfg.stats_every,
                weight_norms=cfg.weight_jump.enabled,
            )
        super().__init__(
            cfg, run_dir, sinks, device=stats.device if stats is not None else None
        )  # the detectors, policy, ranks, enrichment and recorder; opens the files below
        self.exchange = self._step_exchange()
        self._local_norm: LocalGradNorm | None = None
        if self.ranks is not None and isinstance(model, DistributedDataParallel):
            self._local_norm = LocalGradNorm(self.ranks.group)
            model.register_comm_hook(self._local_norm, local_grad_norm_hook)
        self.replicas: ReplicaFingerprint | None = None
        self._resync: ReplicaResync | None = None
        self._recheck = False  # a resync is checked at the next step
        if self.ranks is not None and model is not None and optimizer is not None:
            self._watch_replicas(model, None if _shards_state(optimizer) else optimizer)
        actions = (
            OptimizerActions(optimizer, scheduler, scaler, cfg.max_grad_norm)
            if optimizer is not None
            else None
        )
        self.recovery = Recovery(
            cfg, self.policy, self.detectors, self.quarantine, model, optimizer, scheduler, scaler,
            actions,
        )  # fmt: skip
        self._training: _Training | None = None
        if optimizer is not None and stats is not None and actions is not None:
            diagnosis = StepDiagnosis(
                cfg, model, optimizer, self.ranks, self._local_norm, self._rank_judge()
            )
            self._training = _Training(optimizer, stats, actions, diagnosis)
        self.user_actions = build_actions(cfg) if self._training is not None else []
        self.probe: PrecursorProbe | None = None
        self.preemption: Preemption | None = None
        self._weights_rewritten = False  # a QK rescale after the last optimizer step
        self.preemptive: PreemptiveActions | None = None
        if model is not None:
            self._start_probe(model, optimizer, stats)
        self.checkpointing: Checkpointing | None = None
        if self.run_dir is not None and model is not None and optimizer is not None:
            store = CheckpointStore(
                self.run_dir / "checkpoints",
                cfg.recovery.keep_checkpoints,
                cfg.recovery.async_checkpoints,
                self.ranks,
                cfg.recovery.dedup_checkpoints,
            )
            self.checkpointing = Checkpointing(
                store, model, optimizer, scheduler, scaler, self.ranks, self._warn
            )
            self.recovery.durable = _CheckpointTargets(self.checkpointing, self._check_guard_state)
        self._resume_data: dict[str, Any] | None = None
        self.checkpoint_clock: Callable[[], float] = time.monotonic  # seconds; tests replace it
        self._last_checkpoint_at: float | None = None  # on the clock: the last one, or the start
        self._size_confirmation()
        self.findings: list[Finding] = []
        if cfg.diagnosis.lint and model is not None and self._training is not None:
            linted = lint_scheduler if lint_scheduler is not None else scheduler
            self._publish(self._training.diagnosis.lint(model, linted, scaler))
            self.findings = self._training.diagnosis.findings

    def _start_probe(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        stats: GradientStats | None,
    ) -> None:
        """The precursor probe (armed for step 0) and the preemptive actions on `model`; what
        the probe cannot find in the model is said once (info)."""
        cfg = self.config.precursors
        if cfg.enabled:
            self.probe = PrecursorProbe(
                model,
                cfg,
                optimizer,
                stats.params if stats is not None else (),
                stats.groups.index if stats is not None else (),
                stats.groups.group_names if stats is not None else (),
                self.ranks,
            )
            self.probe.arm(self.global_step)
            missing = self.probe.missing_message()
            if missing is not None:
                # attention found but not measurable (no head count): said where the console shows
                unsized = bool(self.probe.structure.unsized)
                self._publish([self._probe_note(missing, "warning" if unsized else "info")])
        self.preemption = Preemption(
            model, self.probe.structure if self.probe is not None else None
        )
        self.preemptive = PreemptiveActions(
            self._training.actions if self._training is not None else None,
            self.preemption,
            cfg.preempt.z_loss_weight,
        )

    def _probe_note(self, message: str, severity: Severity = "info") -> Event:
        return Event(step=self.global_step, kind=EventKind.LINT, severity=severity, message=message)

    def _take_precursors(
        self, step: int, measurement: Measurement, token_accuracy: torch.Tensor | float | None
    ) -> None:
        """On a sampled step, the probe's figures join the measurement (one all-gather in a
        distributed run, on every rank alike); a token accuracy passed in replaces the probe's."""
        if self.probe is not None:
            taken = self.probe.take(step, measurement.head.device)
            if taken is not None:
                measurement.precursors, measurement.token_accuracy = taken
                measurement.precursor_names = self.probe.names
                if self.probe.rope_unseen:
                    self.probe.rope_unseen = False
                    self.probe.structure.uses_rope = False  # said once
                    self._publish(
                        [
                            self._probe_note(
                                "precursors: the model uses rotary position embeddings the "
                                "attention layers do not receive as `position_embeddings`; "
                                "its attention logits are measured before the rotation"
                            )
                        ]
                    )
        if isinstance(token_accuracy, torch.Tensor):
            measurement.token_accuracy = token_accuracy.detach().float().reshape(1)
        elif token_accuracy is not None:
            measurement.given_token_accuracy = float(token_accuracy)

    def _arm_probe(self) -> None:
        """Hook the next step's forward where it is a sampled step."""
        if self.probe is not None:
            self.probe.arm(self.global_step)

    def _step_exchange(self) -> StepExchange | ReduceExchange | None:
        """The per-step exchange `ranks.exchange` names (none outside a distributed run)."""
        if self.ranks is None:
            return None
        if self.config.ranks.exchange == "gather":
            return StepExchange(self.ranks)
        # each rank judged by the live detectors' own lines
        return ReduceExchange(
            self.ranks, self._live(RankOutlierDetector), self._live(StragglerDetector)
        )

    def _watch_replicas(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Compare the data-parallel replicas of `model` every `replicas.every` steps, and give a
        diverged one a copy of an agreeing one: its parameters, its buffers where DDP broadcasts
        them, and `optimizer`'s state (None where the optimizer partitions its state)."""
        assert self.ranks is not None
        fingerprint = ReplicaFingerprint(
            model, self.ranks, self.config.group_patterns, self.config.replicas.every
        )
        if not fingerprint.enabled:
            return
        self.replicas = fingerprint
        buffers = isinstance(model, DistributedDataParallel) and bool(model.broadcast_buffers)
        self._resync = ReplicaResync(fingerprint, model, optimizer, buffers)

    def _check_replicas(self, point: MetricPoint) -> None:
        """On a check's step (or the step after a resync), every rank's replica compared: a
        collective, made on every rank."""
        if self.replicas is not None and (self.replicas.due(point.step) or self._recheck):
            point.replica_classes = self.replicas.compare()
            self._recheck = False

    def _resync_replicas(self, decision: Decision) -> list[Event]:
        """Give the diverged replicas the copy the decision names (a collective, made on every
        rank), and set aside the snapshots that may hold a diverged replica."""
        if decision.resync_from is None or self._resync is None:
            return []
        dropped = self.recovery.set_aside_after(decision.agreed_step)
        self._recheck = True
        if self.checkpointing is not None:  # weights written behind the stager's back
            self.checkpointing.forget_staged()
        return self._publish(self._resync.apply(decision, dropped))

    def _open_files(self) -> None:
        rank = self.ranks.rank if self.ranks is not None else None
        name = "quarantine.jsonl" if rank is None else f"quarantine-rank{rank}.jsonl"
        path = self.run_dir / name if self.run_dir is not None else None
        self.quarantine = Quarantine(path, report)

    def _close_files(self) -> None:
        self.quarantine.close()

    def _live(self, kind: type[_D]) -> _D | None:
        """The live detector of `kind`, None where it is off."""
        return next((d for d in self.detectors.detectors if isinstance(d, kind)), None)

    def _rank_judge(self) -> RankOutlierDetector:
        """The live rank detector, which judges a replay by what the run taught it."""
        live = [d for d in self.detectors.detectors if isinstance(d, RankOutlierDetector)]
        return live[0] if live else RankOutlierDetector(self.config.ranks)

    def _trainer(self, call: str) -> _Training:
        if self._training is None:
            raise TrainguardError(
                f"{call} needs an optimizer: build Guard(model, optimizer, ...), "
                "or use guard.observe(step, loss=...) to only watch numbers"
            )
        return self._training

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
        token_accuracy: torch.Tensor | float | None = None,
    ) -> Decision:
        """Measure this step's gradients after `loss.backward()`, run the detectors, and step,
        skip, roll back or halt (raising `TrainingHalted`); with a GradScaler pass the unscaled
        loss.

        `replay`, a closure that recomputes this step's loss, lets the guard trace where NaN/Inf
        first appeared; `per_sample_losses` (one per sample, left on the device and read only
        on a spike; or a closure computing them, called only on a spike) and `sample_text` let
        it name the samples behind a loss spike; `routing` (`trainguard.moe.routing_stats`)
        feeds the routing-collapse detector; `token_accuracy` (a share of tokens, a tensor or a
        float) replaces the one the precursor probe measures on its sampled steps."""
        parts = self._trainer("guard.step")
        token_accuracy = checked_token_accuracy(token_accuracy)
        step = self.global_step
        self.recovery.remember_position(step)
        # measure (on the device), exchange (one collective), clip, then one host transfer
        parts.actions.unscale()
        measurement = parts.stats.measure(loss, parts.optimizer, self.scaler)
        self._take_precursors(step, measurement, token_accuracy)
        batches = self.recovery.batches
        checkpoint_due = self._checkpoint_due_by_time()
        checkpoint_busy: bool | None = None  # this rank's writer alone, outside a distributed run
        if self.exchange is not None:  # every rank's named row, in the step's one collective
            self.exchange.share(
                measurement,
                hook=self._local_norm,
                ready_at=batches.ready_at if batches is not None else None,
                data_wait=batches.data_wait if batches is not None else 0.0,
                last_step_time=self.recorder.last_step_time,
                checkpoint_due=checkpoint_due,
                checkpoint_busy=self._checkpoint_busy(),
            )
        parts.actions.clip(parts.stats.params, measurement.total_norm)
        signals = parts.stats.resolve(measurement)
        point = _point_from_signals(step, signals)
        self._check_replicas(point)
        if routing is not None:
            point.routing = routing.to_point()
        point.weights_rewritten, self._weights_rewritten = self._weights_rewritten, False
        if self.exchange is not None:
            self.exchange.add_rank_figures(point, signals.extra)
            checkpoint_due = self.exchange.checkpoint_due  # any rank's clock: due on all
            checkpoint_busy = self.exchange.checkpoint_busy  # any rank's writer: all defer
        # detect and decide
        decision, events = self._decide(
            point, batch_ids, self.recovery.has_target, parts.stats.group_report
        )
        if per_sample_losses is not None and any(e.kind == EventKind.LOSS_SPIKE for e in events):
            blamed, found = parts.diagnosis.blame(
                decision, per_sample_losses, sample_ids or batch_ids, sample_text
            )
            events += self._publish(found)
            if blamed:
                sample_ids = blamed
        # act
        events += self._publish(
            self.recovery.hold_data(decision, signals.loss, batch_ids, sample_ids)
        )
        self.global_step += 1
        if decision.action == "step":
            parts.stats.before_optimizer_step(step)
            self.recovery.before_update()  # the device waits for a snapshot's copy, not the host
            parts.actions.step(signals.loss)
            parts.stats.after_optimizer_step(step)
            events += self._publish(self.recovery.cut_lr(decision))
            if self.preemptive is not None:  # on a precursor warning, where the policy chose
                taken = self.preemptive.apply(decision)
                self._weights_rewritten = any(
                    e.metrics.get("action") == "rescale_qk" for e in taken
                )
                events += self._publish(taken)
            self._publish(self.recovery.maybe_snapshot(self.global_step))  # about the run
            events += self._maybe_checkpoint(checkpoint_due, checkpoint_busy)
        else:
            parts.stats.discard_update()
            self.recovery.before_update()  # a resync or a restore writes what may be copied
            parts.actions.skip()
            events += self._resync_replicas(decision)
            if decision.action == "rollback":
                if self.checkpointing is not None:
                    self.checkpointing.protect_last_good()
                self.global_step, done = self.recovery.roll_back(decision)
                events += self._publish(done)
            elif decision.action == "skip":
                events += self._publish(self.recovery.cut_lr(decision))
        if self.user_actions:
            target = ActionTarget(
                self.global_step, self.model, parts.optimizer, self.scheduler, self.recovery.batches
            )
            acted = dataclasses.replace(decision, events=list(events))
            events += self._publish(run_actions(self.user_actions, acted, target))
        if self.checkpointing is not None:  # a background write that failed
            self.checkpointing.report_errors()
        # diagnose what the decision left to explain, then record
        events += self._publish(parts.diagnosis.after_step(decision, replay))
        self._arm_probe()
        result = self._finish(point, decision, events, signals)
        if result.action == "halt":
            result = self._halt(result, raise_error=True)
        return result

    def snapshot_barrier(self) -> None:
        """Call before writing weights or optimizer state outside `optimizer.step()` (an EMA
        written into the parameters, a manual update, a tensor LR stepped by hand): on a GPU a
        snapshot's copy may still be reading them, and this makes the device wait for it (the
        host goes on); on a CPU the copy is already done and this does nothing."""
        self.recovery.before_update()

    def _finish(
        self,
        point: MetricPoint,
        decision: Decision,
        events: list[Event],
        signals: StepSignals | None,
    ) -> Decision:
        result = super()._finish(point, decision, events, signals)
        if self.recorder.step_seconds is not None:  # the median sizes the snapshot interval
            self.recovery.note_step_time(self.recorder.step_seconds)
        return result

    def _halt(self, decision: Decision, raise_error: bool) -> Decision:
        if self.checkpointing is not None:  # the last known-good state outlives retention
            self.checkpointing.protect_last_good()
        return super()._halt(decision, raise_error)

    def _decide(
        self,
        point: MetricPoint,
        batch_ids: Iterable[Any] | None,
        can_roll_back: bool | Callable[[int], bool] = False,
        group_report: Callable[[], dict[str, Any]] | None = None,
    ) -> tuple[Decision, list[Event]]:
        decision, events = super()._decide(point, batch_ids, can_roll_back, group_report)
        self.recovery.note_decision(decision)
        return decision, events

    def batches(
        self,
        source: Iterable[Any],
        ids: Callable[[Any], list[Any] | None] = default_batch_ids,
    ) -> GuardedBatches:
        """Wrap the data so a rollback rewinds it and skips the batches that fed the incident,
        and quarantined batches never come back; `ids(batch)` names a batch's samples. A source
        with a `len()` sizes the recovery when `diagnosis.total_steps` is not set."""
        batches = GuardedBatches(source, ids, self.quarantine.contains, self._data_ended)
        self.recovery.size_to_data(batches)
        self._size_confirmation()
        if self._resume_data is not None:
            batches.resume(self._resume_data)
            self._resume_data = None
        return batches

    def _data_ended(self, batches: GuardedBatches) -> None:
        self._publish([self.recovery.data_ended(batches, self.global_step)])

    def _size_confirmation(self) -> None:
        """`loss_spike.confirm_steps` left to the run: an explosion confirmed after 2 steps
        where a rollback cannot rewind the data (each step waited is lost), after the whole
        window where it replays the data (a fault of a few steps ends first)."""
        if self.config.loss_spike.confirm_steps is not None:
            return
        for detector in self.detectors.detectors:
            if isinstance(detector, LossSpikeDetector):
                detector.confirm_steps = 0 if self.rewinds_data else UNREWOUND_CONFIRM_STEPS

    # -- what the components hold, by their old names ----------------------------------------
    @property
    def rewinds_data(self) -> bool:
        """Whether a rollback rewinds the data (it comes through `guard.batches`); else the
        steps since the rollback target are lost learning."""
        return self.recovery.rewinds_data

    @property
    def snapshot_interval(self) -> int:
        """Steps between snapshots (`Recovery.snapshot_interval`)."""
        return self.recovery.snapshot_interval

    @property
    def ring(self) -> SnapshotRing:
        return self.recovery.ring

    @property
    def actions(self) -> OptimizerActions | None:
        return self.recovery.actions

    @property
    def stats(self) -> GradientStats | None:
        return self._training.stats if self._training is not None else None

    @property
    def checkpoints(self) -> CheckpointStore | None:
        return self.checkpointing.store if self.checkpointing is not None else None

    # -- durable checkpoints ----------------------------------------------------------------------
    @property
    def _saves_checkpoints(self) -> bool:
        """Whether this guard writes durable checkpoints (a model, an optimizer, a run_dir)."""
        return self.checkpointing is not None

    def _checkpoint_due_by_time(self) -> bool:
        """Whether `recovery.checkpoint_every_s` seconds have passed on this rank's clock since
        the last checkpoint (or the first step)."""
        every_s = self.config.recovery.checkpoint_every_s
        if every_s is None or not self._saves_checkpoints:
            return False
        now = self.checkpoint_clock()
        if self._last_checkpoint_at is None:
            self._last_checkpoint_at = now
        return now - self._last_checkpoint_at >= every_s

    def _checkpoint_busy(self) -> bool:
        """Whether a checkpoint now would wait on the training thread (the previous one still
        written, or its buffers still allocated): then a due one is deferred."""
        return self.checkpointing is not None and self.checkpointing.busy

    def _maybe_checkpoint(self, due_by_time: bool, busy: bool | None = None) -> list[Event]:
        """A checkpoint every `checkpoint_every` steps, or where the time is due (agreed by every
        rank in a distributed run), whichever comes first; deferred to a later step while
        `busy` (any rank's writer, agreed; None: this guard's own). The events it gives."""
        every = self.config.recovery.checkpoint_every
        checkpointing = self.checkpointing
        if not self._saves_checkpoints:
            return []
        if checkpointing is not None:
            rollbacks = self.action_counts["rollback"]
            if self._weights_rewritten or rollbacks != self._rollbacks_staged:
                self._rollbacks_staged = rollbacks  # weights written behind the stager's back
                checkpointing.forget_staged()
            checkpointing.prepare()
        due = due_by_time or bool(every and self.global_step % every == 0)
        if not due and self._deferred_checkpoint is None:
            return []
        if busy is None:
            busy = self._checkpoint_busy()
        if busy:
            return self._defer_checkpoint()
        self._deferred_checkpoint = None
        self.save_checkpoint()
        return []

    def _defer_checkpoint(self) -> list[Event]:
        """Defer a due checkpoint to the next step the writer is free: said once, and warned once
        when it has waited for a whole checkpoint interval."""
        step, now = self.global_step, self.checkpoint_clock()
        if self._deferred_checkpoint is None:
            self._deferred_checkpoint = (step, now, False)
            writing = self._writing_step()
            if writing is not None:
                what = f"the checkpoint of step {writing} is still being written"
            elif self.checkpoints is not None and self.checkpoints.preparing:
                what = "the checkpoint buffers are still being allocated"
            else:
                what = "another rank is still writing the last checkpoint"
            metrics: dict[str, Any] = {"deferred_step": step}
            if writing is not None:
                metrics["writing_step"] = writing
            return self._checkpoint_event(
                "info",
                f"checkpoint deferred at step {step}: {what}; it is taken at the first step "
                "the writer is free",
                metrics,
            )
        since, at, warned = self._deferred_checkpoint
        recovery = self.config.recovery
        every, every_s = recovery.checkpoint_every, recovery.checkpoint_every_s
        late = bool(every and step - since >= every) or (
            every_s is not None and now - at >= every_s
        )
        if not late or warned:
            return []
        self._deferred_checkpoint = (since, at, True)
        return self._checkpoint_event(
            "warning",
            f"the checkpoint due at step {since} is still deferred at step {step}, a whole "
            "checkpoint interval: writing one takes longer than the interval; raise "
            "recovery.checkpoint_every (or checkpoint_every_s), or write to faster storage",
            {"deferred_step": since, "steps_deferred": step - since},
        )

    def _writing_step(self) -> int | None:
        """The step of the checkpoint this rank is still writing, None when none is."""
        store = self.checkpoints
        return store.writing_step if store is not None and store.writing else None

    def _checkpoint_event(
        self, severity: Severity, message: str, metrics: dict[str, Any]
    ) -> list[Event]:
        event = Event(
            step=self.global_step,
            kind=EventKind.CHECKPOINT,
            severity=severity,
            message=message,
            metrics=metrics,
        )
        return self._publish([event])

    def save_checkpoint(self) -> None:
        """Write a durable checkpoint of the state at the start of the next step (asynchronous
        by default: this blocks only while the tensors are staged). Called by hand, it first
        waits for a checkpoint still being written (so may `close()` and a halt); a checkpoint
        the guard finds due is deferred instead, never waited for."""
        if self.checkpointing is None:
            raise TrainguardError(
                "checkpoints need a model, an optimizer and a run_dir: build "
                "Guard(model, optimizer, ..., run_dir=...)"
            )
        step = self.global_step
        self._last_checkpoint_at = self.checkpoint_clock()  # the time interval counts from here
        known_good = self.recovery.healthy_window(step)
        actions = self.recovery.actions
        manifest = {
            "trainguard_version": _version(),
            "known_good": known_good,
            "incidents": {
                "rollbacks": self.action_counts["rollback"],
                "skips": self.action_counts["skip"],
                "lr_scale": actions.lr_scale if actions is not None else 1.0,
                "quarantined": len(self.quarantine.records),
            },
        }
        batches = self.recovery.batches
        self.checkpointing.save(
            step,
            known_good,
            self.state_dict(),
            batches.state() if batches is not None else None,
            manifest,
        )

    @classmethod
    def resume(
        cls,
        run_dir: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        config: ConfigInput = None,
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
        try:
            guard._restore_newest()
        except BaseException:  # a checkpoint that does not fit: release the run folder
            guard.close()
            raise
        return guard

    def _restore_newest(self) -> None:
        if self.checkpointing is None:
            raise TrainguardError("resume needs a model, an optimizer and a run_dir")
        found = self.checkpointing.restore_newest(self._check_guard_state)
        if found is None:
            return
        manifest, path, plain = found
        self.load_state_dict(plain["guard"])
        self._resume_data = plain["data"]
        self._publish(
            [
                Event(
                    step=self.global_step,
                    kind=EventKind.RESUME,
                    severity="info",
                    message=f"resumed from the checkpoint at step {manifest['step']} ({path.name})",
                    metrics={"checkpoint": str(path), "step": manifest["step"]},
                    action="step",
                )
            ]
        )

    def _check_guard_state(self, plain: dict[str, Any]) -> None:
        """Load a checkpoint's guard state into throwaway copies of the detectors, policy and
        actions: `DamagedCheckpoint` when it does not load, before anything live is touched."""
        state = plain["guard"]
        try:
            DetectorSuite(self.config).load_state_dict(state["detectors"])
            StepPolicy(
                self.config.policy, self.config.recovery, self.config.precursors.preempt
            ).load_state_dict(state["policy"])
            if self.optimizer is not None and state.get("actions") is not None:
                OptimizerActions(self.optimizer).load_state_dict(state["actions"])
            self.recovery.read_state(state)
            action_counts(state)
            if state.get("diagnosis") is not None:
                int(state["diagnosis"].get("last_trace", 0))
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

    def _warn(self, message: str) -> None:
        self._publish(
            [
                Event(
                    step=self.global_step,
                    kind=EventKind.CHECKPOINT,
                    severity="warning",
                    message=message,
                    metrics={},
                )
            ]
        )

    # -- state and lifetime -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Detector, policy, action and recovery state with the step counter: plain data, safe
        to checkpoint."""
        actions = self.recovery.actions
        return {
            "global_step": self.global_step,
            "detectors": self.detectors.state_dict(),
            "policy": self.policy.state_dict(),
            "last_evaluation": self._last_evaluation,
            "actions": actions.state_dict() if actions is not None else None,
            **self.recovery.state_dict(),  # the last incident and the data positions
            **self.recorder.state_dict(),
            "quarantine_suspects": self.quarantine.state_dict(),
            "diagnosis": self._training.diagnosis.state_dict() if self._training else None,
            "user_actions": {a.name: a.state_dict() for a in self.user_actions},
            "preemption": self.preemption.state_dict() if self.preemption is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.checkpointing is not None:
            self.checkpointing.continues_a_run = True  # its checkpoints are this run's own
        super().load_state_dict(state)
        actions = self.recovery.actions
        if actions is not None and state.get("actions") is not None:
            actions.load_state_dict(state["actions"])
        self.recovery.load_state_dict(state)
        self.quarantine.load_state_dict(state.get("quarantine_suspects", []))
        if self._training is not None and state.get("diagnosis") is not None:
            self._training.diagnosis.load_state_dict(state["diagnosis"])
        saved = state.get("user_actions", {})
        for action in self.user_actions:
            if action.name in saved:
                action.load_state_dict(saved[action.name])
        if self.preemption is not None and state.get("preemption") is not None:
            self.preemption.load_state_dict(state["preemption"])
        self._arm_probe()  # the sampled steps count from the restored step

    def _before_close(self) -> None:
        if self.checkpointing is not None:
            if self._deferred_checkpoint is not None and not self.action_counts["halt"]:
                self._deferred_checkpoint = None  # the one still deferred: taken, once the
                self.save_checkpoint()  # last write is over (on every rank alike)
            self.checkpointing.wait()


class _CheckpointTargets:
    """The run's known-good checkpoints as rollback targets (`recovery.DurableTarget`)."""

    def __init__(
        self, checkpointing: Checkpointing, check: Callable[[dict[str, Any]], None]
    ) -> None:
        self.checkpointing = checkpointing
        self.check = check

    def known_good_at_or_before(self, step: int) -> int | None:
        return self.checkpointing.known_good_at_or_before(step)

    def restore_step(self, step: int) -> dict[str, Any]:
        self.checkpointing.wait()  # the writer is done with the live state's staged copy
        return self.checkpointing.restore_step(step, self.check)

    def forget(self, step: int) -> None:
        """A target that did not load is not offered again."""
        self.checkpointing.good_steps = [s for s in self.checkpointing.good_steps if s != step]


def _shards_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps only this rank's part of its state (torch's
    ZeroRedundancyOptimizer; looked up only where loaded, as its import warns)."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)


def _version() -> str:
    from trainguard import __version__

    return __version__


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
        token_accuracy=s.token_accuracy,
        precursors=s.precursors,
    )
