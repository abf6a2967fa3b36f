"""Append-only JSON-lines files of a run: `events.jsonl` and `metrics.jsonl`. A full or failing
disk never stops training and never leaves half a line: lines are dropped, counted and
reported (see `trainguard.line_file.LineFile`)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from trainguard.events import Event, TrainguardError
from trainguard.line_file import FULL_DISK, LineFile, Report, stderr_report
from trainguard.run_files import RunFileError
from trainguard.sinks.base import Sink


def load_schema(name: str) -> dict[str, Any]:
    """The JSON Schema of a run file: `events`, `metrics` or `evals`."""
    text = resources.files("trainguard").joinpath("schemas", f"{name}.schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def _open_lines(path: Path, report: Report) -> LineFile:
    """The run file at `path`, open; a full disk starts it dropping lines, any other error is a
    TrainguardError (a run_dir that cannot be written is a mistake to fix before training)."""
    lines = LineFile(path, report)
    try:
        lines.open()
    except RunFileError:
        raise  # a link or FIFO planted in the run folder: its own one-line error
    except OSError as exc:
        if exc.errno not in FULL_DISK:
            raise TrainguardError(
                f"cannot write {path}: {exc.strerror or exc}; choose a writable run_dir"
            ) from None
        lines.fail(exc)
    return lines


class EventLog(Sink):
    """`events.jsonl`: one JSON object per event, written at once, fsync'd when critical."""

    def __init__(self, path: str | Path, report: Report = stderr_report) -> None:
        self.path = Path(path)
        self.lines = _open_lines(self.path, report)

    @property
    def dropped(self) -> int:
        """Events the disk refused, over the run."""
        return self.lines.dropped

    def on_event(self, event: Event) -> None:
        line = json.dumps(event.to_dict(), allow_nan=False) + "\n"
        self.lines.write(line.encode(), sync=event.severity == "critical")

    def close(self) -> None:
        self.lines.close(sync=True)


class EvalLog(Sink):
    """`evals.jsonl`: one JSON object per `guard.evaluate` call (step, time, values), written
    at once; the file is created at the first evaluation."""

    def __init__(self, path: str | Path, report: Report = stderr_report) -> None:
        self.path = Path(path)
        self.report = report
        self.lines: LineFile | None = None

    @property
    def dropped(self) -> int:
        """Evaluation lines the disk refused, over the run."""
        return 0 if self.lines is None else self.lines.dropped

    def on_evaluation(self, record: dict[str, Any]) -> None:
        if self.lines is None:
            self.lines = _open_lines(self.path, self.report)
        self.lines.write((json.dumps(record, allow_nan=False) + "\n").encode())

    def close(self) -> None:
        if self.lines is not None:
            self.lines.close()


class MetricsLog(Sink):
    """`metrics.jsonl`: one JSON object per logged step, written at once."""

    def __init__(self, path: str | Path, report: Report = stderr_report) -> None:
        self.path = Path(path)
        self.lines = _open_lines(self.path, report)

    @property
    def dropped(self) -> int:
        """Metrics lines the disk refused, over the run."""
        return self.lines.dropped

    def on_metrics(self, record: dict[str, Any]) -> None:
        self.lines.write((json.dumps(record, allow_nan=False) + "\n").encode())

    def close(self) -> None:
        self.lines.close()
