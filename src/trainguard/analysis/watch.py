"""`RunWatcher`: follows a running job's metrics.jsonl and events.jsonl for `trainguard watch`:
it waits for the run folder to appear, lets an incident's colour fade after a quiet stretch, and
tells a run that closed from one whose files stopped changing."""

from __future__ import annotations

import math
import os
import stat
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from trainguard.analysis.logs import MAX_LINE_BYTES, READ_BYTES, json_object
from trainguard.analysis.run import is_step
from trainguard.events import TrainguardError
from trainguard.line_writer import flush_writers
from trainguard.run_lock import local_holder
from trainguard.sinks.console import HEALTH_STEPS

SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 60
QUIET_STEPS = HEALTH_STEPS  # as the run's own console status line: an incident colours 100 steps
STALE_AFTER_S = 30.0  # files unchanged this long are said to have no new data
_COLOURS = {"ok": "green", "info": "green", "warning": "yellow", "critical": "red"}


class _Tail:
    """Reads the complete lines appended to a file since the last call, a block at a time: a
    line over `MAX_LINE_BYTES` is passed over as it streams by (counted in `long`), and a file
    replaced (another inode) or truncated (shorter than what was read) is read again from its
    start (counted in `reread`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.skipping = False  # inside a line too long to keep
        self.identity: tuple[int, int] | None = None  # the device and inode read
        self.long = 0
        self.reread = 0

    def lines(self) -> Iterator[dict[str, Any]]:
        """The JSON objects on the new complete lines; other lines are passed over, and a last
        line without its newline waits for it (forever, when the run was cut short)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TrainguardError(
                f"cannot read {self.path}: {exc.strerror or exc}; check its permissions"
            ) from None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return
            identity = (info.st_dev, info.st_ino)
            if self.identity is not None and (
                identity != self.identity or info.st_size < self.offset
            ):
                self.reread += 1
                self.offset, self.partial, self.skipping = 0, b"", False
            self.identity = identity
            f.seek(self.offset)
            while chunk := self._read(f):
                yield from self._complete(chunk)

    def _read(self, f: IO[bytes]) -> bytes:
        try:
            chunk = f.read(READ_BYTES)
        except OSError as exc:
            raise TrainguardError(
                f"cannot read {self.path}: {exc.strerror or exc}; check its permissions"
            ) from None
        self.offset += len(chunk)
        return chunk

    def _complete(self, chunk: bytes) -> Iterator[dict[str, Any]]:
        """The objects on the lines `chunk` completes; the rest waits, unless it is too long."""
        if self.skipping:
            end = chunk.find(b"\n")
            if end < 0:
                return
            chunk, self.skipping = chunk[end + 1 :], False
        *complete, self.partial = (self.partial + chunk).split(b"\n")
        for raw in complete:
            if len(raw) > MAX_LINE_BYTES:
                self.long += 1
                continue
            record = _object(raw)
            if record is not None:
                yield record
        if len(self.partial) > MAX_LINE_BYTES:
            self.long += 1
            self.partial, self.skipping = b"", True

    def note(self) -> str | None:
        """What was unusual about reading the file, in words; None when nothing was."""
        said = []
        if self.reread:
            said.append(f"{self.path.name} was replaced or truncated: read again from its start")
        if self.long:
            said.append(
                f"passed over {self.long} line(s) of {self.path.name} over {MAX_LINE_BYTES:,} bytes"
            )
        return "; ".join(said) or None


def _object(raw: bytes) -> dict[str, Any] | None:
    return json_object(raw, exact=False) if raw.strip() else None


