"""The run files are written on a writer thread: the training thread only queues a record, a
critical event is on disk before the step returns, lines keep their order, close joins the
thread, and a failing write is said once, as it was when the training thread wrote it."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn

import trainguard as tg
from trainguard import line_file
from trainguard.events import Event
from trainguard.line_writer import LineWriter
from trainguard.sinks import ConsoleSink, EvalLog, EventLog, MetricsLog


class ThreadCalls:
    """Counts the calls of a function by the thread that made them."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.threads: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.inner(*args, **kwargs)

    def clear(self) -> None:
        self.threads.clear()

    def on(self, thread: str) -> int:
        return sum(name == thread for name in self.threads)


@pytest.fixture
def io_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, ThreadCalls]:
    """`json.dumps`, the run files' writes and fsyncs, counted by thread."""
    calls = {
        "dumps": ThreadCalls(json.dumps),
        "write": ThreadCalls(line_file.write_all),
        "fsync": ThreadCalls(os.fsync),
    }
    monkeypatch.setattr(json, "dumps", calls["dumps"])
    monkeypatch.setattr(line_file, "write_all", calls["write"])
    monkeypatch.setattr(os, "fsync", calls["fsync"])
    return calls


def small_guard(run_dir: Path, **config: Any) -> tuple[tg.Guard, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = tg.GuardConfig.from_dict(
        {"console": False, "recovery": {"checkpoint_every": 0}, **config}
    )
    return tg.Guard(model, opt, config=cfg, run_dir=run_dir), model


def loss_of(model: nn.Module, step: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 8, generator=g)
    loss = nn.functional.mse_loss(model(x), x[:, :1]) * scale
    loss.backward()
    return loss


def lines_of(path: Path) -> list[dict[str, Any]]:
    """The lines on disk now, without flushing any writer."""
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def writer_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "trainguard-writer"}


def test_a_healthy_step_serializes_and_writes_nothing_on_the_training_thread(tmp_path, io_calls):
    main = threading.current_thread().name
    guard, model = small_guard(tmp_path)
    for calls in io_calls.values():  # config.json and the lock are written at start
        calls.clear()
    for step in range(40):
        guard.step(loss_of(model, step))
        model.zero_grad()
    assert guard.action_counts["step"] == 40
    assert {name: calls.on(main) for name, calls in io_calls.items()} == {
        "dumps": 0,
        "write": 0,
        "fsync": 0,
    }
    guard.flush()
    assert [r["step"] for r in lines_of(tmp_path / "metrics.jsonl")] == list(range(40))
    assert io_calls["dumps"].on("trainguard-writer") >= 40
    assert io_calls["write"].on("trainguard-writer") >= 40
    guard.close()


def test_an_observed_step_writes_nothing_on_the_training_thread(tmp_path, io_calls):
    main = threading.current_thread().name
    monitor = tg.Monitor(tg.GuardConfig(console=False), run_dir=tmp_path)
    for calls in io_calls.values():  # config.json and the lock are written at start
        calls.clear()
    for step in range(100):
        monitor.observe(step, loss=3.0 - step * 1e-3, grad_norm=1.0)
    monitor.evaluate(99, {"val_loss": 2.5})
    assert io_calls["dumps"].on(main) == 0 and io_calls["write"].on(main) == 0
    monitor.close()
    assert len(lines_of(tmp_path / "metrics.jsonl")) == 100
    assert lines_of(tmp_path / "evals.jsonl")[0]["values"] == {"val_loss": 2.5}


def test_a_critical_event_is_on_disk_and_fsynced_when_the_step_returns(tmp_path, io_calls):
    guard, model = small_guard(tmp_path)
    for step in range(10):
        guard.step(loss_of(model, step))
        model.zero_grad()
    fsyncs = len(io_calls["fsync"].threads)
    decision = guard.step(loss_of(model, 10, scale=float("nan")))
    critical = [e.kind for e in decision.events if e.severity == "critical"]
    assert critical and decision.action == "skip"
    on_disk = lines_of(tmp_path / "events.jsonl")  # no flush: written before step returned
    assert [e["kind"] for e in on_disk if e["severity"] == "critical"] == critical
    assert io_calls["fsync"].threads[fsyncs:] == ["trainguard-writer"] * len(critical)
    # the queue was written up to the event: every step before it is on disk too
    assert [r["step"] for r in lines_of(tmp_path / "metrics.jsonl")] == list(range(10))
    guard.close()


