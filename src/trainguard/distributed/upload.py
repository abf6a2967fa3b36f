"""`FigureUpload`: a step's host figures (timings, flags, a detector's line) to the device
without a pageable copy.

`torch.tensor(figures, device="cuda")` copies from pageable memory, and torch finishes such a
copy with a stream synchronize: a blocking sync on every step that sends figures. Here the
figures are written into one of two pinned host buffers, allocated once (again only when the
figure count grows), and copied with `non_blocking=True`; an event recorded after each copy says
when the device is done reading a buffer, and the host waits on that event alone (never a
device-wide sync) before it writes into the buffer again, two sends later. On a CPU device there
is nothing to copy: the figures become a tensor there, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class _Slot:
    """One pinned buffer, its numpy view (written in place), and the event after its last
    copy to the device."""

    buffer: torch.Tensor
    view: np.ndarray[Any, Any]
    event: Any = None  # torch.cuda.Event, or a stand-in in tests


class FigureUpload:
    """Sends small runs of Python numbers to `device` as a `dtype` tensor, one call a step."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.staged = device.type == "cuda"  # pinned buffers and events: CUDA's
        self._slots: list[_Slot | None] = [None, None]
        self._turn = 0
        self.allocations = 0  # pinned buffers allocated, for tests
        self.waits = 0  # event waits before a buffer was written again, for tests

    def send(self, figures: Sequence[float]) -> torch.Tensor:
        """`figures` as a new tensor on the device: with a pinned, non-blocking copy on a GPU."""
        if not self.staged:
            if self.device.type == "cpu":  # already where it is needed: no copy
                return torch.tensor(figures, dtype=self.dtype)
            return torch.tensor(figures, dtype=self.dtype, device=self.device)  # not CUDA
        n = len(figures)
        slot = self._slots[self._turn]
        if slot is None or slot.buffer.numel() < n:
            buffer = self._new_buffer(max(n, 1))
            slot = _Slot(buffer, buffer.numpy())
            self._slots[self._turn] = slot
            self.allocations += 1
        elif slot.event is not None:
            slot.event.synchronize()  # the device's copy out of this buffer, two sends ago
            self.waits += 1
        self._turn ^= 1
        slot.view[:n] = figures
        out = torch.empty(n, dtype=self.dtype, device=self.device)
        out.copy_(slot.buffer[:n], non_blocking=True)
        slot.event = self._record()
        return out

    def _new_buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=self.dtype, pin_memory=True)

    def _record(self) -> Any:
        """An event on the device's current stream, after the copy just queued."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event
