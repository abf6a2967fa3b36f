"""`ConsoleSink`: incidents printed as they happen, one line each."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from trainguard.events import SEVERITY_RANK, Event, Severity
from trainguard.sinks.base import Sink

_STYLE = {"info": "dim", "warning": "yellow", "critical": "bold red"}


class ConsoleSink(Sink):
    """Prints each event at or above `min_severity` to stderr (or the given console)."""

    def __init__(self, console: Console | None = None, min_severity: Severity = "warning") -> None:
        self.console = console or Console(stderr=True)
        self.min_rank = SEVERITY_RANK[min_severity]

    def on_event(self, event: Event) -> None:
        if SEVERITY_RANK[event.severity] < self.min_rank:
            return
        style = _STYLE[event.severity]
        kind = event.kind + (f" ({event.type})" if event.type else "")
        action = f" -> {event.action}" if event.action else ""
        self.console.print(
            f"[{style}]trainguard step {event.step} {event.severity.upper()} {escape(kind)}: "
            f"{escape(event.message)}{action}[/]",
            highlight=False,
            soft_wrap=True,
        )
        frames = event.metrics.get("frames") if event.kind == "nan_origin" else None
        for frame in frames or []:  # the code that made the NaN, innermost last
            self.console.print(f"    {escape(str(frame))}", style="dim", highlight=False)
