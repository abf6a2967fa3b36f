"""`TensorBoardSink`: scalars, layer-group grad-norm histograms and incidents as text. A writer
that fails (a full disk) is reported once and its records dropped; a fresh one is tried later."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.events import SEVERITY_RANK, Event, TrainguardError
from trainguard.line_file import Report, describe_os_error, stderr_report
from trainguard.sinks.base import Sink

SCALARS = ("loss", "grad_norm", "lr", "loss_scale", "update_ratio", "param_norm")
RETRY_S = 60.0  # a fresh writer after a failure, at most this often (each one is a new file)


class TensorBoardSink(Sink):
    """Writes `train/<figure>` scalars, a `grad_norm/groups` histogram and one scalar per layer
    group, `eval/<name>` scalars of each evaluation, and each incident as `incidents` text, to
    TensorBoard event files in `log_dir`."""

    def __init__(
        self,
        log_dir: str | Path,
        report: Report = stderr_report,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
        make_writer: Callable[[str], Any] | None = None,
    ) -> None:
        if make_writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise TrainguardError(
                    "the TensorBoard sink needs the tensorboard package: "
                    "pip install 'trainguard[tensorboard]'"
                ) from None
            make_writer = SummaryWriter
        self.log_dir = str(log_dir)
        self.report = report
        self.retry_s = retry_s
        self.clock = clock
        self.dropped = 0  # records (a metrics record or an incident) not written
        self._make_writer = make_writer  # a SummaryWriter for a log dir
        self._retry_at = 0.0
        self._failing = False
        self.writer: Any = None
        self._usable_writer()

    def _usable_writer(self) -> Any:
        """The writer, or a fresh one when the last failed and its retry time has come."""
        if self.writer is None and self.clock() >= self._retry_at:
            try:
                self.writer = self._make_writer(self.log_dir)
            except Exception as exc:  # whatever the writer raises: reported, never raised
                self._failed(exc)
        return self.writer

    def _failed(self, exc: Exception) -> None:
        self.dropped += 1
        self._retry_at = self.clock() + self.retry_s
        writer, self.writer = self.writer, None
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
        if not self._failing:
            self._failing = True
            self.report(
                f"TensorBoard writer in {self.log_dir} failed ({_describe(exc)}); its figures are "
                "dropped until a fresh writer works, the run goes on"
            )

    def _recovered(self) -> None:
        if self._failing:
            self._failing = False
            self.report(
                f"TensorBoard writer in {self.log_dir} works again ({self.dropped} record(s) "
                "dropped so far)"
            )

    def _write(self, write: Callable[[Any], None]) -> None:
        """Call `write(writer)` where a writer is usable; a failure (a full disk, surfacing from
        the writer's thread) is reported and the writer retried later, never raised."""
        writer = self._usable_writer()
        if writer is None:
            self.dropped += 1
            return
        try:
            write(writer)
        except Exception as exc:
            self._failed(exc)
            return
        self._recovered()

    def on_metrics(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if isinstance(step, int):
            self._write(lambda writer: self._write_metrics(writer, record, step))

    def _write_metrics(self, writer: Any, record: dict[str, Any], step: int) -> None:
        for key in SCALARS:
            value = record.get(key)
            if _finite_number(value):
                writer.add_scalar(f"train/{key}", float(value or 0.0), step)
        groups = record.get("group_grad_norms")
        if isinstance(groups, dict) and groups:
            values = [float(v) for v in groups.values() if isinstance(v, (int, float))]
            finite = [v for v in values if math.isfinite(v)]
            if finite:
                import numpy as np

                writer.add_histogram("grad_norm/groups", np.asarray(finite), step)
            for name, value in groups.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    writer.add_scalar(f"grad_norm_group/{name}", float(value), step)

    def on_evaluation(self, record: dict[str, Any]) -> None:
        """Each finite value as an `eval/<name>` scalar."""
        step = record.get("step")
        if not isinstance(step, int):
            return

        def write(writer: Any) -> None:
            for name, value in (record.get("values") or {}).items():
                if _finite_number(value):
                    writer.add_scalar(f"eval/{name}", float(value), step)

        self._write(write)

    def on_event(self, event: Event) -> None:
        if SEVERITY_RANK[event.severity] < SEVERITY_RANK["warning"]:
            return
        kind = event.kind + (f" ({event.type})" if event.type else "")
        text = f"**{event.severity}** {kind}: {event.message}"
        if event.action:
            text += f" -> {event.action}"
        self._write(lambda writer: writer.add_text("incidents", text, event.step))

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as exc:
                self._failed(exc)
        self._retry_at = math.inf  # nothing is written after close


def _describe(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return describe_os_error(exc)
    return type(exc).__name__


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
