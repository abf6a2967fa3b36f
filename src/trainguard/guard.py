"""`Guard`: one call per optimizer step that measures, exchanges, detects, decides, acts and
records, through named components that each own one concern."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainguard._torch_private import optimizer_takes_found_inf
from trainguard.actions import OptimizerActions
from trainguard.actions.checkpoint_files import DamagedCheckpoint
from trainguard.actions.checkpoints import CheckpointStore, check_checkpoint_folders, check_rng
from trainguard.actions.data import GuardedBatches, default_batch_ids
from trainguard.actions.preempt import Preemption
from trainguard.actions.preemptive import PreemptiveActions
from trainguard.actions.quarantine import Quarantine
from trainguard.actions.replicas import ReplicaResync
from trainguard.actions.snapshots import SnapshotRing, rng_state, set_rng_state
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
from trainguard.events import (
    Decision,
    Event,
    EventKind,
    Severity,
    TrainguardError,
    TrainingHalted,
)
from trainguard.moe.routing import RoutingStats
from trainguard.monitor import Monitor, checked_token_accuracy
from trainguard.policy import StepPolicy
from trainguard.recorder import action_counts, report
from trainguard.recovery import Recovery
from trainguard.signals import GradientStats, StepSignals
from trainguard.signals.gradients import Measurement
from trainguard.signals.lagged_reads import LaggedRead, LaggedReads
from trainguard.signals.precursors import PrecursorProbe
from trainguard.sinks import Sink

_D = TypeVar("_D")
UNREWOUND_CONFIRM_STEPS = 2  # far-up steps that confirm an explosion where data goes on


@dataclass
class _Training:
    """The per-engine half of a step (the plain loop's here; DeepSpeed's engine has its own):
    where the gradients are measured and the update made. A guard built without an optimizer
    only observes."""

    optimizer: torch.optim.Optimizer
    stats: GradientStats
    actions: OptimizerActions
    diagnosis: StepDiagnosis | None

    def measure(
        self, loss: torch.Tensor | float, scaler: torch.amp.GradScaler | None
    ) -> Measurement:
        """Unscale, then launch the step's figures on the device."""
        self.actions.unscale()
        return self.stats.measure(loss, self.optimizer, scaler)

    def clip(self, measurement: Measurement) -> None:
        self.actions.clip(self.stats.params, measurement.total_norm)

    def resolve(self, measurement: Measurement, values: list[float] | None = None) -> StepSignals:
        return self.stats.resolve(measurement, values)

    def group_report(self, norms: Any) -> Callable[[], dict[str, Any]] | None:
        """What an incident's events say of the layer groups (`norms`: an earlier step's)."""
        return lambda: self.stats.group_report(norms)

    def update(self, step: int, loss: float) -> None:
        """The update, now: with the update norms of a sampled step."""
        self.stats.before_optimizer_step(step)
        self.actions.step(loss)
        self.stats.after_optimizer_step(step)

    def skip(self) -> None:
        self.stats.discard_update()
        self.actions.skip()

    def after_step(
        self, decision: Decision, replay: Callable[[], torch.Tensor] | None
    ) -> list[Event]:
        """Diagnose what the decision left to explain."""
        return self.diagnosis.after_step(decision, replay) if self.diagnosis is not None else []


@dataclass
class _StepInputs:
    """What a step call passes besides its loss, kept until the step is judged."""

    batch_ids: Iterable[Any] | None
    sample_ids: Iterable[Any] | None
    replay: Callable[[], torch.Tensor] | None
    per_sample_losses: torch.Tensor | Callable[[], torch.Tensor] | None
    sample_text: Sequence[str] | None
    routing: RoutingStats | None


@dataclass
class _Measured:
    """A step measured on the device, before anything is read."""

    step: int
    measurement: Measurement
    checkpoint_due: bool  # this rank's clock says a checkpoint is due


@dataclass
class _StepStart:
    """Where the data and the RNGs stood when a step began (lagged path: taken before its
    forward, for a snapshot or checkpoint taken after it)."""

    data: dict[str, Any] | None
    rng: dict[str, Any]


