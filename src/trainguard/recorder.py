"""`Recorder`: the run's outputs: the run folder's lock, `config.json`, the event and metrics logs
and every other sink; counts what was recorded, and times each step."""

from __future__ import annotations

import datetime as _dt
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainguard.config import GuardConfig
from trainguard.detectors.base import MetricPoint
from trainguard.events import Action, Event, _json_number
from trainguard.line_file import write_small_file
from trainguard.line_writer import LineWriter
from trainguard.run_lock import RunLock
from trainguard.signals.gradients import StepSignals
from trainguard.sinks import ConsoleSink, EvalLog, EventLog, MetricsLog, Sink
from trainguard.sinks.factory import sinks_from_config


class Recorder:
    """Hands events and each step's metrics record to the sinks (rank 0 only has any), and holds
    the run folder for this run alone while it writes there."""

    def __init__(
        self,
        config: GuardConfig,
        run_dir: Path | None,
        leader: bool,
        sinks: Sequence[Sink] = (),
    ) -> None:
        self.config = config
        self.sinks: list[Sink] = []
        self.run_lock: RunLock | None = None
        self.event_counts: dict[str, int] = {}
        self.action_counts: dict[str, int] = {"step": 0, "skip": 0, "rollback": 0, "halt": 0}
        self.started = time.perf_counter()
        self.last_step_time: float | None = None  # when the last step was recorded
        self.step_seconds: float | None = None  # the time between the last two recorded steps
        self.writer: LineWriter | None = None  # the thread that writes the three run files
        try:
            if run_dir is not None and leader:  # one writer in a distributed run: rank 0
                self.run_lock = RunLock.take(run_dir, report)
                self.writer = LineWriter(report)
                self.sinks += [
                    EventLog(run_dir / "events.jsonl", report, self.writer),
                    MetricsLog(run_dir / "metrics.jsonl", report, self.writer),
                    EvalLog(run_dir / "evals.jsonl", report, self.writer),
                ]
                write_small_file(run_dir / "config.json", config.to_json() + "\n", report)
            if config.console and leader:
                self.sinks.append(
                    ConsoleSink(
                        status=config.console_status, total_steps=config.diagnosis.total_steps
                    )
                )
            if leader:
                self.sinks.extend(sinks_from_config(config.alerts, report))
                self.sinks.extend(sinks)
        except BaseException:  # a sink that cannot start: free what was taken, for a retry
            self.close()
            raise

    def emit(self, event: Event) -> None:
        """Count an event and hand it to every sink."""
        self.event_counts[event.kind] = self.event_counts.get(event.kind, 0) + 1
        for sink in list(self.sinks):
            try:
                sink.on_event(event)
            except Exception as exc:  # a sink never stops the run: said once, then dropped
                self._drop(sink, exc)

    def _drop(self, sink: Sink, exc: Exception) -> None:
        self.sinks.remove(sink)
        report(
            f"the sink {type(sink).__name__} failed ({type(exc).__name__}: {exc}); it gets "
            "nothing more in this run, which goes on"
        )

    def record(
        self,
        point: MetricPoint,
        action: Action,
        events: Sequence[Event],
        signals: StepSignals | None,
    ) -> dict[str, Any]:
        """The step's metrics record, handed to the sinks every `log_every` steps and on every
        step with events."""
        now = time.perf_counter()
        step_time = None if self.last_step_time is None else now - self.last_step_time
        self.last_step_time = now
        self.step_seconds = step_time
        record: dict[str, Any] = {
            "step": point.step,
            "elapsed_s": round(now - self.started, 6),
            "step_time_s": None if step_time is None else round(step_time, 6),
            "loss": point.loss,
            "grad_norm": point.grad_norm,
            "lr": point.lr,
            "loss_scale": point.loss_scale,
            "action": action,
        }
        if signals is not None:
            if len(signals.lrs) > 1:
                record["lrs"] = signals.lrs
            record["overflow"] = signals.overflow
            record["nonfinite_grads"] = signals.nonfinite_grads
            record["group_grad_norms"] = signals.group_grad_norms
            if signals.group_param_norms is not None:
                record["group_param_norms"] = signals.group_param_norms
            if signals.update_step is not None:
                record["param_norm"] = signals.param_norm
                record["update_norm"] = signals.update_norm
                record["update_ratio"] = signals.update_ratio
                record["update_step"] = signals.update_step
                record["group_update_ratios"] = signals.group_update_ratios
        elif point.group_grad_norms:
            record["group_grad_norms"] = point.group_grad_norms
        if point.routing is not None:
            record["routing"] = point.routing
        if point.token_accuracy is not None:
            record["token_accuracy"] = point.token_accuracy
        if point.precursors is not None:
            record["precursors"] = point.precursors
        if point.rank_losses is not None:
            record["ranks"] = {
                "loss": point.rank_losses,
                "grad_norm": point.rank_grad_norms,
                "step_time_s": point.rank_step_times,
                "data_wait_s": point.rank_data_waits,
            }
        if point.rank_metrics is not None:  # the reduce exchange: bounded at any world size
            record["ranks"] = rank_summary(point)
        if events:
            record["events"] = [e.kind for e in events]
        record = _json_number(record)
        if point.step % self.config.log_every == 0 or events:
            for sink in list(self.sinks):
                try:
                    sink.on_metrics(record)
                except Exception as exc:
                    self._drop(sink, exc)
        return record

    def record_evaluation(self, step: int, values: dict[str, float]) -> dict[str, Any]:
        """An evaluation's record (`evals.jsonl`), handed to every sink."""
        record = _json_number(
            {
                "step": step,
                "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
                "values": dict(values),
            }
        )
        for sink in list(self.sinks):
            try:
                sink.on_evaluation(record)
            except Exception as exc:
                self._drop(sink, exc)
        return dict(record)

    def state_dict(self) -> dict[str, Any]:
        """The counts of actions and event kinds recorded so far."""
        return {"action_counts": dict(self.action_counts), "event_counts": dict(self.event_counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.action_counts.update(action_counts(state))
        events = state.get("event_counts", {})
        self.event_counts.update({str(k): int(v) for k, v in events.items()})

    def flush(self) -> None:
        """Return once the run files hold every line recorded so far."""
        if self.writer is not None:
            self.writer.flush()

    def close(self, then: Callable[[], None] | None = None) -> None:
        """Close every sink (the run files' writer thread drained and joined) and then what
        `then` closes, and unlock the run folder last."""
        try:
            try:
                for sink in self.sinks:
                    sink.close()
            finally:
                if self.writer is not None:
                    self.writer.close()
            if then is not None:
                then()
        finally:
            if self.run_lock is not None:
                self.run_lock.release()


def rank_summary(point: MetricPoint) -> dict[str, Any]:
    """A `reduce` exchange's per-rank figures as the metrics record keeps them: per figure the
    ranks' geometric mean, highest and lowest with their ranks and the non-finite count; the
    ranks' mean step time and data wait and the slowest rank."""
    summary: dict[str, Any] = {}
    for name, figure in (point.rank_metrics or {}).items():
        summary[name] = {
            "geo_mean": math.exp(figure.mean_log) if figure.positive else None,
            "high": figure.high,
            "high_rank": figure.high_rank,
            "low": figure.low,
            "low_rank": figure.low_rank,
            "nonfinite": figure.nonfinite,
        }
    timing = point.rank_timing
    if timing is not None:
        summary["step_time_s"] = {
            "mean": timing.mean,
            "high": timing.high,
            "high_rank": timing.high_rank,
        }
        summary["data_wait_s"] = {"mean": timing.mean_wait}
    return summary


def action_counts(state: dict[str, Any]) -> dict[str, int]:
    """The action counts of a guard state (raises when malformed)."""
    return {str(k): int(v) for k, v in state.get("action_counts", {}).items()}


def report(message: str) -> None:
    """A line about the guard's own outputs (an alert channel failing), on stderr."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(
        f"[yellow]trainguard:[/] {escape(message)}", highlight=False, soft_wrap=True
    )
