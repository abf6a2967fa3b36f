"""A stand-in for a device in CPU tests: count what would block the host on a GPU.

- `count_host_reads()`: a `TorchDispatchMode` that counts every op that brings tensor values to
  the host (`item`/`float`/`int`/`bool` -> `aten._local_scalar_dense`, `nonzero`, `equal`,
  `is_nonzero`, `masked_select`, `unique`, indexing by a bool mask), plus `Tensor.tolist` and
  `Tensor.numpy`, which do not dispatch on torch 2.13 and are patched for the block. Reads of
  tensors whose storage was marked with `mark_host` (a pinned slot a lagged reader fills) are
  not counted.
- `forbid_syncs()`: `torch.cuda.synchronize`, `torch.cuda.Stream.synchronize` (so also
  `torch.cuda.current_stream().synchronize()`) and `torch.accelerator.synchronize` raise (or,
  with `raise_on_sync=False`, are counted) inside the block; event waits stay allowed.
- `count_uploads()`: counts `torch.tensor(...)` / `torch.as_tensor(...)` calls given a `device`
  (on a GPU: a copy from pageable memory, which torch finishes with a sync), or raises.

On a CPU every op is synchronous; these count the places that would block on a GPU.
"""

from __future__ import annotations

import sys
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# the ops that materialise values on the host, by the name they are counted under
_READ_OPS: dict[Any, str] = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.equal.default: "equal",
    aten.is_nonzero.default: "is_nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.unique_dim.default: "unique",
}

_HOST: dict[int, Any] = {}  # storage address -> the finalizer of the tensor marked there


def _address(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Mark `tensor`'s storage as host memory (a pinned slot): reads of it, or of any view of
    it, are not counted. The mark lasts while `tensor` lives; returns `tensor`."""
    address = _address(tensor)
    old = _HOST.pop(address, None)
    if old is not None:
        old.detach()
    _HOST[address] = weakref.finalize(tensor, _HOST.pop, address, None)
    return tensor


def unmark_host(tensor: torch.Tensor) -> None:
    """Count reads of `tensor`'s storage again."""
    finalizer = _HOST.pop(_address(tensor), None)
    if finalizer is not None:
        finalizer.detach()


def is_host(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lies in storage marked with `mark_host`."""
    return _address(tensor) in _HOST


def mark_optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Mark the optimizer's CPU step counts as host memory (torch keeps them on the host unless
    the optimizer is fused or capturable, so reading them costs no sync on a GPU); how many.
    Call it after the first step, once the state exists."""
    marked = 0
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device.type == "cpu":
            mark_host(step)
            marked += 1
    return marked


@dataclass
class HostReads:
    """The reads counted in a `count_host_reads` block: `total`, `by_kind` ("item", "tolist",
    "numpy", "nonzero", ...), `skipped` (reads of marked host tensors) and, with
    `stacks=True`, where each read was made."""

    by_kind: Counter[str] = field(default_factory=Counter)
    skipped: int = 0
    stacks: list[str] | None = None

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def note(self, kind: str, tensor: object) -> None:
        if isinstance(tensor, torch.Tensor) and is_host(tensor):
            self.skipped += 1
            return
        self.by_kind[kind] += 1
        if self.stacks is not None:
            self.stacks.append(f"{kind}:\n" + "".join(traceback.format_stack(limit=12)[:-2]))

    def reset(self) -> None:
        self.by_kind.clear()
        self.skipped = 0
        if self.stacks is not None:
            self.stacks.clear()


class _ReadMode(TorchDispatchMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kind = _READ_OPS.get(func)
        if kind is None and func is aten.index.Tensor:  # a bool mask: a nonzero inside
            indices = args[1] if len(args) > 1 else []
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                kind = "bool_index"
        if kind is not None and args:
            self.reads.note(kind, args[0])
        return func(*args, **(kwargs or {}))


@contextmanager
def count_host_reads(stacks: bool = False) -> Iterator[HostReads]:
    """Count the host reads made inside the block (see the module's docstring); the counts are
    live, so `reads.reset()` between steps counts each step alone."""
    reads = HostReads(stacks=[] if stacks else None)
    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy

    def counted_tolist(self: torch.Tensor) -> Any:
        reads.note("tolist", self)
        return tolist(self)

    def counted_numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reads.note("numpy", self)
        return numpy(self, *args, **kwargs)

    torch.Tensor.tolist = counted_tolist  # type: ignore[method-assign]
    torch.Tensor.numpy = counted_numpy  # type: ignore[method-assign]
    try:
        with _ReadMode(reads):
            yield reads
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        torch.Tensor.numpy = numpy  # type: ignore[method-assign]


class SyncForbidden(AssertionError):
    """A device-wide or stream-wide synchronize inside a `forbid_syncs` block."""


@dataclass
class Syncs:
    """The synchronizes called in a `forbid_syncs(raise_on_sync=False)` block, by name."""

    by_name: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_name.values())


@contextmanager
def forbid_syncs(raise_on_sync: bool = True) -> Iterator[Syncs]:
    """Inside the block `torch.cuda.synchronize`, `torch.cuda.Stream.synchronize` and
    `torch.accelerator.synchronize` raise `SyncForbidden` (or are counted, and then run)."""
    syncs = Syncs()
    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return

        def stand_in(*args: Any, **kwargs: Any) -> Any:
            syncs.by_name[name] += 1
            if raise_on_sync:
                raise SyncForbidden(f"{name}() inside a forbid_syncs block")
            return original(*args, **kwargs)

        patched.append((owner, attr, original))
        setattr(owner, attr, stand_in)

    patch(torch.cuda, "synchronize", "torch.cuda.synchronize")
    patch(torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize")
    if hasattr(torch, "accelerator"):
        patch(torch.accelerator, "synchronize", "torch.accelerator.synchronize")
    try:
        yield syncs
    finally:
        for owner, attr, original in reversed(patched):
            setattr(owner, attr, original)


class UploadForbidden(AssertionError):
    """A `torch.tensor(..., device=...)` inside a `count_uploads(raise_on_upload=True)` block."""


@dataclass
class Uploads:
    """The `torch.tensor`/`torch.as_tensor` calls given a device in a `count_uploads` block."""

    calls: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.calls)


@contextmanager
def count_uploads(
    raise_on_upload: bool = False, only_from: str | None = "trainguard"
) -> Iterator[Uploads]:
    """Count (or forbid) `torch.tensor(...)` and `torch.as_tensor(...)` given a `device`: on a
    GPU each is a copy from pageable host memory, which torch finishes with a sync. A tensor
    built on the host and copied from pinned memory (`FigureUpload`) is not one. Only calls
    made from modules named `only_from...` count (torch's own `device="cpu"` host state, such as
    Adam's step counts, does not); None counts every caller."""
    uploads = Uploads()
    originals: dict[str, Callable[..., torch.Tensor]] = {
        "tensor": torch.tensor,
        "as_tensor": torch.as_tensor,
    }

    def wrap(name: str, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def stand_in(*args: Any, **kwargs: Any) -> torch.Tensor:
            caller = str(sys._getframe(1).f_globals.get("__name__", ""))
            if kwargs.get("device") is not None and (
                only_from is None or caller.split(".")[0] == only_from
            ):
                where = "".join(traceback.format_stack(limit=3)[:-1])
                uploads.calls.append(f"torch.{name}(device={kwargs['device']}) at\n{where}")
                if raise_on_upload:
                    raise UploadForbidden(uploads.calls[-1])
            return original(*args, **kwargs)

        return stand_in

    for name, original in originals.items():
        setattr(torch, name, wrap(name, original))
    try:
        yield uploads
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)
