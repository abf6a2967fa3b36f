"""`DeepSpeedGuard`: the guard for a `deepspeed.initialize` engine under ZeRO stages 1, 2 and 3,
in fp32, bf16 or fp16; `guard.step(loss)` takes the place of `engine.step()`.

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    guard = DeepSpeedGuard(engine, run_dir="runs/a")
    for batch in guard.batches(loader):
        loss = engine(batch)
        engine.backward(loss)
        guard.step(loss)  # measure, decide, then step, skip, roll back or halt
    guard.close()

Each step at the gradient-accumulation boundary the guard measures this rank's reduced gradient
partition (one fused norm a partition tensor, on the device), shares its figures in the guard's
one per-step exchange (so every rank sums the same squared norms and takes the same worst
non-finite count, and decides alike), then lets the engine step, or runs the engine's step with
the basic optimizer held (a skip: DeepSpeed releases the gradients and counts the step, nothing
is updated), or restores an in-memory snapshot of every rank's own partition (a rollback).

Under ZeRO-1 and 2 every data-parallel rank holds the whole module, all-gathered from the ranks'
partitions at each step: every `replicas.every` steps, before the engine steps, the guard checks
that those copies (the weights this step's forward and backward used) agree, and where some
rank's copy left the majority's it skips the step and gathers the weights again from the
partitions. Under ZeRO-3 nothing is replicated, and nothing is checked.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard._torch_private import foreach_norm
from trainguard.actions.checkpoint_files import (
    DIGEST_SCHEME,
    DamagedCheckpoint,
    file_digest,
    passed_over,
    read_json,
)
from trainguard.actions.optimizer_step import OptimizerActions
from trainguard.actions.preemptive import PreemptiveActions
from trainguard.actions.replicas import ReplicaResync
from trainguard.actions.snapshots import rng_from_plain, rng_state, rng_to_plain, set_rng_state
from trainguard.actions.user_actions import build_actions
from trainguard.checkpointing import set_aside
from trainguard.config import ConfigInput, GuardConfig
from trainguard.distributed.replicas import ReplicaFingerprint
from trainguard.events import Decision, Event, EventKind, TrainguardError, _utc_now
from trainguard.guard import Guard, _StepInputs, _Training
from trainguard.integrations import _deepspeed_private as private
from trainguard.moe.routing import RoutingStats
from trainguard.monitor import Monitor, checked_token_accuracy
from trainguard.recovery import Recovery
from trainguard.run_files import remove_tree
from trainguard.signals.gradients import FIRST_NONFINITE, Measurement, StepSignals
from trainguard.signals.host_reads import read_now
from trainguard.sinks import Sink

_HEAD = 5  # loss, grad norm, non-finite count, loss scale, local non-finite count
TAG_PREFIX = "step-"  # a checkpoint's DeepSpeed tag: step-<the step it resumes at>
LATEST = "latest"  # DeepSpeed's file naming the newest tag; written here once every rank is done
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a file name of a tag's folder
_HEX64 = re.compile(r"[0-9a-f]{64}")


def check_engine(engine: Any) -> None:
    """Raise a one-line `TrainguardError` for an engine the guard cannot drive."""
    try:
        from deepspeed import DeepSpeedEngine
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except ImportError:
        raise TrainguardError(
            "DeepSpeedGuard needs DeepSpeed: pip install 'trainguard[deepspeed]'"
        ) from None
    if not isinstance(engine, DeepSpeedEngine):
        raise TrainguardError(
            f"DeepSpeedGuard needs the engine deepspeed.initialize returns, got "
            f"{type(engine).__name__}; for a plain model use tg.Guard(model, optimizer)"
        )
    if isinstance(engine, PipelineEngine):
        raise TrainguardError("DeepSpeedGuard does not support pipeline parallelism (train_batch)")
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2, 3):
        raise TrainguardError(
            f"DeepSpeedGuard needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is {stage}); "
            "without ZeRO, wrap the model in DDP and use tg.Guard(model, optimizer)"
        )
    if not isinstance(engine.basic_optimizer, torch.optim.Optimizer):
        raise TrainguardError(
            "DeepSpeedGuard needs an optimizer: pass one to deepspeed.initialize or name one "
            "in the DeepSpeed config"
        )
    if private.offloads_optimizer(engine.optimizer):
        raise TrainguardError(
            "DeepSpeedGuard does not support ZeRO-Offload (offload_optimizer): turn it off"
        )
    managed = getattr(engine, "managed_gradient_accumulation", None)  # DeepSpeed 0.19 on
    if managed is not None and not managed():
        raise TrainguardError(
            "DeepSpeedGuard needs managed gradient accumulation "
            "(managed_gradient_accumulation: true, DeepSpeed's default)"
        )


class ZeroGradients:
    """Measures this rank's gradient partition: the squared norm of each partition tensor and
    its non-finite ones, fused on the device, unscaled by the fp16 loss scale."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer
        self.device = torch.device(engine.device)
        self.fp16 = bool(engine.fp16_enabled())
        self._names = {id(p): n for n, p in engine.module.named_parameters()}

    @torch.no_grad()
    def measure(self, loss: torch.Tensor) -> Measurement:
        """Launch the step's figures on the device; nothing crosses to the host yet."""
        grads = private.gradient_partitions(self.optimizer)
        if grads:
            norms = torch.stack(foreach_norm(grads, torch.float32)).to(self.device)
        else:  # this rank holds no gradient (fewer elements than ranks)
            norms = torch.zeros(0, device=self.device)
        scale = float(self.optimizer.loss_scale) if self.fp16 else 1.0
        if scale != 1.0:
            norms = norms / scale
        sq = norms.square()
        nonfinite = (~torch.isfinite(norms)).to(torch.float32)
        n_first = min(FIRST_NONFINITE, nonfinite.numel())
        first = torch.sort(nonfinite, descending=True, stable=True).indices[:n_first]
        zero = torch.zeros((), device=self.device)
        head = [
            loss.detach().to(self.device, torch.float32).reshape(()),
            sq.sum().sqrt(),
            nonfinite.sum(),
            torch.full((), scale, device=self.device) if self.fp16 else zero,
            nonfinite.sum(),  # stays this rank's own after `combine`: names only its own
        ]
        lrs: list[Any] = [g["lr"] for g in self.engine.basic_optimizer.param_groups]
        shard_sq = sq.sum()
        return Measurement(
            total_norm=shard_sq.sqrt(),
            head=torch.stack(head),
            first=first.to(torch.float32),
            group_norms=shard_sq.sqrt().reshape(1),
            tail=[],
            present=None,
            n_first=n_first,
            lrs=lrs,
            has_scaler=self.fp16,
            pending_step=None,
            rep_sq=torch.zeros((), device=self.device),  # ZeRO partitions every gradient
            shard_sq=shard_sq,
            group_rep_sq=torch.zeros(1, device=self.device),
            group_shard_sq=shard_sq.reshape(1),
        )

    def resolve(self, m: Measurement) -> StepSignals:
        """Bring the figures to the host: the step's one device-to-host transfer. Under fp16 a
        non-finite gradient on any rank is an overflow, which the engine's loss scaler skips."""
        values = read_now(m.packed)
        loss, total, count, scale, own = values[:_HEAD]
        first = [int(i) for i in values[_HEAD : _HEAD + m.n_first]]
        n_groups = 1
        pos = _HEAD + m.n_first + n_groups
        names: list[str] = []
        if own > 0:  # an incident step: name this rank's non-finite partitions
            every = private.partition_names(self.optimizer, self._names)
            names = [every[i] for i in first[: int(own)] if i < len(every)]
        signals = StepSignals(
            loss=loss,
            grad_norm=total,
            nonfinite_grads=int(count),
            nonfinite_params=names,
            group_grad_norms={},
            lrs=[float(lr) for lr in m.lrs],
            loss_scale=scale if m.has_scaler else None,
            overflow=m.has_scaler and (count > 0 or not math.isfinite(total)),
        )
        n_extra = m.extra.numel() if m.extra is not None else 0
        if n_extra:
            signals.extra = values[pos : pos + n_extra]
        m.resolve_signals(values, signals)
        return signals


