"""`Checkpointing`: durable checkpoints of a guarded run (save, verify, resume), and the earlier
run's checkpoints kept out of its way."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainguard.actions.checkpoint_files import DamagedCheckpoint, passed_over
from trainguard.actions.checkpoints import (
    CheckpointStore,
    load_sharded,
    prepare_restore,
    sharded_training_state,
    training_state,
)
from trainguard.distributed import RankContext
from trainguard.events import _utc_now

Warn = Callable[[str], None]  # a line about the checkpoints, recorded as a `checkpoint` event
CheckState = Callable[[dict[str, Any]], None]  # raises `DamagedCheckpoint` on a bad guard state


def set_aside(directory: Path, newest: str, warn: Warn, hint: str) -> bool:
    """Rename an earlier run's checkpoint folder to `<name>-earlier-<time>` beside it, and say so
    (or say why it could not move); whether it moved."""
    stamp = _utc_now().replace(":", "").replace("+", "")[:17]
    aside = directory.with_name(f"{directory.name}-earlier-{stamp}")
    try:
        os.rename(directory, aside)
    except OSError as exc:
        warn(
            f"{directory} holds an earlier run's checkpoints and cannot be moved "
            f"aside ({exc.strerror}); this run replaces them as it goes: {hint}"
        )
        return False
    warn(
        f"{directory} held checkpoints of an earlier run (newest {newest}): moved to "
        f"{aside.name}, so that this run, started at step 0, replaces none of them; {hint}"
    )
    return True


def _address(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return int(local.data_ptr())


def _frozen_addresses(model: nn.Module) -> set[int]:
    """Where the model's frozen parameters (those that require no grad) lie."""
    return {_address(p) for p in model.parameters() if not p.requires_grad}


