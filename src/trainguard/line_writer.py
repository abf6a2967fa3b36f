"""`LineWriter`: one thread that writes the run files' lines in the order they were handed over,
so that the training thread only appends a record to a queue (no `json.dumps`, no syscall)."""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from trainguard.line_file import Report, stderr_report

BATCH_LINES = 64  # the thread wakes once this many lines wait...
INTERVAL_S = 1.0  # ...or this long after it last woke, whichever comes first

Write = Callable[[Any, bool], None]  # writes one record (serialized there), fsync'd when True


class _Mark:
    """A point in the queue: `done` is set once every item before it is written."""

    def __init__(self, stop: bool = False) -> None:
        self.done = threading.Event()
        self.stop = stop  # the thread ends here


_Item = tuple[Write, Any, bool] | _Mark


class _Queue:
    """What the thread holds: the items and the event that wakes it (never the `LineWriter`,
    so an unclosed writer is still collected and its `finalize` drains it)."""

    def __init__(self, report: Report) -> None:
        self.items: deque[_Item] = deque()
        self.wake = threading.Event()
        self.report = report
        self.pid = os.getpid()  # a forked child's copy writes nothing of its parent's

    def run(self, interval_s: float) -> None:
        """The thread: wake every `interval_s` (or when asked), write what waits, in order."""
        while True:
            self.wake.wait(interval_s)
            self.wake.clear()
            if self.write_waiting():
                return

    def write_waiting(self) -> bool:
        """Write every waiting item; True when a stop mark was reached."""
        while self.items:
            item = self.items.popleft()
            if isinstance(item, _Mark):
                item.done.set()
                if item.stop:
                    return True
                continue
            write, record, sync = item
            try:
                write(record, sync)
            except Exception as exc:  # the writes report their own errors: this is a last guard
                self.report(f"a run file's line was not written ({type(exc).__name__}: {exc})")
        return False


class LineWriter:
    """Writes records on a thread of its own: `put` only queues, the thread wakes every
    `batch_lines` lines or `interval_s` seconds; `flush` waits for what was put, `close` drains
    and joins (also at interpreter exit, or when the writer is collected unclosed)."""

    def __init__(
        self,
        report: Report = stderr_report,
        batch_lines: int = BATCH_LINES,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.batch_lines = batch_lines
        self._queue = _Queue(report)
        self._thread = threading.Thread(
            target=self._queue.run, args=(interval_s,), name="trainguard-writer", daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._queue, self._thread)
        with _live_lock:
            _live.add(self)

    @property
    def closed(self) -> bool:
        """Whether `close` ran (its thread is joined; `put` then writes in place)."""
        return not self._finalizer.alive

    def put(self, write: Write, record: Any, sync: bool = False) -> None:
        """Queue `write(record, sync)`; once closed, run it here and now."""
        if self.closed:
            write(record, sync)
            return
        self._queue.items.append((write, record, sync))
        if len(self._queue.items) == self.batch_lines:  # once as the queue fills past it
            self._queue.wake.set()

    def flush(self) -> None:
        """Return once everything put so far is written (fsync'd where asked)."""
        if self.closed or self._queue.pid != os.getpid():
            return
        mark = _Mark()
        self._queue.items.append(mark)
        self._queue.wake.set()
        while not mark.done.wait(INTERVAL_S):
            if not self._thread.is_alive():  # never expected: write what waits here instead
                self._queue.write_waiting()
                return

    def close(self) -> None:
        """Write everything put so far and end the thread; a second call does nothing."""
        self._finalizer()


def _stop(queue: _Queue, thread: threading.Thread) -> None:
    """Drain the queue and join its thread (in the process that started it)."""
    if queue.pid != os.getpid():
        return
    queue.items.append(_Mark(stop=True))
    queue.wake.set()
    if thread is not threading.current_thread():
        thread.join()


_live: weakref.WeakSet[LineWriter] = weakref.WeakSet()
_live_lock = threading.Lock()  # a writer made on one thread while another lists them


def flush_writers() -> None:
    """Flush every open `LineWriter` of this process, for a reader of run files here."""
    with _live_lock:
        writers = list(_live)
    for writer in writers:
        writer.flush()