class ZeroPartition:
    """This rank's part of the training state for snapshots: the ZeRO optimizer's partition
    (fp32 master weights, the basic optimizer's state, the loss scaler), put back the way
    `engine.load_checkpoint` does, with the low-precision weights refreshed from it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        optimizer = self.engine.optimizer
        if hasattr(optimizer, "checkpoint_event_prologue"):
            optimizer.checkpoint_event_prologue()
        state: dict[str, Any] = optimizer.state_dict()
        if hasattr(optimizer, "checkpoint_event_epilogue"):
            optimizer.checkpoint_event_epilogue()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        optimizer = self.engine.optimizer
        if hasattr(optimizer, "checkpoint_event_prologue"):
            optimizer.checkpoint_event_prologue()
        world = private.data_parallel_size(optimizer)
        optimizer.load_state_dict(
            [state_dict] * world, load_optimizer_states=True, load_from_fp32_weights=True
        )
        if self.engine.zero_optimization_stage() in (1, 2):
            private.regather_weights(optimizer)  # the bit16 weights from the restored partition
        if hasattr(optimizer, "checkpoint_event_epilogue"):
            optimizer.checkpoint_event_epilogue()


class EngineCounters:
    """The engine's step and sample counters, kept with a snapshot so that a rollback puts
    DeepSpeed's count back with the weights."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        engine = self.engine
        return {"global_steps": engine.global_steps, "global_samples": engine.global_samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.global_steps = int(state_dict["global_steps"])
        self.engine.global_samples = int(state_dict["global_samples"])


class EngineActions(OptimizerActions):
    """`OptimizerActions` whose update is `engine.step()`: the engine clips, unscales and steps;
    the guard steps the LR schedule (taken from the engine) and cuts the LR in the basic
    optimizer's param groups, which the ZeRO optimizer steps with."""

    def __init__(self, engine: Any, scheduler: Any) -> None:
        super().__init__(engine.basic_optimizer, scheduler, None, max_grad_norm=None)
        self.engine = engine

    def _apply_update(self) -> None:
        private.engine_step(self.engine)

    def skip(self) -> None:
        """Run the engine's step with the basic optimizer held: DeepSpeed releases the
        gradients, counts the step and updates its fp16 loss scale (lowered on an overflow);
        weights and optimizer state stay as they are."""
        with private.update_held(self.optimizer):
            private.engine_step(self.engine)


class ZeroRegather(ReplicaResync):
    """Repairs diverged replicas under ZeRO-1/2 the way DeepSpeed makes them: each rank copies
    its fp32 partition into the module's weights and the ranks all-gather them. Each partition
    is the only copy of its part (the fingerprint compares the gathered copies, not the
    partitions), so it is gathered again rather than broadcast from one replica."""

    def __init__(self, fingerprint: ReplicaFingerprint, engine: Any) -> None:
        super().__init__(fingerprint, engine.module)
        self.engine = engine

    @torch.no_grad()
    def apply(self, decision: Decision, dropped: list[int]) -> list[Event]:
        """Gather every rank's weights again from the partitions (a collective: every rank
        calls it); the event that says so. `dropped`: snapshots set aside (none here: they hold
        partitions, not the gathered copies)."""
        if decision.resync_from is None:
            return []
        private.regather_weights(self.engine.optimizer)
        ranks = ", ".join(str(r) for r in decision.resync_ranks)
        ranks = ("rank " if len(decision.resync_ranks) == 1 else "ranks ") + ranks
        event = Event(
            step=decision.step,
            kind=EventKind.REPLICA_RESYNC,
            severity="warning",
            message=(
                f"gathered the module's weights again from the ZeRO partitions on every rank, "
                f"which gives {ranks} the majority's copy back; the next step checks it, and "
                "this step's update was left out (its gradients came in part from a diverged "
                "replica)"
            ),
            metrics={
                "source": "zero_partitions",
                "ranks": list(decision.resync_ranks),
                "dropped_snapshots": dropped,
            },
            action=decision.action,
        )
        event.rank = decision.resync_ranks[0] if decision.resync_ranks else None
        return [event]


class EngineParts(_Training):
    """The engine's half of a step for the shared step (`Guard._step_with`): its ZeRO
    partition measured, its own clipping, its `engine.step()` made or skipped; no per-layer
    report or NaN trace (the engine owns the update, so it keeps the synchronous path)."""

    def __init__(self, engine: Any, gradients: ZeroGradients, actions: EngineActions) -> None:
        self.optimizer = engine.basic_optimizer
        self.gradients = gradients
        self.actions = actions
        self.diagnosis = None

    def measure(self, loss: torch.Tensor | float, scaler: Any) -> Measurement:
        assert isinstance(loss, torch.Tensor)
        return self.gradients.measure(loss)

    def clip(self, measurement: Measurement) -> None:
        """The engine clips in its own step."""

    def resolve(self, measurement: Measurement, values: list[float] | None = None) -> StepSignals:
        return self.gradients.resolve(measurement)

    def group_report(self, norms: Any) -> None:
        return None

    def update(self, step: int, loss: float) -> None:
        self.actions.step(loss)

    def skip(self) -> None:
        self.actions.skip()


class DeepSpeedGuard(Guard):
    """Watches every optimizer step of a DeepSpeed engine and steps, skips, rolls back or
    halts it, with the plain loop's detectors, policy, recovery and run files.

    `step(loss)` replaces `engine.step()` (call it after `engine.backward(loss)` for every
    micro-batch; it measures and decides at the accumulation boundary). Clipping is the
    engine's (`gradient_clipping` in the DeepSpeed config): the guard measures the norm before
    it. The LR schedule the engine was given is stepped by the guard from here on."""

    def __init__(
        self,
        engine: Any,
        config: ConfigInput = None,
        run_dir: str | Path | None = None,
        sinks: Sequence[Sink] = (),
    ) -> None:
        check_engine(engine)
        unsupported = private.unsupported_checkpoints(engine) if run_dir is not None else None
        if unsupported is not None:
            raise TrainguardError(
                f"DeepSpeedGuard cannot verify checkpoints written by {unsupported}: "
                "use DeepSpeed's default checkpoint engine, or no run_dir"
            )
        cfg = GuardConfig.of(config)
        cfg = cfg.model_copy(update={"max_grad_norm": None})  # the engine clips
        self.engine = engine
        self.model = engine.module
        self.optimizer = engine.basic_optimizer
        self.scheduler = engine.lr_scheduler
        self.scaler = None
        self.gradients = ZeroGradients(engine)
        Monitor.__init__(self, cfg, run_dir, sinks, device=self.gradients.device)
        engine.lr_scheduler = None  # stepped by the guard from here on, only on steps it takes
        self.exchange = self._step_exchange()
        self._local_norm = None
        self.replicas = None
        self._resync = None
        self._recheck = False
        if self.ranks is not None and _replicates_module(engine, self.ranks.world_size):
            self._watch_replicas(engine.module, None)  # the ZeRO optimizer partitions its state
            if self.replicas is not None:
                self._resync = ZeroRegather(self.replicas, engine)
        actions = EngineActions(engine, self.scheduler)
        self.recovery = Recovery(
            cfg, self.policy, self.detectors, self.quarantine, EngineCounters(engine),
            ZeroPartition(engine), self.scheduler, None, actions,
        )  # fmt: skip
        self._training = None
        self.user_actions = build_actions(cfg)
        self.checkpointing = None
        self._continues_a_run = False  # resumed, or saved once: the checkpoints are its own
        self._resume_data = None
        self.checkpoint_clock = time.monotonic  # seconds; tests replace it
        self._last_checkpoint_at = None
        self._size_confirmation()
        self.findings = []
        self._micro_losses: list[torch.Tensor] = []
        self._engine_parts = EngineParts(engine, self.gradients, actions)
        self.probe = None
        self._start_probe(engine.module, None, None)  # no Adam ratio: ZeRO flattens the state
        self.preemption = None  # the engine's master weights would undo a rescale
        self._weights_rewritten = False  # never: no rescale
        # preemptive LR cuts through the engine's actions; no rescale or z-loss (no preemption)
        self.preemptive = PreemptiveActions(actions, None, cfg.precursors.preempt.z_loss_weight)

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
        """After `engine.backward(loss)`: between accumulation boundaries this runs the
        engine's step (no update) and returns a plain `step` decision for the micro-batch; at
        the boundary it measures, decides and steps, skips, rolls back or halts (raising
        `TrainingHalted`) every rank alike. `loss` is this micro-batch's (unscaled) loss."""
        unsupported = {
            "replay": replay,
            "per_sample_losses": per_sample_losses,
            "sample_text": sample_text,
            "routing": routing,
        }
        given = [name for name, value in unsupported.items() if value is not None]
        if given:
            raise TrainguardError(f"DeepSpeedGuard.step does not take {', '.join(given)}")
        token_accuracy = checked_token_accuracy(token_accuracy)
        engine = self.engine
        if not self._micro_losses:  # the first micro-batch of this step
            self.recovery.remember_position(self.global_step)
        self._micro_losses.append(_loss_tensor(loss, self.gradients.device))
        if not engine.is_gradient_accumulation_boundary():
            private.engine_step(engine)  # accumulates: nothing is updated between boundaries
            return Decision(step=self.global_step, action="step", reason="accumulating")
        mean_loss = torch.stack(self._micro_losses).mean()
        self._micro_losses = []
        inputs = _StepInputs(batch_ids, sample_ids, None, None, None, None)
        return self._step_with(self._engine_parts, mean_loss, inputs, token_accuracy)

    # -- durable checkpoints: DeepSpeed's own ---------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path | None:
        """Where `engine.save_checkpoint` writes (`run_dir/checkpoints`), None without a run_dir."""
        return self.run_dir / "checkpoints" if self.run_dir is not None else None

    @property
    def _saves_checkpoints(self) -> bool:
        return self.checkpoint_dir is not None

    def _resync_replicas(self, decision: Decision) -> list[Event]:
        """Gather the weights again where the decision says some replica diverged (every rank);
        the snapshots stay: they hold the partitions, which the gathered copies came from."""
        if decision.resync_from is None or self._resync is None:
            return []
        self._recheck = True
        return self._publish(self._resync.apply(decision, []))

    def save_checkpoint(self) -> None:
        """Write a checkpoint of the state at the start of the next step, on every rank alike:
        DeepSpeed's own (`engine.save_checkpoint`: module, each rank's ZeRO partition), then each
        rank's guard state, data position and RNGs beside it; once every rank has written, rank 0
        writes the tag's manifest (each file's step-bound sha256 and size), then DeepSpeed's
        `latest`: a rank killed midway leaves the previous checkpoint the newest that verifies."""
        directory = self.checkpoint_dir
        if directory is None:
            raise TrainguardError(
                "checkpoints need a run_dir: build DeepSpeedGuard(engine, run_dir=...)"
            )
        step = self.global_step
        self._last_checkpoint_at = self.checkpoint_clock()  # the time interval counts from here
        rank = self.ranks.rank if self.ranks is not None else 0
        if not self._continues_a_run:  # a new run's first checkpoint: an earlier run's go aside
            self._continues_a_run = True
            if rank == 0:
                self._set_aside_earlier(directory)
            if self.ranks is not None:  # moved before any rank writes into the folder
                dist.barrier(group=self.ranks.group)
        tag = f"{TAG_PREFIX}{step}"
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        self.engine.save_checkpoint(
            str(directory), tag=tag, client_state={"lr_scheduler": scheduler}, save_latest=False
        )
        batches = self.recovery.batches
        own = {
            "trainguard_version": _version(),
            "step": step,
            "guard": self.state_dict(),
            "data": batches.state() if batches is not None else None,
            "rng": rng_to_plain(rng_state()),
        }
        _write_atomically(directory / tag / rank_file(rank), json.dumps(own))
        if self.ranks is not None:
            dist.barrier(group=self.ranks.group)
        if rank == 0:
            world = self.ranks.world_size if self.ranks is not None else 1
            _write_atomically(
                directory / tag / MANIFEST, json.dumps(tag_manifest(directory / tag, step, world))
            )
            _write_atomically(directory / LATEST, tag)
            self._drop_old_checkpoints(
                directory, keep=self.config.recovery.keep_checkpoints, current=tag
            )
        if self.ranks is not None:
            dist.barrier(group=self.ranks.group)

    def _set_aside_earlier(self, directory: Path) -> None:
        """Move an earlier run's checkpoints (any `step-*` folder or `latest`) to
        `checkpoints-earlier-<time>`, as `tg.Guard` does: retention would otherwise keep their
        higher steps and delete this run's own as it writes them."""
        if not directory.is_dir():
            return
        tags = _tag_folders(directory)
        if not tags and not (directory / LATEST).exists():
            return
        newest = tags[0].name if tags else LATEST
        set_aside(
            directory, newest, self._warn, "use DeepSpeedGuard.resume(...) to carry on from a run"
        )

    def _drop_old_checkpoints(self, directory: Path, keep: int, current: str) -> None:
        """Keep the `keep` highest steps and the checkpoint just written; each other one is
        renamed out of the `step-N` names before it is deleted."""
        for path in _tag_folders(directory)[keep:]:
            if path.name == current:
                continue
            doomed = path.with_name(f".{path.name}.deleted-{os.getpid()}")
            try:
                os.rename(path, doomed)
            except OSError:
                continue
            remove_tree(doomed, self._warn)
        for leftover in directory.glob(f".{TAG_PREFIX}*.deleted-*"):
            remove_tree(leftover, self._warn)

    @classmethod
    def resume(  # type: ignore[override]
        cls,
        run_dir: str | Path,
        engine: Any,
        config: ConfigInput = None,
        sinks: Sequence[Sink] = (),
    ) -> DeepSpeedGuard:
        """A guard restored from the newest checkpoint in `run_dir` that verifies (the tag
        `latest` names, else the newest `step-*`): DeepSpeed's `engine.load_checkpoint` through a
        weights-only load, then this rank's guard state, LR schedule, data position and RNGs;
        one that starts at step 0 where none verifies."""
        path = Path(run_dir)
        if config is None and (path / "config.json").is_file():
            config = GuardConfig.load(path / "config.json")
        guard = cls(engine, config=config, run_dir=path, sinks=sinks)
        try:
            guard._restore_newest()
        except BaseException:  # a checkpoint that does not fit: release the run folder
            guard.close()
            raise
        return guard

    def _restore_newest(self) -> None:
        directory = self.checkpoint_dir
        assert directory is not None
        tag = self._choose_checkpoint(directory)
        if tag is None:
            return
        self._continues_a_run = True  # its checkpoints are this run's own
        rank = self.ranks.rank if self.ranks is not None else 0
        own = json.loads((directory / tag / rank_file(rank)).read_text())  # verified JSON
        try:
            with private.weights_only_loads(self.engine):
                loaded, client = self.engine.load_checkpoint(
                    str(directory),
                    tag=tag,
                    load_optimizer_states=True,
                    load_lr_scheduler_states=False,
                )
        except pickle.UnpicklingError as exc:
            raise TrainguardError(
                f"cannot resume from {directory / tag}: a weights-only load refuses it "
                f"({_unpickling_reason(exc)})"
            ) from None
        if loaded is None:
            raise TrainguardError(f"DeepSpeed could not load {directory / tag}")
        if self.scheduler is not None and client.get("lr_scheduler") is not None:
            self.scheduler.load_state_dict(client["lr_scheduler"])
        self.load_state_dict(own["guard"])
        self._resume_data = own["data"]
        set_rng_state(rng_from_plain(own["rng"]))
        self._publish(
            [
                Event(
                    step=self.global_step,
                    kind=EventKind.RESUME,
                    severity="info",
                    message=f"resumed from the DeepSpeed checkpoint at step {own['step']} ({tag})",
                    metrics={"checkpoint": str(directory / tag), "step": own["step"]},
                    action="step",
                )
            ]
        )

    def _choose_checkpoint(self, directory: Path) -> str | None:
        """The tag every rank resumes from: rank 0 verifies the candidates (`latest`'s, then
        the `step-*` folders, newest first), warns of each it passes over, and broadcasts its
        choice; None (said) where none verifies."""
        choice: list[Any] = [None, None]  # the tag, or an error every rank raises
        if self.ranks is None or self.ranks.is_leader:
            try:
                choice[0] = self._newest_verified(directory)
            except TrainguardError as exc:
                choice[1] = str(exc)
        if self.ranks is not None:
            dist.broadcast_object_list(choice, src=0, group=self.ranks.group)
        if choice[1] is not None:
            raise TrainguardError(str(choice[1]))
        if choice[0] is None:
            if _tag_folders(directory) or (directory / LATEST).exists():
                self._warn(f"no usable checkpoint in {directory}: starting at step 0")
            else:
                self._warn(f"no checkpoint in {directory}: starting at step 0")
            return None
        return str(choice[0])

    def _newest_verified(self, directory: Path) -> str | None:
        """Rank 0: the first candidate tag whose manifest, files and guard states verify."""
        if not directory.is_dir() or directory.is_symlink():
            return None
        world = self.ranks.world_size if self.ranks is not None else 1
        candidates = [p.name for p in _tag_folders(directory)]
        named = self._latest_tag(directory)
        if named is not None:
            candidates = [named] + [t for t in candidates if t != named]
        for tag in candidates:
            try:
                verify_tag(directory / tag, world)
                for r in range(world):
                    own = read_json(directory / tag / rank_file(r), "JSON")
                    self._check_guard_state(check_rank_state(own, step_of_tag(tag), rank_file(r)))
            except DamagedCheckpoint as exc:
                self._warn(passed_over(directory / tag, exc))
                continue
            return tag
        return None

    def _latest_tag(self, directory: Path) -> str | None:
        """The tag `latest` names where it is a `step-<digits>` folder directly inside
        `directory`; anything else is warned of and the folders are scanned instead."""
        latest = directory / LATEST
        if not latest.exists() and not latest.is_symlink():
            return None
        try:
            if latest.is_symlink() or not latest.is_file():
                raise ValueError("it is not a plain file")
            with latest.open("rb") as f:
                text = f.read(256).decode("ascii").strip()
        except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            self._warn(
                f"{latest} is unreadable ({exc}); using the newest step-* folder that verifies"
            )
            return None
        folder = directory / text
        if (
            not _TAG.fullmatch(text)
            or folder.is_symlink()
            or not folder.is_dir()
            or folder.resolve().parent != directory.resolve()
        ):
            self._warn(
                f"{latest} names {text[:80]!r}, not a step-N checkpoint folder of {directory}; "
                "passed over, using the newest step-* folder that verifies"
            )
            return None
        return text


MANIFEST = "manifest.json"  # a tag's files, each with its step-bound sha256 and size
_TAG = re.compile(rf"{TAG_PREFIX}[0-9]{{1,18}}")


def rank_file(rank: int) -> str:
    """The plain JSON state a rank writes beside DeepSpeed's files."""
    return f"trainguard-rank{rank}.json"


def step_of_tag(tag: str) -> int:
    return int(tag[len(TAG_PREFIX) :])


def _tag_folders(directory: Path) -> list[Path]:
    """Every `step-<digits>` folder directly in `directory` (no symlink), newest first."""
    if not directory.is_dir():
        return []
    found = [
        p
        for p in directory.iterdir()
        if _TAG.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    ]
    return sorted(found, key=lambda p: step_of_tag(p.name), reverse=True)


def tag_manifest(folder: Path, step: int, world: int) -> dict[str, Any]:
    """The manifest of a tag's folder once every rank has written: every file's sha256, bound to
    the step and the file's name, and its size."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name == MANIFEST or path.is_symlink() or not path.is_file():
            continue  # a folder or link makes the tag fail verification: DeepSpeed writes none
        files[path.name] = {"sha256": file_digest(path, step), "bytes": path.stat().st_size}
    return {
        "step": step,
        "tag": folder.name,
        "world_size": world,
        "checksums": DIGEST_SCHEME,
        "trainguard_version": _version(),
        "time": _utc_now(),
        "files": files,
    }


def verify_tag(folder: Path, world: int) -> dict[str, Any]:
    """The manifest of a tag whose folder holds exactly the files it lists, each of the listed
    size and step-bound digest; `DamagedCheckpoint` saying what does not check out (a different
    world size is a `TrainguardError`: no older checkpoint fits either)."""
    step = step_of_tag(folder.name)
    if (folder / MANIFEST).is_symlink():
        raise DamagedCheckpoint(f"its {MANIFEST} is a link")
    manifest = read_json(folder / MANIFEST, "a JSON manifest")
    if not isinstance(manifest, dict):
        raise DamagedCheckpoint(f"its {MANIFEST} is not a JSON object")
    if (
        type(manifest.get("step")) is not int
        or manifest["step"] != step
        or manifest.get("tag") != folder.name
    ):
        raise DamagedCheckpoint(
            f"its {MANIFEST} is of {manifest.get('tag')!r}, not {folder.name} (moved or copied)"
        )
    if manifest.get("checksums") != DIGEST_SCHEME:
        raise DamagedCheckpoint(f"its {MANIFEST} has no step-bound checksums")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(name, str)
        and _FILE.fullmatch(name)
        and isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and _HEX64.fullmatch(entry["sha256"])
        and type(entry.get("bytes")) is int
        for name, entry in files.items()
    ):
        raise DamagedCheckpoint(f"its {MANIFEST} has no valid list of files, digests and sizes")
    if manifest.get("world_size") != world:
        raise TrainguardError(
            f"{folder} was written by {manifest.get('world_size')!r} ranks, this run has {world}: "
            "DeepSpeedGuard resumes on the same number of ranks"
        )
    present = {p.name: p for p in folder.iterdir() if p.name != MANIFEST}
    unlisted = sorted(set(present) - set(files))
    if unlisted:
        raise DamagedCheckpoint(f"it holds {unlisted[0]}, which its {MANIFEST} does not list")
    wanted = {rank_file(r) for r in range(world)}
    if not wanted <= set(files):
        raise DamagedCheckpoint(f"its {MANIFEST} does not list every rank's state")
    for name, entry in files.items():
        path = present.get(name)
        if path is None or path.is_symlink() or not path.is_file():
            raise DamagedCheckpoint(f"its {name} is missing")
        try:
            if path.stat().st_size != entry["bytes"]:
                raise DamagedCheckpoint(f"its {name} is not of its listed size")
            actual = file_digest(path, step)
        except OSError as exc:
            raise DamagedCheckpoint(f"its {name} cannot be read ({exc.strerror})") from None
        if actual != entry["sha256"]:
            raise DamagedCheckpoint(f"its {name} fails its checksum")
        if name.endswith(".pt"):  # read as a program, not run: the load itself is weights-only
            try:
                unsafe = private.unsafe_globals(str(path))
            except Exception as exc:  # a file torch.save did not write raises any of several
                raise DamagedCheckpoint(f"its {name} is not a torch.save file ({exc!r})") from None
            if unsafe:
                raise DamagedCheckpoint(
                    f"its {name} pickles {unsafe[0]}, which a DeepSpeed checkpoint never holds; "
                    "refusing to load it"
                )
    return manifest


def check_rank_state(own: Any, step: int, name: str) -> dict[str, Any]:
    """A rank's plain state as the guard wrote it: of this step, with its guard, data and RNG
    parts (its guard state in the shape `Guard._check_guard_state` takes)."""
    if not isinstance(own, dict) or own.get("step") != step or type(own.get("step")) is not int:
        raise DamagedCheckpoint(f"its {name} is not the guard state of step {step}")
    guard = own.get("guard")
    if not isinstance(guard, dict) or guard.get("global_step") != step:
        raise DamagedCheckpoint(f"its {name} holds no guard state of step {step}")
    if not isinstance(own.get("rng"), dict) or not isinstance(
        own.get("data", {}), (dict, type(None))
    ):
        raise DamagedCheckpoint(f"its {name} has a malformed random or data state")
    if "data" not in own:
        raise DamagedCheckpoint(f"its {name} has no data position")
    return {"guard": guard, "data": own["data"]}


def _replicates_module(engine: Any, world: int) -> bool:
    """Whether every rank holds the whole module, so that the replicas can be compared: ZeRO-1
    and 2 with every rank in the one data-parallel group (ZeRO-3 partitions the parameters)."""
    stage = engine.zero_optimization_stage()
    return stage in (1, 2) and private.data_parallel_size(engine.optimizer) == world


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a fresh temporary of an unpredictable name,
    fsynced, renamed); a link or FIFO at `path` is a `RunFileError`, never written through."""
    from trainguard.run_files import write_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text.encode())


def _unpickling_reason(exc: pickle.UnpicklingError) -> str:
    """The one line of torch's weights-only refusal that says what it refused."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    for line in lines:
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(". Please")[0].strip()
    return lines[0][:300]


def _version() -> str:
    from trainguard import __version__

    return __version__


def _loss_tensor(loss: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise TrainguardError(
                f"guard.step needs the scalar loss, got a tensor of shape {tuple(loss.shape)}"
            )
        return loss.detach().to(device, torch.float32).reshape(())
    return torch.full((), float(loss), device=device)  # filled there: no host copy
