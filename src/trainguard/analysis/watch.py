"""`RunWatcher`: follows a running job's metrics.jsonl and events.jsonl for `trainguard watch`:
it waits for the run folder to appear, lets an incident's colour fade after a quiet stretch, and
tells a run that closed from one whose files stopped changing."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from trainguard.analysis.logs import json_object
from trainguard.analysis.run import is_step
from trainguard.events import TrainguardError
from trainguard.run_lock import local_holder
from trainguard.sinks.console import HEALTH_STEPS

SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 60
QUIET_STEPS = HEALTH_STEPS  # as the run's own console status line: an incident colours 100 steps
STALE_AFTER_S = 30.0  # files unchanged this long are said to have no new data
_COLOURS = {"ok": "green", "info": "green", "warning": "yellow", "critical": "red"}


class _Tail:
    """Reads the complete lines appended to a file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def lines(self) -> list[dict[str, Any]]:
        """The JSON objects on the new complete lines; other lines are passed over, and a last
        line without its newline waits for it (forever, when the run was cut short)."""
        if not self.path.is_file():
            return []
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError as exc:
            raise TrainguardError(
                f"cannot read {self.path}: {exc.strerror or exc}; check its permissions"
            ) from None
        self.offset += len(chunk)
        data = self.partial + chunk
        *complete, self.partial = data.split(b"\n")
        return [r for r in map(_object, complete) if r is not None]


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
        for record in self._metrics.lines():
            if not is_step(record.get("step")):
                continue
            self.step = record["step"]
            self.loss.append(_number(record.get("loss")))
            self.grad.append(_number(record.get("grad_norm")))
        for event in self._events.lines():
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
        self._check_writer()

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