def sparkline(values: list[float]) -> str:
    """One bar per value, scaled from the lowest to the highest finite one; "!" for the others."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite) / 2, max(finite) / 2  # halved: no difference of two floats overflows
    span = hi - lo or 1.0
    return "".join(
        SPARK[min(int((v / 2 - lo) / span * (len(SPARK) - 1)), len(SPARK) - 1)]
        if math.isfinite(v)
        else "!"
        for v in values
    )


def _number(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(value, math.nan)
    return math.nan


def _shown(value: Any) -> str:
    """A field of an event as the dashboard prints it; a list or object is named, not shown."""
    if value is None or isinstance(value, (str, int, float)):
        return str(value)
    return f"<{type(value).__name__}>"


class RunWatcher:
    """The state of a run as its files tell it: latest step, recent loss and grad norm, events,
    health, and whether the run closed; `clock` gives the wall-clock time files' ages are read
    against."""

    def __init__(
        self,
        run_dir: str | Path,
        quiet_steps: int = QUIET_STEPS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if quiet_steps < 1:
            raise TrainguardError(f"quiet_steps must be at least 1, got {quiet_steps}")
        self.run_dir = Path(run_dir)
        self.quiet_steps = quiet_steps
        self.clock = clock
        self._metrics = _Tail(self.run_dir / "metrics.jsonl")
        self._events = _Tail(self.run_dir / "events.jsonl")
        self.step: int | None = None
        self.loss: deque[float] = deque(maxlen=HISTORY)
        self.grad: deque[float] = deque(maxlen=HISTORY)
        self.events: deque[dict[str, Any]] = deque(maxlen=5)
        self.unseen: deque[dict[str, Any]] = deque(maxlen=100)  # incidents not yet printed
        self.last_incident: dict[str, int] = {}  # severity -> the step of its latest event
        self.halted = False
        self.closed_at: int | None = None  # the step of the run's `run_closed` event
        self.idle_s: float | None = None  # seconds since its files last changed
        self.writer_alive = False  # a live Guard on this host holds the folder's lock
        self.exited_pid: int | None = None  # a writer that exited without closing the run

    @property
    def appeared(self) -> bool:
        """Whether the run folder exists yet."""
        return self.run_dir.is_dir()

    @property
    def finished(self) -> bool:
        """Whether the run closed: `Guard.close()` wrote its `run_closed` event, and no live
        Guard holds the folder since (a new run in the folder of a closed one)."""
        return self.closed_at is not None and not self.writer_alive

    @property
    def health(self) -> str:
        """ "critical" or "warning" while the latest such event is under `quiet_steps` steps
        behind the run's step (a rollback's replay stays within it), "ok" otherwise."""
        for severity in ("critical", "warning"):
            at = self.last_incident.get(severity)
            if at is not None and max(self.step or 0, at) - at < self.quiet_steps:
                return severity
        return "ok"

    def poll(self) -> None:
        """Read what the run appended since the last poll; lines without an integer step are
        not metrics or events of a guard and are passed over."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise TrainguardError(f"{self.run_dir} is not a directory: give the run_dir of a Guard")
        flush_writers()  # a live run of this process: every line it recorded
        reread = self._metrics.reread
        for record in self._metrics.lines():
            if self._metrics.reread != reread:  # a new file: its own steps only
                reread = self._forget_metrics()
            if not is_step(record.get("step")):
                continue
            self.step = record["step"]
            self.loss.append(_number(record.get("loss")))
            self.grad.append(_number(record.get("grad_norm")))
        if self._metrics.reread != reread:  # replaced by a file with no line yet
            self._forget_metrics()
        reread = self._events.reread
        for event in self._events.lines():
            if self._events.reread != reread:  # a new file: its own events only
                reread = self._forget_events()
            if not is_step(event.get("step")):
                continue
            severity, kind = event.get("severity"), event.get("kind")
            if severity == "warning" or severity == "critical":
                self.events.append(event)
                self.unseen.append(event)
                self.last_incident[severity] = event["step"]
            if kind == "halt":
                self.halted = True
            elif kind == "run_closed":
                self.closed_at = event["step"]
            elif kind == "resume":  # a closed or halted run taken up again
                self.closed_at, self.halted = None, False
        if self._events.reread != reread:
            self._forget_events()
        self._check_writer()

    def _forget_metrics(self) -> int:
        """Forget what the metrics file replaced told; the count of rereads now."""
        self.step = None
        self.loss.clear()
        self.grad.clear()
        return self._metrics.reread

    def _forget_events(self) -> int:
        """Forget what the events file replaced told; the count of rereads now."""
        self.events.clear()
        self.last_incident.clear()
        self.halted, self.closed_at = False, None
        return self._events.reread

    def _check_writer(self) -> None:
        """Whether a Guard writes the folder now, whether its writer exited without closing the
        run, and how long its files have been unchanged."""
        holder = local_holder(self.run_dir) if self.appeared else None
        self.writer_alive = holder is not None and holder[1]
        self.exited_pid = holder[0] if holder is not None and not holder[1] else None
        mtimes = []
        for path in (self._metrics.path, self._events.path):
            try:
                mtimes.append(path.stat().st_mtime)
            except OSError:
                continue
        self.idle_s = max(0.0, self.clock() - max(mtimes)) if mtimes else None

    def status(self) -> tuple[str, str]:
        """The run's state in words, with its colour: waiting, halted, finished, or its health
        (and how long its files have been quiet when that is long)."""
        if not self.appeared:
            return f"waiting for {self.run_dir} to appear", "dim"
        if self.halted:
            return "halted", _COLOURS["critical"]
        last = max(self.last_incident.values(), default=None)
        since = f" (last incident at step {last})" if last is not None else ""
        if self.finished:
            return f"finished{since}", "cyan"
        health = self.health
        if health != "ok":
            words = f"{health} (incident at step {self.last_incident[health]})"
        elif self.step is None and last is None:
            words = "waiting for the first step"
        else:
            words = f"healthy{since}"
        if self.exited_pid is not None:
            words += f"; its writer (pid {self.exited_pid}) exited without closing the run"
        if self.idle_s is not None and self.idle_s >= STALE_AFTER_S:
            words += f"; no new data for {_duration(self.idle_s)}"
        for tail in (self._metrics, self._events):
            note = tail.note()
            if note is not None:
                words += f"; {note}"
        return words, _COLOURS[health]

    def line(self) -> str:
        """The head of the dashboard as one plain line, for output that is not a terminal."""
        loss = f"{self.loss[-1]:.4g}" if self.loss else "-"
        grad = f"{self.grad[-1]:.3g}" if self.grad else "-"
        step = str(self.step) if self.step is not None else "-"
        return f"step {step}  loss {loss}  grad norm {grad}  {self.status()[0]}"

    def incident_lines(self) -> list[str]:
        """The incidents read since the last call, one plain line each."""
        lines = [
            f"step {_shown(e.get('step'))}: {_shown(e.get('kind'))} "
            f"({_shown(e.get('severity'))}): {_shown(e.get('message', ''))}"
            for e in self.unseen
        ]
        self.unseen.clear()
        return lines

    def render(self) -> Panel:
        """The dashboard: a head line with the state, the sparklines, the latest incidents."""
        words, colour = self.status()
        head = Text.assemble(
            ("step ", "bold"),
            (str(self.step) if self.step is not None else "-", "bold"),
            "   loss ",
            (f"{self.loss[-1]:.4g}" if self.loss else "-", "bold"),
            "   grad norm ",
            (f"{self.grad[-1]:.3g}" if self.grad else "-", "bold"),
            "   ",
            (words, f"bold {colour}"),
        )
        lines = Table.grid(padding=(0, 1))
        lines.add_row("loss", sparkline(list(self.loss)))
        lines.add_row("grad", sparkline(list(self.grad)))
        incidents = Table(show_header=True, header_style="bold", expand=True, box=None)
        for name in ("step", "kind", "what"):
            incidents.add_column(name, overflow="fold")
        for e in reversed(self.events):
            style = _COLOURS.get(_shown(e.get("severity")), "white")
            incidents.add_row(
                str(e.get("step")),
                Text(_shown(e.get("kind")), style=style),
                Text(_shown(e.get("message", ""))),
            )
        body = Group(head, lines, incidents if self.events else Text("no incidents", style="dim"))
        title = Text(f"trainguard watch {self.run_dir}")
        return Panel(body, title=title, border_style=colour)


def _duration(seconds: float) -> str:
    """A span of time for a person: seconds under two minutes, then minutes, then hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
