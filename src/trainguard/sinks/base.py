"""`Sink`: the interface every output of the guard implements."""

from __future__ import annotations

from typing import Any

from trainguard.events import Event


class Sink:
    """Receives each event, each metrics record and each evaluation; `close` flushes and
    releases resources."""

    def on_event(self, event: Event) -> None:
        """Called once per event, in order."""

    def on_metrics(self, record: dict[str, Any]) -> None:
        """Called with each logged metrics record."""

    def on_evaluation(self, record: dict[str, Any]) -> None:
        """Called with each evaluation of the model (`guard.evaluate`): its `step`, `time`
        and `values`, a name -> value mapping (NaN and Inf as the strings "nan", "inf")."""

    def close(self) -> None:
        """Flush and release; called once at the end of the run."""