@dataclass
class _Launched:
    """A step whose update the device gate made or skipped, and that the host judges at the
    next call."""

    measured: _Measured
    inputs: _StepInputs
    read: LaggedRead
    norms: Any  # its per-parameter grad norms on the device, for a group report
    replay_rng: dict[str, Any] | None  # the RNGs its forward began with, for a NaN trace
    start: _StepStart | None = None  # the next step's start, where a snapshot may fall due


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
    # the lagged path's host copies (None: the synchronous path), and the step it launched
    _lagged: LaggedReads | None = None
    _launched: _Launched | None = None

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
            linter = self._training.diagnosis
            assert linter is not None
            self._publish(linter.lint(model, linted, scaler))
            self.findings = linter.findings
        self._choose_hot_path()

    def _choose_hot_path(self) -> None:
        """The lagged path where `hot_path` asks for it and the run allows it (a fused optimizer
        that skips itself on the device, no GradScaler, one process, a bound for every
        `skip_on` kind); said once on a GPU where `auto` keeps the synchronous path."""
        wanted = self.config.hot_path
        if self._training is None or wanted == "sync":
            return
        optimizer, device = self._training.optimizer, self._training.stats.device
        why: list[str] = []
        if not optimizer_takes_found_inf(optimizer):
            why.append(
                f"{type(optimizer).__name__} does not skip itself on the device (a fused Adam, "
                "AdamW, SGD or Adagrad does: pass fused=True)"
            )
        if self.scaler is not None and self.scaler.is_enabled():
            why.append("a GradScaler skips overflow steps itself (bf16 autocast needs none)")
        if self.ranks is not None:
            why.append("a distributed run judges its ranks' exchange before the update")
        blockers = self.policy.gate_blockers(self.detectors.detectors)
        if blockers:
            why.append(f"policy.skip_on names {', '.join(blockers)}, which no gate bound covers")
        if wanted == "lagged" and why:
            raise TrainguardError(
                f"hot_path 'lagged' cannot be used here: {'; '.join(why)}; set hot_path to "
                "'auto' or 'sync'"
            )
        if wanted == "auto" and device.type != "cuda":
            return  # off a GPU a read costs no device idle time: the synchronous path
        if why:
            self._publish(
                [
                    Event(
                        step=self.global_step,
                        kind=EventKind.LINT,
                        severity="info",
                        message="hot_path: synchronous (one blocking read a step) because "
                        + "; ".join(why),
                        metrics={"hot_path": "sync"},
                    )
                ]
            )
            return
        self._lagged = LaggedReads(device)

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
        loss. On the lagged path (`hot_path`) the update is launched behind the device gate and
        this returns the decision of the step before, which the host judges now.

        `replay`, a closure that recomputes this step's loss, lets the guard trace where NaN/Inf
        first appeared; `per_sample_losses` (one per sample, left on the device and read only
        on a spike; or a closure computing them, called only on a spike) and `sample_text` let
        it name the samples behind a loss spike; `routing` (`trainguard.moe.routing_stats`)
        feeds the routing-collapse detector; `token_accuracy` (a share of tokens, a tensor or a
        float) replaces the one the precursor probe measures on its sampled steps."""
        parts = self._trainer("guard.step")
        lagged = self._lagged is not None
        inputs = _StepInputs(
            _kept(batch_ids, lagged),
            _kept(sample_ids, lagged),
            replay,
            per_sample_losses,
            sample_text,
            routing,
        )
        self.recovery.remember_position(self.global_step)
        return self._step_with(parts, loss, inputs, token_accuracy)

    def _step_with(
        self,
        parts: _Training,
        loss: torch.Tensor | float,
        inputs: _StepInputs,
        token_accuracy: torch.Tensor | float | None,
    ) -> Decision:
        """The step every engine shares: measure, then judge and act now (synchronous path),
        or launch behind the device gate and judge the step before (lagged path)."""
        token_accuracy = checked_token_accuracy(token_accuracy)
        measured = self._measure_step(parts, self.global_step, loss, token_accuracy)
        if self._lagged is None:
            return self._judge(parts, measured, parts.resolve(measured.measurement), inputs)
        return self._step_lagged(parts, measured, inputs)

    def _measure_step(
        self,
        parts: _Training,
        step: int,
        loss: torch.Tensor | float,
        token_accuracy: torch.Tensor | float | None,
    ) -> _Measured:
        """Measure (on the device), exchange (one collective) and clip: nothing read yet."""
        measurement = parts.measure(loss, self.scaler)
        self._take_precursors(step, measurement, token_accuracy)
        batches = self.recovery.batches
        checkpoint_due = self._checkpoint_due_by_time()
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
        parts.clip(measurement)
        return _Measured(step, measurement, checkpoint_due)

    def _judge(
        self,
        parts: _Training,
        measured: _Measured,
        signals: StepSignals,
        inputs: _StepInputs,
        launched: _Launched | None = None,
    ) -> Decision:
        """Detect, decide and act on a measured step: the update now (synchronous path), or
        what follows the update the device gate already made or skipped (`launched`)."""
        step, batch_ids, sample_ids = measured.step, inputs.batch_ids, inputs.sample_ids
        point = _point_from_signals(step, signals)
        self._check_replicas(point)
        if inputs.routing is not None:
            point.routing = inputs.routing.to_point()
        point.weights_rewritten, self._weights_rewritten = self._weights_rewritten, False
        checkpoint_due, checkpoint_busy = measured.checkpoint_due, None  # None: this rank's own
        if self.exchange is not None:
            self.exchange.add_rank_figures(point, signals.extra)
            checkpoint_due = self.exchange.checkpoint_due  # any rank's clock: due on all
            checkpoint_busy = self.exchange.checkpoint_busy  # any rank's writer: all defer
        # detect and decide
        norms = launched.norms if launched is not None else None
        decision, events = self._decide(
            point, batch_ids, self.recovery.has_target, parts.group_report(norms)
        )
        if launched is not None:
            decision = self._as_gated(decision, bool(signals.gate_skipped))
        if (
            inputs.per_sample_losses is not None
            and parts.diagnosis is not None
            and any(e.kind == EventKind.LOSS_SPIKE for e in events)
        ):
            blamed, found = parts.diagnosis.blame(
                decision, inputs.per_sample_losses, sample_ids or batch_ids, inputs.sample_text
            )
            events += self._publish(found)
            if blamed:
                sample_ids = blamed
        # act
        events += self._publish(
            self.recovery.hold_data(decision, signals.loss, batch_ids, sample_ids)
        )
        self.global_step = step + 1
        if decision.action == "step":
            if launched is None:
                self.recovery.before_update()  # the device waits for a snapshot's copy
                parts.update(step, signals.loss)
            else:  # applied on the device: what follows an update
                parts.actions.after_update(signals.loss)
            events += self._publish(self.recovery.cut_lr(decision))
            if self.preemptive is not None:  # on a precursor warning, where the policy chose
                taken = self.preemptive.apply(decision)
                self._weights_rewritten = self.preemptive.rewrote_weights
                events += self._publish(taken)
            with self._at_step_start(launched):  # where the next step began, on the lagged path
                self._publish(self.recovery.maybe_snapshot(self.global_step))  # about the run
                events += self._maybe_checkpoint(checkpoint_due, checkpoint_busy)
        else:
            self.recovery.before_update()  # a resync or a restore writes what may be copied
            if launched is None:
                parts.skip()
            else:
                parts.stats.discard_gated_update(step)
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
        events += self._publish(self._after_step_diagnosis(parts, decision, inputs, launched))
        if launched is None:
            self._arm_probe()
        result = self._finish(point, decision, events, signals)
        if result.action == "halt":
            result = self._halt(result, raise_error=True)
        return result

    def _as_gated(self, decision: Decision, gated: bool) -> Decision:
        """The decision as the device gate carried it out. They differ only where the policy
        steps over a spike its bound skips (an oscillation's LR cut), or at a bound's last
        digit: a step the gate skipped is a skip, a skip it let through a step."""
        if decision.action == "step" and gated:
            why = "skipped on the device: the loss or grad norm was over the gate's bound"
            changed = dataclasses.replace(decision, action="skip", reason=why, preempt=[])
        elif decision.action == "skip" and not gated:
            why = f"{decision.reason}; taken: the update was made on the device before it"
            changed = dataclasses.replace(decision, action="step", reason=why, suspect=False)
        else:
            return decision
        self.action_counts[decision.action] -= 1
        self.action_counts[changed.action] += 1
        return changed

    def _after_step_diagnosis(
        self,
        parts: _Training,
        decision: Decision,
        inputs: _StepInputs,
        launched: _Launched | None,
    ) -> list[Event]:
        """The NaN trace and rank verdicts of a step; on the lagged path from the RNG its
        forward began with, keeping the gradients of the step measured since."""
        diagnosis = parts.diagnosis
        if launched is None or diagnosis is None:
            return parts.after_step(decision, inputs.replay)
        next_rng, diagnosis.replay_rng = diagnosis.replay_rng, launched.replay_rng
        grads = [p.grad for p in parts.stats.params]
        try:
            return diagnosis.after_step(decision, inputs.replay)
        finally:
            diagnosis.replay_rng = next_rng
            for param, grad in zip(parts.stats.params, grads, strict=True):
                param.grad = grad

    # -- the lagged path: the skip decided on the device, the judgement one call later --------
    def _step_lagged(self, parts: _Training, measured: _Measured, inputs: _StepInputs) -> Decision:
        """Judge the step launched by the last call (its figures long copied), then launch this
        one behind the device gate with the bounds the detectors give now: no blocking read."""
        assert self._lagged is not None
        judged = self._judge_launched(parts)
        if judged is not None and judged.action == "rollback":
            parts.optimizer.zero_grad(set_to_none=True)  # this step is undone with the others
            self._arm_probe()
            return judged
        step = measured.step
        skip = measured.measurement.gate_flag(self.policy.gate_bounds(self.detectors.detectors))
        parts.stats.before_optimizer_step(step)
        self.recovery.before_update()  # the device waits for a snapshot's copy, not the host
        parts.actions.gated_step(skip)
        parts.stats.after_optimizer_step(step)
        read = self._lagged.copy(measured.measurement.packed)
        diagnosis = parts.diagnosis
        launched = _Launched(
            measured,
            inputs,
            read,
            parts.stats.last_norms,
            diagnosis.replay_rng if diagnosis is not None else None,
        )
        if inputs.replay is not None and diagnosis is not None:
            diagnosis.replay_rng = rng_state()  # the next step's forward starts from here
        self.global_step = step + 1
        launched.start = self._step_start(launched)
        self._launched = launched
        self._arm_probe()
        if judged is not None:
            return dataclasses.replace(judged, pending_step=step)
        return Decision(
            step=step, action="step", reason="judged at the next call", pending_step=step
        )

    def _judge_launched(self, parts: _Training) -> Decision | None:
        """The decision on the step the last call launched (None when none is pending)."""
        launched, self._launched = self._launched, None
        if launched is None or self._lagged is None:
            return None
        values = self._lagged.read(launched.read)
        signals = parts.resolve(launched.measured.measurement, values)
        return self._judge(parts, launched.measured, signals, launched.inputs, launched)

    def _step_start(self, launched: _Launched) -> _StepStart | None:
        """Where the data and the RNGs stand before the next forward, where a snapshot or a
        checkpoint may fall due when `launched` is judged (taken after that forward)."""
        step = self.global_step
        every = self.config.recovery.checkpoint_every
        checkpoint = self._saves_checkpoints and (
            launched.measured.checkpoint_due
            or self._deferred_checkpoint is not None
            or bool(every and step % every == 0)
        )
        snapshot = self.recovery.config.enabled and self.recovery.snapshot_due(step)
        if not (checkpoint or snapshot):
            return None
        batches = self.recovery.batches
        return _StepStart(batches.state() if batches is not None else None, rng_state())

    @contextmanager
    def _at_step_start(self, launched: _Launched | None) -> Iterator[None]:
        """Within: the data position and RNGs as they stood when the step after `launched`
        began (what a snapshot or checkpoint of that step holds); as they are without one."""
        start = launched.start if launched is not None else None
        if start is None:
            yield
            return
        now = rng_state()
        set_rng_state(start.rng)
        batches = self.recovery.batches
        try:
            if batches is None:
                yield
            else:
                with batches.held_at(start.data):
                    yield
        finally:
            set_rng_state(now)

    def judge_pending(self) -> Decision | None:
        """Judge the step still pending on the lagged path now (a wait for its copy) and return
        its decision, raising `TrainingHalted` on a halt; None when none is pending (always on
        the synchronous path)."""
        if self._training is None or self._launched is None:
            return None
        return self._judge_launched(self._training)

    def flush(self) -> None:
        """Judge the step still pending on the lagged path (`judge_pending`), then return once
        the run files hold every line recorded so far."""
        self.judge_pending()
        super().flush()

    def evaluate(self, step: int, values: Mapping[str, Any]) -> list[Event]:
        self.judge_pending()  # the steps up to the evaluation judged first
        return super().evaluate(step, values)

    evaluate.__doc__ = Monitor.evaluate.__doc__

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
        self.judge_pending()  # a step still pending on the lagged path is judged first
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
            "diagnosis": (
                self._training.diagnosis.state_dict()
                if self._training is not None and self._training.diagnosis is not None
                else None
            ),
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
        diagnosis = self._training.diagnosis if self._training is not None else None
        if diagnosis is not None and state.get("diagnosis") is not None:
            diagnosis.load_state_dict(state["diagnosis"])
        saved = state.get("user_actions", {})
        for action in self.user_actions:
            if action.name in saved:
                action.load_state_dict(saved[action.name])
        if self.preemption is not None and state.get("preemption") is not None:
            self.preemption.load_state_dict(state["preemption"])
        self._arm_probe()  # the sampled steps count from the restored step

    def _before_close(self) -> None:
        with suppress(TrainingHalted):  # recorded; close() does not raise
            self.judge_pending()  # the step still pending on the lagged path is judged, recorded
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


def _kept(ids: Iterable[Any] | None, lagged: bool) -> Iterable[Any] | None:
    """Ids as given; on the lagged path an iterator is read into a list, as they are used a
    call later."""
    return list(ids) if lagged and isinstance(ids, Iterator) else ids


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
