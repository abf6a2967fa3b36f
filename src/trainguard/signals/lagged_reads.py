"""`LaggedReads`: each step's packed figures copied into host memory pinned once, behind an
event, and read by the host one call later, when the copy is long done."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainguard.signals.host_reads import read_landed

SLOTS = 2  # step t's figures are read at t+1, before t+1's copy goes to the other slot


@dataclass
class LaggedRead:
    """A copy in flight: the slot it lands in, how many values, and the event that marks it
    done (None off a GPU, where the copy is done when it returns)."""

    slot: int
    size: int
    done: torch.cuda.Event | None


class LaggedReads:
    """Two host buffers, pinned on a GPU and grown (never shrunk) to the largest step's figures;
    `copy` enqueues a step's device-to-host copy without waiting, `read` waits for that one copy
    only (an event, not a device-wide or stream sync) and returns its values."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * SLOTS
        self._next = 0
        self.allocations = 0  # host buffers allocated (grown): a handful in a whole run

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The host buffers allocated so far (a test marks them as host memory)."""
        return [b for b in self._buffers if b is not None]

    def copy(self, packed: torch.Tensor) -> LaggedRead:
        """Enqueue the copy of `packed` (one dimension, float32) into the next slot."""
        slot, size = self._next, packed.numel()
        self._next = (self._next + 1) % SLOTS
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < size:
            cuda = self.device.type == "cuda"
            buffer = torch.empty(max(size, 2 * (buffer.numel() if buffer is not None else 0)),
                                 dtype=torch.float32, pin_memory=cuda)  # fmt: skip
            self._buffers[slot] = buffer
            self.allocations += 1
        if self.device.type != "cuda":
            buffer[:size].copy_(packed)
            return LaggedRead(slot, size, None)
        buffer[:size].copy_(packed, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        return LaggedRead(slot, size, done)

    def read(self, read: LaggedRead) -> list[float]:
        """The values of a copy `copy` enqueued, once it is done (normally long since)."""
        if read.done is not None:
            read.done.synchronize()
        buffer = self._buffers[read.slot]
        assert buffer is not None
        return read_landed(buffer[: read.size])
