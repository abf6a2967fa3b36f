"""Host reads of device figures: the one place a hot path brings tensor values to the host.

Every read of a step's figures (`.tolist()`, `.item()`, `float(tensor)`) on a path an ordinary
step reaches goes through `read_now`, so a test can count them (`COUNTS`, `reads_counted`) and
a reviewer can find them. On a GPU `read_now` blocks: the copy lands in pageable memory and torch
finishes it with a stream synchronize, which drains everything queued before it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

COUNTS: Counter[str] = Counter()  # reads so far, by kind ("now": blocking; "lagged": landed)


def read_now(tensor: torch.Tensor) -> list[float]:
    """The values of a small tensor of figures as a flat list, read at once (a blocking copy
    to the host). Integer and bool tensors give Python ints and bools, exactly."""
    COUNTS["now"] += 1
    values: list[float] = tensor.detach().reshape(-1).tolist()
    return values


def read_landed(buffer: torch.Tensor) -> list[float]:
    """The values of a host buffer a device copy has landed in (the lagged path waits for its
    event first): host memory, no device read; counted as "lagged"."""
    COUNTS["lagged"] += 1
    values: list[float] = buffer.reshape(-1).tolist()
    return values


def reset_counts() -> None:
    """Forget the reads counted so far."""
    COUNTS.clear()


@contextmanager
def reads_counted() -> Iterator[Counter[str]]:
    """The reads made inside the block, by kind; the module's `COUNTS` go on counting."""
    before = Counter(COUNTS)
    made: Counter[str] = Counter()
    try:
        yield made
    finally:
        made.update(COUNTS)
        made.subtract(before)
        for kind in [k for k, n in made.items() if n == 0]:
            del made[kind]
