"""`Sink`: the interface every output of the guard implements."""

from __future__ import annotations

from typing import Any

from trainguard.events import Event


class Sink:
    """Receives each event and each metrics record; `close` flushes and releases resources."""

    def on_event(self, event: Event) -> None:
        """Called once per event, in order."""

    def on_metrics(self, record: dict[str, Any]) -> None:
        """Called with each logged metrics record."""

    def close(self) -> None:
        """Flush and release; called once at the end of the run."""
