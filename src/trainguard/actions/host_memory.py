"""Host memory for copies of device state: one allocation per buffer, pinned once (registered
with CUDA at its exact size), carved into per-tensor views, and a budget per rank."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.config import parse_memory

PAGE = 4096  # bytes: pinned buffers are whole pages of their own
ALIGN = 64  # bytes: each view starts on a boundary every dtype and vector copy is happy with


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes lie in a host buffer."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The tensors a buffer holds, in order, and its size in bytes."""

    entries: tuple[Entry, ...]
    nbytes: int

    @classmethod
    def of(cls, items: Iterable[tuple[str, torch.Tensor]]) -> Layout:
        """The layout of `(key, tensor)` pairs, each aligned to `ALIGN` bytes."""
        entries: list[Entry] = []
        offset = 0
        for key, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            entries.append(Entry(key, tuple(tensor.shape), tensor.dtype, offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        return cls(tuple(entries), offset)

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether `tensors`, in order, have this layout's shapes and dtypes."""
        return len(tensors) == len(self.entries) and all(
            tuple(t.shape) == e.shape and t.dtype == e.dtype
            for t, e in zip(tensors, self.entries, strict=True)
        )


class _Counts:
    """How many host buffers were made and how many bytes they hold now (tests and events)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.allocations = 0
        self.pinned_allocations = 0
        self.live_bytes = 0

    def add(self, nbytes: int, pinned: bool) -> None:
        with self.lock:
            self.allocations += 1
            self.pinned_allocations += int(pinned)
            self.live_bytes += nbytes

    def drop(self, nbytes: int) -> None:
        with self.lock:
            self.live_bytes -= nbytes


COUNTS = _Counts()


def pinning_available() -> bool:
    """Whether host memory can be pinned (a CUDA device is present)."""
    return bool(torch.cuda.is_available())


def _unpin(address: int, nbytes: int) -> None:
    COUNTS.drop(nbytes)
    if address:
        torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]


def allocate(nbytes: int, pinned: bool) -> torch.Tensor:
    """A host buffer of `nbytes` (uint8), first touched, and pinned when asked: whole pages of
    its own, registered with CUDA at their size (no rounding to a power of two, no lock of the
    caching host allocator, no page shared with another registration), unregistered when the
    buffer is freed. This is the only place trainguard allocates host memory for copies of
    device state, so that tests can count it."""
    size = max(nbytes, 1)
    if pinned:  # page-aligned whole pages inside a larger allocation
        size = -(-size // PAGE) * PAGE
        raw = torch.zeros(size + PAGE, dtype=torch.uint8)  # zeros: the pages are touched here
        start = -raw.data_ptr() % PAGE
        buffer = raw[start : start + size]
    else:
        buffer = torch.zeros(size, dtype=torch.uint8)
    address = 0
    if pinned:
        address = buffer.data_ptr()
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        error = int(cudart.cudaHostRegister(address, size, 1))  # 1: portable
        if error != 0:
            raise MemoryError(
                f"pinning {size_text(size)} of host memory failed (CUDA error {error}): "
                "lower recovery.snapshot_memory"
            )
    COUNTS.add(size, pinned)
    weakref.finalize(buffer, _unpin, address, size)
    return buffer


def carve(buffer: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """One view of `buffer` per entry of `layout`, with the entry's shape and dtype."""
    views = []
    for e in layout.entries:
        raw = buffer[e.offset : e.offset + e.nbytes]
        views.append(raw.view(e.dtype).view(e.shape))
    return views


# -- the budget --------------------------------------------------------------------------------


def available_bytes() -> int:
    """The node's available memory (MemAvailable on Linux; else its physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def local_ranks() -> int:
    """Processes of this job on this node (torchrun's LOCAL_WORLD_SIZE; 1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class Budget:
    """This rank's host-memory budget for snapshots, and what it came from."""

    nbytes: int  # this rank's share
    asked: int  # what the setting asked for on the node
    available: int  # the node's available memory when it was read
    ranks: int  # local ranks sharing the node's budget
    share: float | None  # the share of available memory asked for, None for a size

    @property
    def capped(self) -> bool:
        """Whether a size asked for more than the node has available (it was lowered to that)."""
        return self.share is None and 0 < self.available < self.asked

    def describe(self) -> str:
        """Where the budget came from, in words: "25% of 22.5 GiB available", "40 GB set"."""
        if self.share is not None:
            where = f"{self.share:.0%} of {size_text(self.available)} available on the node"
        elif self.capped:
            where = (
                f"{size_text(self.asked)} set, more than the {size_text(self.available)} "
                "available on the node: lowered to that"
            )
        else:
            where = f"{size_text(self.asked)} set for the node"
        return where + (f", shared by {self.ranks} local ranks" if self.ranks > 1 else "")


def rank_budget(setting: str | int | float) -> Budget:
    """This rank's share of the node's budget for snapshot copies: a share of the available
    memory, or a size, never more than what is available, split between the local ranks."""
    amount, share = parse_memory(setting)
    available = available_bytes()
    asked = int(amount * available) if share else int(amount)
    node = min(asked, available) if available > 0 else asked
    ranks = local_ranks()
    return Budget(int(node // ranks), asked, available, ranks, amount if share else None)


def size_text(nbytes: float) -> str:
    """Bytes in the unit that reads best: "512 B", "3.2 MiB", "1.96 GiB", "15.8 GiB"."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            if value < 10:
                return f"{value:.3g} {unit}"
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(nbytes)} B"
