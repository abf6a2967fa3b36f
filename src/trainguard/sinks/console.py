"""`ConsoleSink`: incidents printed as they happen, one line each, under a live status line
(step, loss, grad norm, a health colour, and a progress bar with ETA when the total is known)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from trainguard.events import SEVERITY_RANK, Event, Severity
from trainguard.sinks.base import Sink

_STYLE = {"info": "dim", "warning": "yellow", "critical": "bold red"}
HEALTH_STEPS = 100  # an incident colours the status line this many steps
STATUS_EVERY_S = 0.25  # the status line is redrawn at most 4 times a second


class ConsoleSink(Sink):
    """Prints each event at or above `min_severity` to stderr (or the given console) at once;
    with `status`, keeps a live line of the run's figures below them while the console is a
    terminal, updated at most every `STATUS_EVERY_S` seconds of `clock`."""

    def __init__(
        self,
        console: Console | None = None,
        min_severity: Severity = "warning",
        status: bool = False,
        total_steps: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console or Console(stderr=True)
        self.min_rank = SEVERITY_RANK[min_severity]
        self.clock = clock
        self.progress: Progress | None = None
        self._task: TaskID | None = None
        self._incident: tuple[int, Severity] | None = None
        self._shown_at: float | None = None  # when the status line was last updated
        self._unshown: dict[str, Any] | None = None  # the latest record not yet on it
        if status and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}" if total_steps else ""),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self.progress.add_task("trainguard: starting", total=total_steps)
            self.progress.start()

    def on_event(self, event: Event) -> None:
        if SEVERITY_RANK[event.severity] >= SEVERITY_RANK["warning"]:
            self._incident = (event.step, event.severity)
        if SEVERITY_RANK[event.severity] < self.min_rank:
            return
        style = _STYLE[event.severity]
        kind = event.kind + (f" ({event.type})" if event.type else "")
        action = f" -> {event.action}" if event.action else ""
        rank = f" rank {event.rank}" if event.rank is not None else ""
        self.console.print(
            f"[{style}]trainguard step {event.step}{rank} {event.severity.upper()} "
            f"{escape(kind)}: {escape(event.message)}{action}[/]",
            highlight=False,
            soft_wrap=True,
        )
        frames = event.metrics.get("frames") if event.kind == "nan_origin" else None
        for frame in frames or []:  # the code that made the NaN, innermost last
            self.console.print(f"    {escape(str(frame))}", style="dim", highlight=False)

    def on_evaluation(self, record: dict[str, Any]) -> None:
        """An evaluation's values on one line, where info events are printed too."""
        if self.min_rank > SEVERITY_RANK["info"]:
            return
        values = record.get("values") or {}
        shown = ", ".join(f"{name} {_fmt(v)}" for name, v in values.items())
        self.console.print(
            f"[dim]trainguard step {record.get('step')} evaluation: {escape(shown)}[/]",
            highlight=False,
            soft_wrap=True,
        )

    def on_metrics(self, record: dict[str, Any]) -> None:
        if self.progress is None:
            return
        now = self.clock()
        if self._shown_at is not None and now - self._shown_at < STATUS_EVERY_S:
            self._unshown = record
            return
        self._shown_at = now
        self._show(record)

    def _show(self, record: dict[str, Any]) -> None:
        """Put `record` on the status line."""
        self._unshown = None
        if self.progress is None or self._task is None:
            return
        step = int(record.get("step", 0))
        self.progress.update(self._task, completed=step + 1, description=self.status(record))

    def status(self, record: dict[str, Any]) -> str:
        """The status line's text: health colour, step, loss, grad norm, LR, last action."""
        step = int(record.get("step", 0))
        colour = "green"
        if self._incident is not None and step - self._incident[0] < HEALTH_STEPS:
            colour = "red" if self._incident[1] == "critical" else "yellow"
        parts = [f"[{colour}]●[/] step {step}", f"loss {_fmt(record.get('loss'))}"]
        parts.append(f"grad {_fmt(record.get('grad_norm'))}")
        if record.get("lr") is not None:
            parts.append(f"lr {_fmt(record.get('lr'))}")
        if record.get("action") not in (None, "step"):
            parts.append(f"[bold]{record['action']}[/]")
        return "  ".join(parts)

    def close(self) -> None:
        if self._unshown is not None:  # the run's last figures stay on the line
            self._show(self._unshown)
        if self.progress is not None:
            self.progress.stop()


def _fmt(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:.4g}"
    return str(value)
