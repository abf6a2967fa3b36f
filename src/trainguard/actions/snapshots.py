"""`SnapshotRing`: in-memory known-good states of a run, to roll back to without touching disk."""

from __future__ import annotations

import copy
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from trainguard._torch_private import foreach_copy_
from trainguard.actions.host_memory import Layout, pinning_available
from trainguard.actions.snapshot_pool import Slot, SnapshotPool, fill, flatten


class Stateful(Protocol):
    """What a snapshot keeps and puts back: a model, an optimizer, or an adapter for an engine
    that holds its own state (DeepSpeed's partitions)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass
class Snapshot:
    """The state at the start of `step`: model, optimizer, scheduler, scaler, RNGs, guard, data."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    rng: dict[str, Any]
    guard: dict[str, Any]
    data_position: Any = None
    nbytes: int = field(default=0)
    last_warning: int | None = None  # the last warning (or skip, rollback) before it was taken


def budget_interval(
    snapshot_seconds: float, step_seconds: float, budget: float, shortest: int, longest: int
) -> int:
    """The steps between snapshots that keep their cost (`snapshot_seconds` each) within
    `budget` of the training time (`step_seconds` a step), between `shortest` and `longest`."""
    if budget <= 0 or step_seconds <= 0 or not math.isfinite(snapshot_seconds):
        return longest
    wanted = math.ceil(snapshot_seconds / (budget * step_seconds))
    return max(shortest, min(longest, wanted))


def _cuda_in_use() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch and (when initialised) CUDA random states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if _cuda_in_use():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_to_plain(state: dict[str, Any]) -> dict[str, Any]:
    """A random state as JSON-ready lists (torch states as lists of bytes)."""
    version, internal, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    plain: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch": state["torch"].tolist(),
    }
    if "cuda" in state:
        plain["cuda"] = [t.tolist() for t in state["cuda"]]
    return plain


def rng_from_plain(plain: dict[str, Any]) -> dict[str, Any]:
    version, internal, gauss = plain["python"]
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    state: dict[str, Any] = {
        "python": (version, tuple(internal), gauss),
        "numpy": (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
        "torch": torch.tensor(plain["torch"], dtype=torch.uint8),
    }
    if "cuda" in plain:
        state["cuda"] = [torch.tensor(t, dtype=torch.uint8) for t in plain["cuda"]]
    return state


@dataclass(frozen=True)
class SnapshotPlan:
    """How snapshots fit in host memory: the bytes of one, this rank's budget, how many of the
    wanted ones fit, and whether they are pinned."""

    nbytes: int
    budget: int
    wanted: int
    slots: int
    pinned: bool


class SnapshotRing:
    """The last snapshots, newest last, each in a host buffer of a `SnapshotPool` sized by a
    memory budget: `plan` once the state's layout is known, then `take` and `restore`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.snapshots: deque[Snapshot] = deque()
        self.pool: SnapshotPool | None = None
        self.plan_made: SnapshotPlan | None = None
        self._slot_of: dict[int, Slot] = {}  # id(snapshot) -> the slot holding it

    @staticmethod
    def _state(model: Stateful, optimizer: Stateful) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
        tensors: list[tuple[str, torch.Tensor]] = []
        skeleton = (
            flatten(model.state_dict(), "model", tensors),
            flatten(optimizer.state_dict(), "optimizer", tensors),
        )
        return skeleton, tensors

    def plan(self, model: Stateful, optimizer: Stateful, budget: int | None) -> SnapshotPlan:
        """Size the pool to the state as it is now (after the first update, when the optimizer
        has its state) and `budget` bytes (None: no limit), and start allocating it."""
        _, tensors = self._state(model, optimizer)
        layout = Layout.of(tensors)
        pinned = _wants_pinning(tensors)
        fit = self.size if budget is None else budget // max(layout.nbytes, 1)
        slots = max(0, min(self.size, fit))
        self.pool = SnapshotPool(slots, layout.nbytes, pinned)
        self.plan_made = SnapshotPlan(layout.nbytes, budget or 0, self.size, slots, pinned)
        return self.plan_made

    @property
    def slots(self) -> int:
        """Snapshots the ring can hold (the wanted number until it is planned)."""
        return self.size if self.pool is None else len(self.pool.slots)

    @property
    def ready(self) -> bool:
        """Whether a snapshot can be taken now (its host memory is allocated)."""
        return self.pool is None or self.pool.ready

    def take(
        self,
        step: int,
        model: Stateful,
        optimizer: Stateful,
        scheduler: Any,
        scaler: Any,
        guard_state: dict[str, Any],
        data_position: Any,
        last_warning: int | None = None,
    ) -> Snapshot:
        """Copy the state at the start of `step` into the oldest snapshot's slot (a free one
        while the ring fills): the ring never holds more than its slots."""
        if self.pool is None:
            self.plan(model, optimizer, None)
        pool = self.pool
        assert pool is not None and pool.slots, "take() on a ring with no slot"
        skeleton, tensors = self._state(model, optimizer)
        used = {id(s) for s in self._slot_of.values()}
        free = [s for s in pool.slots if id(s) not in used]
        slot = free[0] if free else self._slot_of[id(self.snapshots[0])]
        views = pool.carve(slot, Layout.of(tensors))  # a MemoryError keeps the oldest
        if not free:
            self._slot_of.pop(id(self.snapshots.popleft()))
        sources = [t for _, t in tensors]
        pool.fill(slot, sources, _written_by_forward(model, tensors))
        host_model, host_optimizer = fill(skeleton, views)
        snapshot = Snapshot(
            step=step,
            model=host_model,
            optimizer=host_optimizer,
            scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
            scaler=copy.deepcopy(scaler.state_dict()) if scaler is not None else None,
            rng=rng_state(),
            guard=guard_state,  # fresh plain data (state_dicts), kept as given
            data_position=copy.deepcopy(data_position),
            last_warning=last_warning,
            nbytes=slot.layout.nbytes if slot.layout is not None else 0,
        )
        self.snapshots.append(snapshot)
        self._slot_of[id(snapshot)] = slot
        return snapshot

    def before_update(self) -> None:
        """Before the optimizer writes the state: the training stream waits for the copies."""
        if self.pool is not None and self.pool.pinned:
            self.pool.before_update()

    def target_for(self, incident: int, margin: int, strict: bool = False) -> Snapshot | None:
        """The rollback target for an incident whose first step is `incident`: the newest
        snapshot at least `margin` steps before it, else (unless `strict`) the newest at or
        before that step (the state before its first update); None when every snapshot is
        younger, so that a rollback never lands inside the incident. A snapshot taken after an
        earlier warning serves: that warning was judged by its own follow-up."""
        for limit in (incident - margin,) if strict else (incident - margin, incident):
            candidates = [s for s in self.snapshots if s.step <= limit]
            if candidates:
                return candidates[-1]
        return None

    def newest_at_or_before(self, step: int) -> Snapshot | None:
        """The newest snapshot taken at or before `step`, or the oldest one when none is."""
        candidates = [s for s in self.snapshots if s.step <= step]
        if candidates:
            return candidates[-1]
        return self.snapshots[0] if self.snapshots else None

    def drop_after(self, step: int) -> None:
        """Forget snapshots newer than `step` (they belong to a trajectory that was undone);
        their slots are free for the next ones."""
        kept = [s for s in self.snapshots if s.step <= step]
        for s in self.snapshots:
            if s.step > step:
                self._slot_of.pop(id(s), None)
        self.snapshots.clear()
        self.snapshots.extend(kept)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    def restore(
        self,
        snapshot: Snapshot,
        model: Stateful,
        optimizer: Stateful,
        scheduler: Any,
        scaler: Any,
    ) -> None:
        """Put model, optimizer, scheduler, scaler and RNGs back as they were at the snapshot:
        one copy from its host buffer into the live tensors, after the copy that filled it (a
        wait on the training stream, not the device), where the live state has the snapshot's
        layout; else through `load_state_dict`."""
        slot = self._slot_of.get(id(snapshot))
        self.before_update()  # no copy still reads what is about to be written
        if not _restore_in_place(snapshot, model, optimizer):
            if slot is not None:
                slot.wait_host()
            model.load_state_dict(snapshot.model)
            optimizer.load_state_dict(_copied(snapshot.optimizer))
        if scheduler is not None and snapshot.scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(snapshot.scheduler))
        if scaler is not None and snapshot.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(snapshot.scaler))
        set_rng_state(snapshot.rng)


def _wants_pinning(tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether copies of this state go to pinned memory: some of it lives on a GPU."""
    return pinning_available() and any(t.is_cuda for _, t in tensors)


