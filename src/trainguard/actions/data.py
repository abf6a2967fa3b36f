"""`GuardedBatches`: the user's data, rewound on rollback, with incident batches skipped."""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from trainguard.actions.snapshots import (
    rng_from_plain,
    rng_state,
    rng_to_plain,
    set_rng_state,
)
from trainguard.events import TrainguardError

_END = object()


def sized_skip(wanted: int, left: int | None, share: float) -> int:
    """Batches to skip after an incident batch: `wanted`, but at most `share` of the `left`
    batches (at least 1) and never more than are left; `wanted` when `left` is unknown."""
    if left is None:
        return wanted
    return max(0, min(wanted, max(1, int(share * left)), left))


def default_batch_ids(batch: Any) -> list[Any] | None:
    """`batch.ids`, or `batch["ids"]` / `batch["batch_ids"]` for a mapping; None when absent."""
    ids = getattr(batch, "ids", None)
    if ids is None and isinstance(batch, dict):
        ids = batch.get("ids", batch.get("batch_ids"))
    if ids is None:
        return None
    return [
        int(i) if hasattr(i, "__index__") else i
        for i in (ids.tolist() if hasattr(ids, "tolist") else ids)
    ]


class GuardedBatches:
    """Iterates a data source once (one pass), counting batches by position.

    A source with `state_dict`/`load_state_dict` (torchdata's `StatefulDataLoader`) is rewound
    from its state; any other re-iterable source (a `DataLoader`, a list) is iterated again with the
    random state it started with, so it repeats its order, and fast-forwarded by position.
    `length` is `len(source)` when it has one (what a rollback may skip is sized to it);
    `on_end` is told when the source runs out.
    """

    def __init__(
        self,
        source: Iterable[Any],
        ids: Callable[[Any], list[Any] | None] = default_batch_ids,
        quarantined: Callable[[list[Any]], bool] = lambda ids: False,
        on_end: Callable[[GuardedBatches], None] | None = None,
    ) -> None:
        self.source = source
        self.ids = ids
        self.quarantined = quarantined
        self.on_end = on_end  # told when the source runs out
        self.length = _length(source)  # batches in one pass, when the source says
        self.skipped = 0  # positions passed over in this pass: a rollback's skip
        self.held_out = 0  # batches passed over in this pass: quarantined
        self.stateful = hasattr(source, "state_dict") and hasattr(source, "load_state_dict")
        self.one_shot = isinstance(source, Iterator) and not self.stateful
        self.position = 0  # batches drawn from the source so far in this pass
        self.current: int | None = None  # position of the batch last handed out
        self.current_ids: list[Any] | None = None
        self.data_wait = 0.0  # seconds the last batch took to arrive (skipped ones included)
        self.ready_at: float | None = None  # when it was handed out
        self.skip: list[tuple[int, int]] = []  # half-open ranges of positions never handed out
        self._rewind: dict[str, Any] | None = None
        self._resume: dict[str, Any] | None = None
        self._start_rng: dict[str, Any] | None = None
        self._iterator: Iterator[Any] | None = None
        self._held_state: dict[str, Any] | None = None  # what `state()` says within `held_at`

    # -- positions ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Where the pass stands: the next position and, for a stateful source, its state."""
        if self._held_state is not None:
            return copy.deepcopy(self._held_state)
        state: dict[str, Any] = {"position": self.position}
        if self.stateful:
            state["source"] = self.source.state_dict()  # type: ignore[attr-defined]
        elif self._start_rng is not None:
            state["start_rng"] = rng_to_plain(self._start_rng)
        return state

    @contextmanager
    def held_at(self, state: dict[str, Any] | None) -> Iterator[None]:
        """Within: `state()` says `state` (where the pass stood before the batch since drawn;
        None: where it stands)."""
        self._held_state = state
        try:
            yield
        finally:
            self._held_state = None

    def resume(self, state: dict[str, Any]) -> None:
        """Start this pass where a checkpointed run stood (its order, its position)."""
        if "start_rng" in state:
            self._start_rng = rng_from_plain(state["start_rng"])
        self._resume = state

    def left_after(self, position: int) -> int | None:
        """Batches the source still holds after `position`; None for a source without a length."""
        return None if self.length is None else max(0, self.length - position - 1)

    def rewind(self, state: dict[str, Any], skip: tuple[int, int] | None) -> None:
        """Continue from `state` at the next batch drawn, never handing out positions in `skip`."""
        if skip is not None and skip[1] > skip[0]:
            self.skip.append(skip)
        self._rewind = state

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if self._resume is not None and not self.one_shot:
            self._open(self._resume)
        else:
            self._open(None)
        self._resume = None
        waited = 0.0
        while True:
            if self._rewind is not None:
                self._open(self._rewind)
            assert self._iterator is not None
            asked = time.perf_counter()
            try:
                batch = next(self._iterator)
            except StopIteration:
                if self.on_end is not None:
                    self.on_end(self)
                return
            waited += time.perf_counter() - asked
            position = self.position
            self.position += 1
            if any(a <= position < b for a, b in self.skip):
                self.skipped += 1
                continue
            ids = self.ids(batch)
            if ids is not None and self.quarantined(ids):
                self.held_out += 1
                continue
            self.current, self.current_ids = position, ids
            self.data_wait, self.ready_at = waited, time.perf_counter()
            waited = 0.0
            yield batch

    def _open(self, state: dict[str, Any] | None) -> None:
        self._rewind = None
        if state is None:
            self._start_rng = rng_state()
            self._iterator = iter(self.source)
            self.position = 0
            self.skipped = self.held_out = 0
            return
        if self.stateful:
            self.source.load_state_dict(state["source"])  # type: ignore[attr-defined]
            self._iterator = iter(self.source)
            self.position = int(state["position"])
            return
        if self.one_shot:
            raise TrainguardError(
                "cannot rewind a one-shot iterator for a rollback: pass guard.batches() a "
                "re-iterable source (a DataLoader, a list, a StatefulDataLoader)"
            )
        now = rng_state()
        if self._start_rng is None:  # resumed without a recorded order: take it from here
            self._start_rng = now
        set_rng_state(self._start_rng)  # the same shuffle order as the first time: a sampler
        iterator = iter(self.source)  # draws it at iter() or at the first batch, so take that
        first = next(iterator, _END)  # batch under the starting random state too
        set_rng_state(now)
        self._iterator = iter(()) if first is _END else itertools.chain([first], iterator)
        target = int(state["position"])
        for _ in range(target):  # fast-forward; a StatefulDataLoader avoids this cost
            try:
                next(self._iterator)
            except StopIteration:
                break
        self.position = target


def _length(source: Iterable[Any]) -> int | None:
    """`len(source)` when it has one that works (a DataLoader of an iterable dataset raises)."""
    try:
        return len(source)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError, ValueError):
        return None
