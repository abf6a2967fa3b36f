"""Host memory for copies of device state: one allocation per buffer, pinned once (registered
with CUDA at its exact size), carved into per-tensor views, and a budget per rank."""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

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
    """A host buffer of exactly `nbytes` (uint8), first touched, and pinned when asked: registered
    with CUDA at its own size (no rounding to a power of two, no lock of the caching host
    allocator), and unregistered when it is freed. This is the only place trainguard allocates
    host memory for copies of device state, so that tests can count it."""
    buffer = torch.zeros(max(nbytes, 1), dtype=torch.uint8)  # zeros: the pages are touched here
    address = 0
    if pinned and buffer.numel():
        address = buffer.data_ptr()
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        error = int(cudart.cudaHostRegister(address, buffer.numel(), 1))  # 1: portable
        if error != 0:
            raise MemoryError(
                f"pinning {nbytes / 2**30:.2f} GiB of host memory failed (CUDA error {error}): "
                "lower recovery.snapshot_memory"
            )
    COUNTS.add(buffer.numel(), pinned)
    weakref.finalize(buffer, _unpin, address, buffer.numel())
    return buffer


def carve(buffer: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """One view of `buffer` per entry of `layout`, with the entry's shape and dtype."""
    views = []
    for e in layout.entries:
        raw = buffer[e.offset : e.offset + e.nbytes]
        views.append(raw.view(e.dtype).view(e.shape))
    return views


# -- the budget --------------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(value: str | int | float) -> tuple[float, bool]:
    """A memory setting as `(amount, is_share)`: "25%" is a share of the node's available memory
    (0.25, True); "40GB", "12GiB", "512MiB" or a number are bytes (per node). ValueError with
    what is accepted otherwise."""
    if isinstance(value, bool):
        raise ValueError("a memory size must be bytes, a size such as '40GB', or a share '25%'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a memory size cannot be negative")
        return float(value), False
    text = value.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 <= share <= 1:
            raise ValueError(f"{value!r}: a share of memory is between '0%' and '100%'")
        return share, True
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{value!r} is not a memory size: give bytes, a size such as '40GB' or '12GiB', "
            "or a share of the node's available memory such as '25%'"
        )
    return float(match.group(1)) * _UNITS[unit], False


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


def rank_budget(setting: str | int | float) -> int:
    """This rank's share of the node's budget for snapshot copies, in bytes."""
    amount, share = parse_memory(setting)
    node = amount * available_bytes() if share else amount
    return int(node // local_ranks())


def gib(nbytes: float) -> str:
    """Bytes as GiB, with sense at every size ("0.003 GiB", "15.8 GiB")."""
    value = nbytes / 2**30
    return f"{value:.3g} GiB" if value < 10 else f"{value:.1f} GiB"