def test_a_halt_is_on_disk_when_training_halted_is_raised(tmp_path):
    guard, model = small_guard(tmp_path, policy={"halt_on": ["nonfinite"]})
    guard.step(loss_of(model, 0))
    with pytest.raises(tg.TrainingHalted):
        guard.step(loss_of(model, 1, scale=float("nan")))
    kinds = [e["kind"] for e in lines_of(tmp_path / "events.jsonl")]
    assert "halt" in kinds and kinds[-1] == "run_closed"
    assert [r["step"] for r in lines_of(tmp_path / "metrics.jsonl")] == [0, 1]


def test_a_monitors_halt_is_on_disk_when_observe_returns(tmp_path):
    monitor = tg.Monitor(
        tg.GuardConfig(console=False, policy={"halt_on": ["loss_spike"]}), run_dir=tmp_path
    )
    for step in range(101):
        decision = monitor.observe(step, loss=9.0 if step == 100 else 3.0 - step * 1e-3)
    assert decision.action == "halt"
    assert lines_of(tmp_path / "events.jsonl")[-1]["kind"] == "halt"
    monitor.close()


def test_lines_keep_their_order_across_files_and_wakes(tmp_path):
    writer = LineWriter(batch_lines=3)  # wakes often: order must hold across batches
    metrics = MetricsLog(tmp_path / "metrics.jsonl", writer=writer)
    events = EventLog(tmp_path / "events.jsonl", writer=writer)
    evals = EvalLog(tmp_path / "evals.jsonl", writer=writer)
    done: list[str] = []
    for step in range(500):
        metrics.on_metrics({"step": step, "loss": 1.0 / (step + 1)})
        if step % 7 == 0:
            events.on_event(Event(step=step, kind="loss_above_ema", severity="info", message=""))
        if step % 50 == 0:
            evals.on_evaluation({"step": step, "time": "t", "values": {"val_loss": 1.0}})
        if step % 100 == 0:
            writer.put(lambda record, sync: done.append(record), f"mark {step}")
    for sink in (metrics, events, evals):
        sink.close()
    writer.close()
    assert [r["step"] for r in lines_of(tmp_path / "metrics.jsonl")] == list(range(500))
    assert [e["step"] for e in lines_of(tmp_path / "events.jsonl")] == list(range(0, 500, 7))
    assert [e["step"] for e in lines_of(tmp_path / "evals.jsonl")] == list(range(0, 500, 50))
    assert done == [f"mark {s}" for s in range(0, 500, 100)]


def test_a_record_changed_after_it_was_handed_over_is_written_as_it_was(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    record = {"step": 1, "loss": 2.0}
    log.on_metrics(record)
    record["loss"] = 99.0  # a caller keeping decision.metrics may change it
    log.close()
    assert lines_of(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0}]


def test_close_writes_everything_and_joins_the_thread(tmp_path):
    before = writer_threads()
    guard, model = small_guard(tmp_path)
    for step in range(20):
        guard.step(loss_of(model, step))
        model.zero_grad()
    assert writer_threads() - before  # the guard's own writer runs
    guard.close()
    assert not writer_threads() - before
    assert [r["step"] for r in lines_of(tmp_path / "metrics.jsonl")] == list(range(20))
    assert lines_of(tmp_path / "events.jsonl")[-1]["kind"] == "run_closed"
    guard.close()  # a second close: nothing more


def test_the_context_manager_closes_the_writer(tmp_path):
    before = writer_threads()
    monitor = tg.Monitor(tg.GuardConfig(console=False), run_dir=tmp_path)
    with pytest.raises(RuntimeError), monitor:
        for step in range(30):
            monitor.observe(step, loss=2.0)
        raise RuntimeError("the training loop failed")
    assert not writer_threads() - before
    assert len(lines_of(tmp_path / "metrics.jsonl")) == 30


