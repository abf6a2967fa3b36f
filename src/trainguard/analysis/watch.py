"""`RunWatcher`: follows a running job's metrics.jsonl and events.jsonl for `trainguard watch`."""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

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
        if not self.path.is_file():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        data = self.partial + chunk
        *complete, self.partial = data.split(b"\n")
        out = []
        for raw in complete:
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


def sparkline(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo or 1.0
    return "".join(
        SPARK[min(int((v - lo) / span * (len(SPARK) - 1)), len(SPARK) - 1)]
        if math.isfinite(v)
        else "!"
        for v in values
    )


def _number(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(str(value), math.nan)


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
        for record in self._metrics.lines():
            self.step = int(record.get("step", self.step or 0))
            self.loss.append(_number(record.get("loss")))
            self.grad.append(_number(record.get("grad_norm")))
        for event in self._events.lines():
            if event.get("severity") in ("warning", "critical"):
                self.events.append(event)
                if event["severity"] == "critical" or self.health != "critical":
                    self.health = event["severity"]
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
            style = _COLOURS.get(e.get("severity", "info"), "white")
            incidents.add_row(
                str(e.get("step")), Text(str(e.get("kind")), style=style), e.get("message", "")
            )
        body = Group(head, lines, incidents if self.events else Text("no incidents", style="dim"))
        return Panel(body, title=f"trainguard watch {self.run_dir}", border_style=colour)
