"""Append-only JSON-lines files of a run: `events.jsonl`, `metrics.jsonl` and `evals.jsonl`,
serialized and written on a writer thread (`trainguard.line_writer.LineWriter`). A full or
failing disk never stops training and never leaves half a line: lines are dropped, counted and
reported (see `trainguard.line_file.LineFile`)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from trainguard.events import Event, TrainguardError
from trainguard.line_file import FULL_DISK, LineFile, Report, stderr_report
from trainguard.line_writer import LineWriter
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


class JsonLines(Sink):
    """A run file of JSON lines whose records are serialized and written on a `LineWriter`
    thread: the one given (shared, closed by its owner) or one of its own."""

    def __init__(
        self,
        path: str | Path,
        report: Report = stderr_report,
        writer: LineWriter | None = None,
        open_now: bool = True,
    ) -> None:
        self.path = Path(path)
        self.report = report
        self.lines: LineFile | None = _open_lines(self.path, report) if open_now else None
        self.own_writer = writer is None
        self.writer = LineWriter(report) if writer is None else writer
        self.failed = False  # a record that would not serialize: nothing more is written

    @property
    def dropped(self) -> int:
        """Lines the disk refused over the run (after those handed over so far are written)."""
        self.writer.flush()
        return 0 if self.lines is None else self.lines.dropped

    def flush(self) -> None:
        """Return once every line handed over so far is written."""
        self.writer.flush()

    def put(self, record: dict[str, Any], sync: bool = False) -> None:
        """Hand `record` to the writer thread; with `sync`, wait until it is written and
        fsync'd, with every line before it."""
        if self.failed:
            return
        self.writer.put(self._write, record, sync)
        if sync:
            self.writer.flush()

    def _write(self, record: dict[str, Any], sync: bool) -> None:
        """On the writer thread: one line, fsync'd when `sync`; a record that does not
        serialize is said once, as a failing sink is, and the file gets nothing more."""
        if self.failed or self.lines is None:
            return
        try:
            line = json.dumps(record, allow_nan=False) + "\n"
        except Exception as exc:
            self.failed = True
            self.report(
                f"the sink {type(self).__name__} failed ({type(exc).__name__}: {exc}); it gets "
                "nothing more in this run, which goes on"
            )
            return
        self.lines.write(line.encode(), sync)

    def close(self, sync: bool = False) -> None:
        """Write what was handed over, then close the file (fsync'd when `sync`)."""
        if self.own_writer:
            self.writer.close()
        else:
            self.writer.flush()
        if self.lines is not None:
            self.lines.close(sync=sync)


class EventLog(JsonLines):
    """`events.jsonl`: one JSON object per event; a critical one is written and fsync'd, with
    every line before it, before `on_event` returns."""

    def on_event(self, event: Event) -> None:
        self.put(event.to_dict(), sync=event.severity == "critical")

    def close(self, sync: bool = True) -> None:
        super().close(sync)


class EvalLog(JsonLines):
    """`evals.jsonl`: one JSON object per `guard.evaluate` call (step, time, values); the file
    is created at the first evaluation."""

    def __init__(
        self, path: str | Path, report: Report = stderr_report, writer: LineWriter | None = None
    ) -> None:
        super().__init__(path, report, writer, open_now=False)

    def on_evaluation(self, record: dict[str, Any]) -> None:
        if self.lines is None:
            self.lines = _open_lines(self.path, self.report)
        self.put(dict(record))


class MetricsLog(JsonLines):
    """`metrics.jsonl`: one JSON object per logged step."""

    def on_metrics(self, record: dict[str, Any]) -> None:
        self.put(dict(record))  # its own top level: a caller may change the one it holds
