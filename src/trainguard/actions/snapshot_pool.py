"""`SnapshotPool`: the host buffers snapshots are copied into, allocated once (pinned in the
background where the state lives on a GPU) and reused, and the side stream that fills them."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainguard._torch_private import foreach_copy_
from trainguard.actions import host_memory
from trainguard.actions.host_memory import Layout

_ATOMS = (int, float, bool, str, bytes, type(None))


@dataclass(frozen=True)
class Hole:
    """Where tensor `index` of a flattened state goes back in its structure."""

    index: int
    dtensor: DTensor | None = None  # the live DTensor whose local shard was taken


def flatten(obj: Any, key: str, tensors: list[tuple[str, torch.Tensor]]) -> Any:
    """`obj` with every tensor replaced by a `Hole` and appended to `tensors` (a DTensor's local
    shard), the rest deep-copied: the structure of a state dict, apart from its tensors."""
    if isinstance(obj, _ATOMS):
        return obj
    if isinstance(obj, DTensor):
        tensors.append((key, obj.to_local().detach()))
        return Hole(len(tensors) - 1, obj)
    if isinstance(obj, torch.Tensor):
        tensors.append((key, obj.detach()))
        return Hole(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: flatten(v, f"{key}/{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [flatten(v, f"{key}/{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(flatten(v, f"{key}/{i}", tensors) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def fill(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The structure `flatten` took apart, with `tensors` in its holes (DTensors rebuilt around
    theirs)."""
    if isinstance(skeleton, Hole):
        t = tensors[skeleton.index]
        d = skeleton.dtensor
        if d is None:
            return t
        return DTensor.from_local(
            t, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
        )
    if isinstance(skeleton, dict):
        return {k: fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [fill(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(fill(v, tensors) for v in skeleton)
    return skeleton


@dataclass
class Slot:
    """One snapshot's host buffer, and the copy that fills it: `copied` (on a GPU) is recorded
    on the copy stream once the copy is done; `sources` are held until the training stream has
    waited for it, so that no source is freed and reused under the copy."""

    index: int
    buffer: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    layout: Layout | None = None
    copied: Any = None  # torch.cuda.Event
    sources: list[torch.Tensor] | None = None

    def wait_host(self) -> None:
        """Block the host until the copy into this slot is done (a restore that reads it)."""
        if self.copied is not None:
            self.copied.synchronize()


class SnapshotPool:
    """`slots` host buffers of `nbytes` each. Pinned buffers are allocated on a background
    thread (the pool is `ready` once they are); CPU runs allocate at once. Copies from a GPU
    run on a side stream that waits for the training stream's work, and the training stream
    waits for them only before the next update (`before_update`)."""

    def __init__(self, slots: int, nbytes: int, pinned: bool) -> None:
        self.slots = [Slot(i) for i in range(slots)]
        self.nbytes = nbytes
        self.pinned = pinned
        self.error: BaseException | None = None  # what stopped the background allocation
        self._ready = threading.Event()
        self._stream: Any = torch.cuda.Stream() if pinned else None  # type: ignore[no-untyped-call]
        if pinned and slots:
            threading.Thread(target=self._allocate_all, name="trainguard-pin", daemon=True).start()
        else:
            self._allocate_all()

    def _allocate_all(self) -> None:
        try:
            for slot in self.slots:
                slot.buffer = host_memory.allocate(self.nbytes, self.pinned)
        except (MemoryError, RuntimeError) as exc:  # pinning refused: fewer slots, said
            self.error = exc
            self.slots = [s for s in self.slots if s.buffer is not None]
        finally:
            self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def held_bytes(self) -> int:
        """Host bytes the pool holds."""
        return sum(s.buffer.numel() for s in self.slots if s.buffer is not None)

    def carve(self, slot: Slot, layout: Layout) -> list[torch.Tensor]:
        """`slot`'s views for `layout`; a state grown past the buffer gets a new one (rare: an
        optimizer whose state appears late), so that the pool holds `slots` buffers at most."""
        if slot.layout == layout:
            return slot.views
        if slot.buffer is None or slot.buffer.numel() < layout.nbytes:
            # the old buffer is unregistered and freed when dropped (its finalizer runs when the
            # tensor object dies, whatever views remain): no copy may still be writing it
            slot.wait_host()
            slot.copied, slot.sources = None, None
            slot.views = []
            slot.buffer = None  # freed before the larger one is made
            slot.buffer = host_memory.allocate(layout.nbytes, self.pinned)
            self.nbytes = max(self.nbytes, layout.nbytes)
        slot.views = host_memory.carve(slot.buffer, layout)
        slot.layout = layout
        return slot.views

    def fill(self, slot: Slot, sources: list[torch.Tensor], early: set[int]) -> None:
        """Copy `sources` into `slot`'s views: GPU tensors on the side stream once the training
        stream's work so far is done, except those in `early` (buffers the next forward
        writes), copied on the training stream itself; CPU tensors at once."""
        views = slot.views
        host = [i for i, t in enumerate(sources) if not t.is_cuda]
        if host:
            foreach_copy_([views[i] for i in host], [sources[i] for i in host])
        device = [i for i, t in enumerate(sources) if t.is_cuda]
        if not device:
            slot.copied, slot.sources = None, None
            return
        now = [i for i in device if i in early]
        later = [i for i in device if i not in early]
        if now:
            foreach_copy_([views[i] for i in now], [sources[i] for i in now], non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            if later:
                foreach_copy_(
                    [views[i] for i in later], [sources[i] for i in later], non_blocking=True
                )
            slot.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            slot.copied.record(self._stream)
        slot.sources = sources

    def before_update(self) -> None:
        """Make the training stream wait for every copy still in flight (a GPU-side wait: the
        host goes on), before the optimizer writes what is being copied."""
        for slot in self.slots:
            if slot.sources is not None:
                torch.cuda.current_stream().wait_event(slot.copied)
                slot.sources = None
