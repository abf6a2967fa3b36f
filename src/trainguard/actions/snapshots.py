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


_ATOMS = (int, float, bool, str, bytes, type(None))


def _to_host(obj: Any, pinned: bool) -> Any:
    """A deep copy with every tensor on the CPU (pinned, copied without blocking, from a GPU)."""
    if isinstance(obj, _ATOMS):  # immutable: nothing to copy
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type == "cpu":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
        return out.copy_(t, non_blocking=pinned)
    if isinstance(obj, dict):
        return {k: _to_host(v, pinned) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_host(v, pinned) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_host(v, pinned) for v in obj)
    return copy.deepcopy(obj)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


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


class SnapshotRing:
    """The last `size` snapshots, newest last; copies live in (pinned) CPU memory."""

    def __init__(self, size: int) -> None:
        self.snapshots: deque[Snapshot] = deque(maxlen=size)

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
        pinned = torch.cuda.is_available()  # `_to_host` pins only the copies of GPU tensors
        snapshot = Snapshot(
            step=step,
            model=_to_host(model.state_dict(), pinned),
            optimizer=_to_host(optimizer.state_dict(), pinned),
            scheduler=_to_host(scheduler.state_dict(), False) if scheduler is not None else None,
            scaler=_to_host(scaler.state_dict(), False) if scaler is not None else None,
            rng=rng_state(),
            guard=guard_state,  # fresh plain data (state_dicts), kept as given
            data_position=copy.deepcopy(data_position),
            last_warning=last_warning,
        )
        snapshot.nbytes = _nbytes(snapshot.model) + _nbytes(snapshot.optimizer)
        self.snapshots.append(snapshot)
        return snapshot

    def target_for(self, incident: int, margin: int) -> Snapshot | None:
        """The rollback target for an incident whose first step is `incident`: the newest
        snapshot at least `margin` steps before it, else the newest at or before that step (the
        state before its first update); None when every snapshot is younger, so that a rollback
        never lands inside the incident. A snapshot taken after an earlier warning serves: that
        warning was judged by its own follow-up."""
        for limit in (incident - margin, incident):
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
        """Forget snapshots newer than `step` (they belong to a trajectory that was undone)."""
        kept = [s for s in self.snapshots if s.step <= step]
        self.snapshots.clear()
        self.snapshots.extend(kept)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    @staticmethod
    def restore(
        snapshot: Snapshot,
        model: Stateful,
        optimizer: Stateful,
        scheduler: Any,
        scaler: Any,
    ) -> None:
        """Put model, optimizer, scheduler, scaler and RNGs back as they were at the snapshot."""
        if _cuda_in_use():
            torch.cuda.synchronize()  # pinned copies may still be in flight
        model.load_state_dict(snapshot.model)
        optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))
        if scheduler is not None and snapshot.scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(snapshot.scheduler))
        if scaler is not None and snapshot.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(snapshot.scaler))
        set_rng_state(snapshot.rng)