class Checkpointing:
    """Writes the training state with the guard's own state to `run_dir/checkpoints` and finds
    the newest one that verifies and fits the live objects, on every rank alike."""

    def __init__(
        self,
        store: CheckpointStore,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: Any,
        ranks: RankContext | None,
        warn: Warn,
    ) -> None:
        self.store = store
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.ranks = ranks
        self.warn = warn
        self.last_good: int | None = None  # the newest checkpoint taken in a healthy window
        self.good_steps: list[int] = []  # every checkpoint this run took in a healthy window
        self.continues_a_run = False  # resumed, or given a state: the checkpoints are its own
        self._defers: bool | None = None  # decided at the first step (the model placed by then)
        self.prepared = False  # the staging buffers' layout handed to the store once

    def save(
        self,
        step: int,
        known_good: bool,
        guard_state: dict[str, Any],
        data_state: dict[str, Any] | None,
        manifest: dict[str, Any],
    ) -> None:
        """Write a checkpoint of the state at the start of `step` (asynchronous by default: this
        blocks only while the tensors are staged)."""
        if not self.continues_a_run:
            self.continues_a_run = True
            self._set_aside_earlier()
        if known_good:
            self.last_good = step
            self.good_steps = [s for s in self.good_steps if s < step] + [step]
        if self.ranks is None:
            tensors, plain = training_state(self.model, self.optimizer, self.scheduler, self.scaler)
        else:
            tensors, plain = sharded_training_state(
                self.model, self.optimizer, self.scheduler, self.scaler, self.ranks.rank
            )
        self.store.note_frozen(_frozen_addresses(self.model))
        plain.update(
            {
                "guard": guard_state,
                "data": data_state,
                "protected": sorted(self.store.protected),
                "last_good_checkpoint": self.last_good,
            }
        )
        self.store.save(step, tensors, plain, manifest)
        self.report_errors()

    @property
    def defers(self) -> bool:
        """Whether a due checkpoint is deferred while the last is written: where the model lives
        on a device. On the host it waits instead (exact steps; the writer shares the training's
        cores)."""
        if self._defers is None:
            self._defers = any(p.device.type != "cpu" for p in self.model.parameters())
        return self._defers

    @defers.setter
    def defers(self, value: bool) -> None:
        self._defers = value

    @property
    def busy(self) -> bool:
        """Whether a checkpoint now would wait on this thread (where checkpoints are deferred):
        the previous one is still being written, or the staging buffers still allocated."""
        return self.defers and (self.store.writing or self.store.preparing)

    def prepare(self) -> None:
        """Once the optimizer has state (in a distributed run at the first step taken, on every
        rank alike): allocate the staging buffers in the background, where checkpoints defer."""
        if self.prepared or not self.defers or (self.ranks is None and not self.optimizer.state):
            return
        self.prepared = True
        if self.ranks is None:
            tensors, _ = training_state(self.model, self.optimizer, None, None)
        else:
            tensors, _ = sharded_training_state(
                self.model, self.optimizer, None, None, self.ranks.rank
            )
        self.store.prepare({**tensors, "trainguard": {"step": torch.zeros((), dtype=torch.int64)}})
        self.report_errors()

    def forget_staged(self) -> None:
        """After the guard wrote weights in a way no version counter may see (a rollback, a
        replica resync, a rescale): the next checkpoint copies and hashes every tensor."""
        self.store.forget_staged()

    def known_good_at_or_before(self, step: int) -> int | None:
        """The step of the newest complete checkpoint this run took in a healthy window at or
        before `step` (a rollback target where no snapshot fits in memory), or None."""
        for good in reversed(self.good_steps):
            if good > step:
                continue
            if (self.store.directory / f"step-{good}" / "manifest.json").is_file():
                return good
            if good == self.good_steps[-1] and self.store.writing:  # done before it is read
                return good
        return None

    def restore_step(self, step: int, check: CheckState) -> dict[str, Any]:
        """Load the checkpoint of `step` into the live objects (a rollback to it), once it
        verifies and `check` takes its guard state; its plain state. `DamagedCheckpoint` when it
        does not verify or fit, before anything live is touched."""
        path = self.store.directory / f"step-{step}"
        manifest = self.store.verify(path)
        if self.ranks is not None:
            plain = load_sharded(
                self.store, path, manifest, self.model, self.optimizer, self.scheduler,
                self.scaler, self.ranks.rank,
            )  # fmt: skip
            check(plain)
            return plain
        tensors, plain = self.store.load(path, manifest)
        apply = prepare_restore(
            path, tensors, plain, self.model, self.optimizer, self.scheduler, self.scaler
        )
        check(plain)
        apply()
        return plain

    def protect_last_good(self) -> None:
        """Keep the newest known-good checkpoint before an incident, whatever the retention."""
        if self.last_good is not None:
            self.store.protected.add(self.last_good)

    def report_errors(self) -> None:
        """Say what a background write that failed left behind (each failure once)."""
        errors, self.store.errors = self.store.errors, []
        for error in errors:
            self.warn(error)

    def wait(self) -> None:
        """Let a checkpoint still being written finish."""
        self.store.wait()
        self.report_errors()

    def _set_aside_earlier(self) -> None:
        """Before a new run's first checkpoint, move an earlier run's checkpoints in the same
        run_dir aside, so that none is replaced: a restart that forgot `Guard.resume` loses
        nothing."""
        directory = self.store.directory
        earlier = self.store.complete()
        if not earlier or (self.ranks is not None and not self.ranks.is_leader):
            return
        hint = "use tg.Guard.resume(...) to carry on from a run"
        if self.ranks is not None:  # other ranks write into the folder: it cannot move now
            self.warn(
                f"{directory} holds checkpoints of an earlier run (newest {earlier[0].name}); "
                f"this run started at step 0 replaces them as it reaches their steps: {hint}"
            )
            return
        set_aside(directory, earlier[0].name, self.warn, hint)

    def restore_newest(
        self, check: CheckState
    ) -> tuple[dict[str, Any], Path, dict[str, Any]] | None:
        """Load the newest checkpoint that verifies and fits into the live objects; its manifest,
        folder and plain state, or None (said) when none is usable. `check` vets the guard state
        before anything live is touched."""
        self.continues_a_run = True
        if self.ranks is not None:
            found_dist = self._newest_for_all_ranks()
            if found_dist is None:
                return None
            manifest, path = found_dist
            plain = load_sharded(
                self.store,
                path,
                manifest,
                self.model,
                self.optimizer,
                self.scheduler,
                self.scaler,
                self.ranks.rank,
            )
            check(plain)
        else:

            def fits(
                path: Path, tensors: dict[str, torch.Tensor], plain: dict[str, Any]
            ) -> Callable[[], None]:  # one that does not fit the run raises: all older alike
                apply = prepare_restore(
                    path, tensors, plain, self.model, self.optimizer, self.scheduler, self.scaler
                )
                check(plain)
                return apply

            found = self.store.load_newest(self.warn, fits)
            if found is None:
                self.warn(f"no usable checkpoint in {self.store.directory}: starting at step 0")
                return None
            manifest, plain, apply = found
            path = Path(manifest["path"])
            apply()
        self.store.protected = set(plain.get("protected", []))
        self.last_good = plain.get("last_good_checkpoint")
        return manifest, path, plain

    def _newest_for_all_ranks(self) -> tuple[dict[str, Any], Path] | None:
        """Rank 0 picks the newest checkpoint that verifies; every rank gets its choice."""
        ranks = self.ranks
        if ranks is None:
            return None
        choice: list[Any] = [None]
        if ranks.is_leader:
            for path in self.store.complete():
                try:
                    manifest = self.store.verify(path)
                except DamagedCheckpoint as exc:
                    self.warn(passed_over(path, exc))
                    continue
                manifest["path"] = str(path)
                choice = [manifest]
                break
        torch.distributed.broadcast_object_list(choice, src=0, group=ranks.group)
        if choice[0] is None:
            self.warn(f"no usable checkpoint in {self.store.directory}: starting at step 0")
            return None
        manifest = dict(choice[0])
        return manifest, Path(manifest["path"])