UNCLOSED = textwrap.dedent(
    """
    import sys
    import trainguard as tg
    monitor = tg.Monitor(tg.GuardConfig(console=False), run_dir=sys.argv[1])
    for step in range(25):
        monitor.observe(step, loss=2.0)
    """  # exits without close: the lines still waiting are written at exit
)


def test_an_unclosed_run_is_written_out_at_interpreter_exit(tmp_path):
    done = subprocess.run([sys.executable, "-c", UNCLOSED, str(tmp_path)], timeout=120)
    assert done.returncode == 0
    assert [r["step"] for r in lines_of(tmp_path / "metrics.jsonl")] == list(range(25))


class FailingFile(io.FileIO):
    """A file whose writes fail with `error` while it is set."""

    error: OSError | None = None

    def write(self, b: Any) -> int:
        if FailingFile.error is not None:
            raise FailingFile.error
        written = super().write(b)
        assert written is not None
        return written


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[threading.ExceptHookArgs]:
    """Exceptions that escaped any thread (none should)."""
    seen: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", seen.append)
    return seen


def test_a_write_error_on_the_thread_is_said_once_and_counted(tmp_path, monkeypatch, thread_errors):
    monkeypatch.setattr(line_file, "open_file", lambda fd, mode: FailingFile(fd, mode))
    monkeypatch.setattr(FailingFile, "error", OSError(errno.EACCES, os.strerror(errno.EACCES)))
    said: list[str] = []
    monitor = tg.Monitor(tg.GuardConfig(console=False), run_dir=tmp_path)
    path = tmp_path / "metrics.jsonl"
    (metrics,) = [s for s in monitor.sinks if isinstance(s, MetricsLog)]
    metrics.lines.report = said.append
    for step in range(30):
        monitor.observe(step, loss=2.0)
    assert metrics.dropped == 30
    assert said == [
        f"{path}: permission denied; dropping lines until it can be written again (1 so far)"
    ]
    FailingFile.error = None
    monitor.close()
    assert not thread_errors


def test_a_record_that_does_not_serialize_drops_the_file_with_one_line(tmp_path, thread_errors):
    said: list[str] = []
    log = MetricsLog(tmp_path / "metrics.jsonl", said.append)
    log.on_metrics({"step": 1})
    log.on_metrics({"step": 2, "loss": object()})
    log.on_metrics({"step": 3})
    log.close()
    assert [r["step"] for r in lines_of(tmp_path / "metrics.jsonl")] == [1]
    assert len(said) == 1 and said[0].startswith("the sink MetricsLog failed (TypeError: ")
    assert said[0].endswith("; it gets nothing more in this run, which goes on")
    assert not thread_errors


def test_a_write_that_raises_is_reported_by_the_writer(thread_errors):
    said: list[str] = []
    done: list[int] = []
    writer = LineWriter(said.append)

    def broken(record: Any, sync: bool) -> None:
        raise RuntimeError("broken")

    writer.put(broken, None)
    writer.put(lambda record, sync: done.append(record), 7)
    writer.close()
    assert said == ["a run file's line was not written (RuntimeError: broken)"]
    assert done == [7] and not thread_errors
    writer.put(lambda record, sync: done.append(record), 8)  # closed: written in place
    assert done == [7, 8]


def test_the_status_line_is_redrawn_at_most_four_times_a_second():
    now = [0.0]
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140, color_system="standard")
    sink = ConsoleSink(console, status=True, total_steps=1000, clock=lambda: now[0])
    assert sink.progress is not None
    updates: list[int] = []
    update = sink.progress.update

    def counted(task: Any, **fields: Any) -> None:
        updates.append(fields["completed"])
        update(task, **fields)

    sink.progress.update = counted  # type: ignore[method-assign]
    for step in range(100):  # 100 steps in 1 s
        now[0] = step / 100
        sink.on_metrics({"step": step, "loss": 2.0, "grad_norm": 1.0})
    assert updates == [1, 26, 51, 76]
    sink.on_event(Event(step=99, kind="nonfinite", severity="critical", message="the loss is nan"))
    assert "trainguard step 99 CRITICAL nonfinite" in out.getvalue()  # events at once
    sink.close()
    assert updates[-1] == 100  # the last record is shown at the end
