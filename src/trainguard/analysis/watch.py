"""`RunWatcher`: follows a running job's metrics.jsonl and events.jsonl for `trainguard watch`."""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from trainguard.analysis.logs import json_object
from trainguard.analysis.run import is_step
from trainguard.events import TrainguardError

SPARK = "▁▂▃▄▅▆▇█"
HISTORY = 60
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
    """The state of a run as its files tell it: latest step, recent loss and grad norm, events."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self._metrics = _Tail(self.run_dir / "metrics.jsonl")
        self._events = _Tail(self.run_dir / "events.jsonl")
        self.step: int | None = None
        self.loss: deque[float] = deque(maxlen=HISTORY)
        self.grad: deque[float] = deque(maxlen=HISTORY)
        self.events: deque[dict[str, Any]] = deque(maxlen=5)
        self.health = "ok"
        self.halted = False

    def poll(self) -> None:
        """Read what the run appended since the last poll; lines without an integer step are
        not metrics or events of a guard and are passed over."""
        for record in self._metrics.lines():
            if not is_step(record.get("step")):
                continue
            self.step = record["step"]
            self.loss.append(_number(record.get("loss")))
            self.grad.append(_number(record.get("grad_norm")))
        for event in self._events.lines():
            if not is_step(event.get("step")):
                continue
            severity = event.get("severity")
            if severity == "warning" or severity == "critical":
                self.events.append(event)
                if severity == "critical" or self.health != "critical":
                    self.health = severity
            if event.get("kind") == "halt":
                self.halted = True

    def render(self) -> Panel:
        colour = _COLOURS[self.health]
        status = "halted" if self.halted else self.health
        head = Text.assemble(
            ("step ", "bold"),
            (str(self.step) if self.step is not None else "-", "bold"),
            "   loss ",
            (f"{self.loss[-1]:.4g}" if self.loss else "-", "bold"),
            "   grad norm ",
            (f"{self.grad[-1]:.3g}" if self.grad else "-", "bold"),
            "   health ",
            (status, f"bold {colour}"),
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