def _copied(state: Any) -> Any:
    """A copy of a state dict whose tensors are fresh (a `load_state_dict` may keep the
    tensors it is given, which must not be the snapshot's buffers)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    skeleton = flatten(state, "", tensors)
    return fill(skeleton, [t.clone() for _, t in tensors])


def _written_by_forward(model: Stateful, tensors: list[tuple[str, torch.Tensor]]) -> set[int]:
    """Indices of the tensors that a forward pass may write (a module's buffers, such as
    BatchNorm's running statistics): every GPU tensor of the model's state that is no
    parameter; none where no tensor is on a GPU."""
    if not isinstance(model, nn.Module) or not any(t.is_cuda for _, t in tensors):
        return set()
    params = {p.data_ptr() for p in model.parameters()}
    return {
        i
        for i, (key, t) in enumerate(tensors)
        if key.startswith("model/") and t.data_ptr() not in params
    }


def _restore_in_place(snapshot: Snapshot, model: Stateful, optimizer: Stateful) -> bool:
    """Copy the snapshot into the live tensors of a module and a torch optimizer whose state has
    the snapshot's layout (the same entries, shapes and dtypes), and put back the optimizer's
    plain values; whether it could."""
    if not isinstance(model, nn.Module) or not isinstance(optimizer, torch.optim.Optimizer):
        return False
    saved: list[tuple[str, torch.Tensor]] = []
    flatten(snapshot.model, "model", saved)
    flatten(snapshot.optimizer, "optimizer", saved)
    live: list[tuple[str, torch.Tensor]] = []
    flatten(model.state_dict(), "model", live)
    flatten(optimizer.state_dict(), "optimizer", live)
    if [k for k, _ in live] != [k for k, _ in saved]:
        return False
    if not Layout.of(saved).fits([t for _, t in live]):
        return False
    with torch.no_grad():
        foreach_copy_([t for _, t in live], [t for _, t in saved], non_blocking=True)
    _restore_plain(snapshot.optimizer, optimizer)
    return True


def _restore_plain(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's values that are no tensor (hyperparameters of each group, plain entries
    of a parameter's state) as the snapshot has them."""
    for group, kept in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        for name, value in kept.items():
            if name != "params" and not isinstance(value, torch.Tensor):
                group[name] = copy.deepcopy(value)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    by_id = dict(zip(ids, params, strict=True))
    for pid, values in saved["state"].items():
        state = optimizer.state[by_id[pid]]
        for name, value in values.items():
            if not isinstance(value, torch.Tensor):
                state[name] = copy.deepcopy(value)
