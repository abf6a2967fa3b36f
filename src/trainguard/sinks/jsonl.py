"""Append-only JSON-lines files of a run: `events.jsonl` and `metrics.jsonl`."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import IO, Any

from trainguard.events import Event, TrainguardError
from trainguard.sinks.base import Sink


def load_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of a run file: `events` or `metrics`."""
    text = resources.files("trainguard").joinpath("schemas", f"{name}.schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def _open_append(path: Path) -> IO[str]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("a", encoding="utf-8")
    except OSError as exc:
        raise TrainguardError(
            f"cannot write {path}: {exc.strerror or exc}; choose a writable run_dir"
        ) from None


class EventLog(Sink):
    """`events.jsonl`: one JSON object per event, flushed at once, fsync'd when critical."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = _open_append(self.path)

    def on_event(self, event: Event) -> None:
        self._file.write(json.dumps(event.to_dict(), allow_nan=False) + "\n")
        self._file.flush()
        if event.severity == "critical":
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


class MetricsLog(Sink):
    """`metrics.jsonl`: one JSON object per logged step, flushed each line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = _open_append(self.path)

    def on_metrics(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()
