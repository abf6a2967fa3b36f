"""Side services never stop a run: logs on a full disk (a real 8 MiB tmpfs when the tests run as
root, a file wrapper that runs out of space otherwise), a busy Prometheus port (a real socket
holds it), and the run-folder lock (a second writer, a SIGKILLed holder, NFS without locks)."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard import line_file, run_lock
from trainguard.actions.quarantine import Quarantine
from trainguard.events import Event
from trainguard.sinks import EventLog, MetricsLog
from trainguard.sinks.prometheus import PrometheusSink
from trainguard.sinks.tensorboard import TensorBoardSink

from helpers import TmpfsDisk, read_jsonl

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# -- disks that fill up ---------------------------------------------------------------------------
class WrapperDisk:
    """Files that trainguard.line_file opens write into `room` bytes, then fail with ENOSPC (a
    write that does not fit is written in part first, as a real disk does)."""

    kind = "wrapper"

    def __init__(self, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = directory
        self.dir.mkdir()
        self.room = math.inf
        disk = self

        class LimitedFile(io.FileIO):
            def write(self, b: Any) -> int:
                data = bytes(b)
                if disk.room <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written = super().write(data[: int(min(disk.room, len(data)))])
                assert written is not None
                disk.room -= written
                return written

        monkeypatch.setattr(line_file, "open_file", lambda path, mode: LimitedFile(path, mode))

    def fill(self) -> None:
        self.room = 150  # about one more line, then half of one

    def free(self) -> None:
        self.room = math.inf


@pytest.fixture(params=["tmpfs", "wrapper"])
def disk(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[WrapperDisk | TmpfsDisk]:
    """A disk to fill: [tmpfs] is a real tmpfs where it can be mounted (root), else the
    wrapper."""
    monkeypatch.setattr(line_file, "RETRY_S", 0.0)  # every write tries the disk again
    if request.param == "tmpfs":
        tmpfs = TmpfsDisk.mount(tmp_path / "tmpfs")
        if tmpfs is not None:
            yield tmpfs
            tmpfs.unmount()
            return
    yield WrapperDisk(tmp_path / "disk", monkeypatch)


def record(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 2.0 + step / 1000, "grad_norm": 0.5, "note": "x" * 50}


def whole_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of `path`, which must end on a whole line."""
    text = path.read_bytes()
    assert text == b"" or text.endswith(b"\n"), text[-80:]
    return [json.loads(line) for line in text.splitlines()]


# -- logs on a full disk ---------------------------------------------------------------------------
def test_metrics_log_on_a_full_disk_drops_counts_and_resumes(disk):
    said: list[str] = []
    path = disk.dir / "metrics.jsonl"
    log = MetricsLog(path, said.append)
    for step in range(10):
        log.on_metrics(record(step))
    log.flush()  # written on a thread: on the disk before it fills
    disk.fill()
    for step in range(10, 400):  # 40 kB: past any page left half used
        log.on_metrics(record(step))
    assert log.dropped > 0
    assert said == [
        f"{path}: no space left on device; dropping lines until it can be written again (1 so far)"
    ]
    assert len(whole_lines(path)) == 400 - log.dropped
    disk.free()
    for step in range(400, 405):
        log.on_metrics(record(step))
    log.flush()
    assert said[1:] == [
        f"{path}: written again; {log.dropped} line(s) were dropped while it could not be"
    ]
    log.close()
    steps = [r["step"] for r in whole_lines(path)]
    assert steps[:10] == list(range(10)) and steps[-5:] == list(range(400, 405))
    assert steps == sorted(steps) and len(steps) == 405 - log.dropped
    assert len(said) == 2


def test_event_log_on_a_full_disk_closes_without_raising(disk):
    said: list[str] = []
    path = disk.dir / "events.jsonl"
    log = EventLog(path, said.append)
    log.on_event(Event(step=1, kind="nonfinite", severity="critical", message="nan"))
    disk.fill()
    for step in range(2, 300):  # critical: each one fsync'd
        log.on_event(Event(step=step, kind="nonfinite", severity="critical", message="n" * 80))
    log.close()
    assert log.dropped > 0
    assert [m for m in said if "no space left on device" in m] == [said[0]]
    assert said[-1] == (
        f"{path}: closed with {log.dropped} line(s) dropped since it last failed "
        f"({log.dropped} in all)"
    )
    events = whole_lines(path)
    assert events[0]["step"] == 1 and len(events) == 299 - log.dropped


def tiny_run(run_dir: Path, **config: Any) -> tuple[tg.Guard, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = tg.GuardConfig.from_dict(
        {"console": False, "recovery": {"checkpoint_every": 0}, **config}
    )
    return tg.Guard(model, opt, config=cfg, run_dir=run_dir), model, opt


def train(guard: tg.Guard, model: nn.Module, opt: Any, steps: int, nan_at: int = -1) -> None:
    g = torch.Generator().manual_seed(guard.global_step)
    for call in range(steps):
        x = torch.randn(256, 4, generator=g)
        y = x[:, :1] + 0.5 * torch.randn(256, 1, generator=g)  # noise keeps the loss level
        loss = nn.functional.mse_loss(model(x), y)
        if call == nan_at:
            loss = loss * float("nan")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        guard.step(loss)


def test_a_guard_trains_through_a_full_disk(disk, capsys):
    guard, model, opt = tiny_run(disk.dir)
    train(guard, model, opt, 20)
    guard.flush()  # written on a thread: on the disk before it fills
    disk.fill()
    train(guard, model, opt, 300, nan_at=100)  # an event while the disk is full
    guard.flush()
    disk.free()
    train(guard, model, opt, 20)
    guard.close()
    err = capsys.readouterr().err
    path = disk.dir / "metrics.jsonl"
    assert err.count(f"{path}: no space left on device; dropping lines") == 1
    assert err.count(f"{path}: written again;") == 1
    (metrics,) = [s for s in guard.sinks if isinstance(s, MetricsLog)]
    assert metrics.dropped > 0
    steps = [r["step"] for r in whole_lines(path)]
    assert steps[:20] == list(range(20)) and steps[-20:] == list(range(320, 340))
    assert len(steps) == 340 - metrics.dropped
    assert all(isinstance(e["step"], int) for e in whole_lines(disk.dir / "events.jsonl"))
    assert guard.action_counts["skip"] == 1


def test_a_guard_starts_on_a_full_disk_and_keeps_the_old_config(disk, capsys):
    first, model, opt = tiny_run(disk.dir)
    train(first, model, opt, 5)
    first.close()
    before = (disk.dir / "config.json").read_text()
    disk.fill()
    guard, model, opt = tiny_run(disk.dir, log_every=2)
    train(guard, model, opt, 200)
    guard.flush()
    err = capsys.readouterr().err
    assert f"cannot write {disk.dir / 'config.json'} (no space left on device); the run" in err
    assert (disk.dir / "config.json").read_text() == before  # whole, the first run's
    assert not [p for p in disk.dir.iterdir() if ".tmp-" in p.name]
    disk.free()
    train(guard, model, opt, 4)
    guard.close()
    assert [r["step"] for r in whole_lines(disk.dir / "metrics.jsonl")][-2:] == [200, 202]


def test_quarantine_records_the_disk_refuses_are_kept_in_memory(disk):
    said: list[str] = []
    path = disk.dir / "quarantine.jsonl"
    quarantine = Quarantine(path, said.append)
    disk.fill()
    if disk.kind == "wrapper":
        disk.room = 0
    quarantine.add(5, "loss spike", 9.0, ["b5"])
    quarantine.add(6, "loss spike", 9.5, ["b6"])
    assert quarantine.unwritten == 2 and quarantine.contains(["b5"])
    assert len(said) == 1 and "keeping its lines in memory" in said[0]
    assert "a restarted one would not" in said[0]
    disk.free()
    quarantine.add(7, "loss spike", 9.9, ["b7"])
    assert quarantine.unwritten == 0
    assert said[1] == f"{path}: written again, with the lines kept in memory"
    assert [r["batch_ids"] for r in whole_lines(path)] == [["b5"], ["b6"], ["b7"]]
    assert Quarantine(path).contains(["b6"])  # a restarted run honours them
    disk.fill()
    if disk.kind == "wrapper":
        disk.room = 0
    for step in range(8, 200):  # past the page the file already has
        quarantine.add(step, "loss spike", 9.9, [f"b{step}"])
        if quarantine.unwritten:
            break
    quarantine.close()
    assert "closed with 1 line(s) kept in memory and never written" in said[-1]
    assert len(whole_lines(path)) == 3 + (step - 8)


def test_a_torn_last_line_is_cut_off_when_a_log_is_opened(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    said: list[str] = []
    log = MetricsLog(path, said.append)
    log.on_metrics({"step": 3})
    log.close()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert said == [f"{path}: cut off a torn last line (4 bytes)"]


class FlakyFile(io.FileIO):
    """A file whose writes fail with `error` while it is set."""

    error: OSError | None = None

    def write(self, b: Any) -> int:
        if FlakyFile.error is not None:
            raise FlakyFile.error
        written = super().write(b)
        assert written is not None
        return written


def test_a_write_error_other_than_enospc_is_dropped_too(tmp_path, monkeypatch):
    monkeypatch.setattr(line_file, "open_file", lambda path, mode: FlakyFile(path, mode))
    monkeypatch.setattr(FlakyFile, "error", None)
    said: list[str] = []
    log = MetricsLog(tmp_path / "metrics.jsonl", said.append)
    now = [0.0]
    log.lines.clock = lambda: now[0]
    log.on_metrics({"step": 1})
    log.flush()  # each written on the thread before the file changes
    FlakyFile.error = OSError(errno.EIO, os.strerror(errno.EIO))
    log.on_metrics({"step": 2})
    log.flush()
    FlakyFile.error = None
    now[0] = 1.0
    log.on_metrics({"step": 3})  # before its retry time: counted, the disk is not tried
    log.flush()
    now[0] = line_file.RETRY_S
    log.on_metrics({"step": 4})
    log.flush()
    assert log.dropped == 2 and "input/output error; dropping lines" in said[0]
    assert said[1].endswith("written again; 2 line(s) were dropped while it could not be")
    log.close()
    assert [r["step"] for r in whole_lines(tmp_path / "metrics.jsonl")] == [1, 4]


class FailingWriter:
    """A TensorBoard writer whose background thread hit a full disk."""

    made = 0

    def __init__(self, log_dir: str) -> None:
        FailingWriter.made += 1
        self.fail = FailingWriter.made == 1
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.fail:
            raise ENOSPC
        self.scalars.append((tag, value, step))

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.add_scalar(tag, 0.0, step)

    def close(self) -> None:
        if self.fail:
            raise ENOSPC


def test_a_failing_tensorboard_writer_is_reported_once_and_replaced_later(tmp_path):
    said: list[str] = []
    now = [0.0]
    FailingWriter.made = 0
    sink = TensorBoardSink(
        tmp_path, said.append, retry_s=60.0, clock=lambda: now[0], make_writer=FailingWriter
    )
    for step in range(5):
        sink.on_metrics({"step": step, "loss": 1.0})
    sink.on_event(Event(step=3, kind="nonfinite", severity="critical", message="nan"))
    assert sink.dropped == 6 and FailingWriter.made == 1
    assert len(said) == 1 and "failed (no space left on device)" in said[0]
    now[0] = 61.0
    sink.on_metrics({"step": 9, "loss": 1.0})
    assert sink.writer.scalars == [("train/loss", 1.0, 9)]
    assert said[1].endswith("works again (6 record(s) dropped so far)")
    sink.close()


# -- Prometheus ------------------------------------------------------------------------------------
def observe(guard: tg.Guard, steps: int) -> None:
    for step in range(steps):
        guard.observe(step, loss=2.0 - step / 100)


def test_a_busy_prometheus_port_is_a_warning_and_the_run_goes_on(tmp_path, capsys):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        config = tg.GuardConfig.from_dict({"console": False, "alerts": {"prometheus_port": port}})
        guard = tg.Guard(config=config, run_dir=tmp_path)
        observe(guard, 30)
        guard.close()
    finally:
        holder.close()
    assert not [s for s in guard.sinks if isinstance(s, PrometheusSink)]
    err = capsys.readouterr().err
    assert err.count("cannot serve Prometheus") == 1
    assert (
        f"cannot serve Prometheus /metrics on 127.0.0.1:{port} (address already in use); the "
        "run goes on without it: set alerts.prometheus_port to another port, or 0 for a free one"
    ) in err
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 30


def test_prometheus_listens_on_localhost_unless_told(capsys):
    import httpx

    local = tg.Guard(config=tg.GuardConfig(console=False, alerts={"prometheus_port": 0}))
    (sink,) = [s for s in local.sinks if isinstance(s, PrometheusSink)]
    assert sink.server.server_address[0] == "127.0.0.1"
    observe(local, 3)
    text = httpx.get(f"http://127.0.0.1:{sink.port}/metrics", timeout=5).text
    assert "trainguard_step 2.0" in text
    local.close()
    assert f"serving Prometheus /metrics at http://127.0.0.1:{sink.port}/metrics" in (
        capsys.readouterr().err
    )
    config = tg.GuardConfig(
        console=False, alerts={"prometheus_port": 0, "prometheus_addr": "0.0.0.0"}
    )
    everywhere = tg.Guard(config=config)
    (sink,) = [s for s in everywhere.sinks if isinstance(s, PrometheusSink)]
    everywhere.close()
    assert sink.server.server_address[0] == "0.0.0.0"


def test_an_address_not_on_this_host_names_the_addr_setting(capsys):
    config = tg.GuardConfig(
        console=False, alerts={"prometheus_port": 0, "prometheus_addr": "192.0.2.7"}
    )
    guard = tg.Guard(config=config)
    guard.close()
    assert not [s for s in guard.sinks if isinstance(s, PrometheusSink)]
    err = capsys.readouterr().err
    assert "cannot serve Prometheus /metrics on 192.0.2.7:0 (" in err
    assert "set alerts.prometheus_addr to an address of this host" in err


# -- the run-folder lock ---------------------------------------------------------------------------
def quiet_guard(run_dir: Path) -> tg.Guard:
    return tg.Guard(config=tg.GuardConfig(console=False), run_dir=run_dir)


def test_a_second_guard_on_a_run_dir_gets_a_clear_error_until_the_first_closes(tmp_path):
    first = quiet_guard(tmp_path)
    holder = json.loads((tmp_path / ".lock").read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(tg.TrainguardError, match="in use by another Guard in this process") as e:
        quiet_guard(tmp_path)
    assert "close that one first" in str(e.value) and str(tmp_path) in str(e.value)
    observe(first, 5)  # the first one is untouched
    first.close()
    assert (tmp_path / ".lock").read_text() == ""
    second = quiet_guard(tmp_path)
    second.close()
    model = nn.Linear(2, 1)
    resumed = tg.Guard.resume(
        tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), config=second.config
    )
    resumed.close()
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 5


def test_a_guard_nobody_refers_to_gives_up_its_lock(tmp_path):
    lost = quiet_guard(tmp_path)
    lost.cycle = lost  # freed only by the garbage collector
    del lost
    quiet_guard(tmp_path).close()


def test_a_sink_that_cannot_start_leaves_the_run_dir_free(tmp_path):
    bad = tg.GuardConfig(console=False, alerts={"email": {"host": "smtp.example.com"}})
    with pytest.raises(tg.TrainguardError, match=r"alerts\.email\.to"):
        tg.Guard(config=bad, run_dir=tmp_path)
    quiet_guard(tmp_path).close()


HOLDER = """
import os, sys, time
import trainguard as tg
guard = tg.Guard(config=tg.GuardConfig(console=False), run_dir=sys.argv[1])
if sys.argv[2] == "fork":  # a child that outlives its parent must not keep the lock
    child = os.fork()
    if child == 0:
        time.sleep(120)
        os._exit(0)
    print(child, flush=True)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("how", ["alone", "fork"])
def test_the_lock_of_a_sigkilled_run_is_taken_over(tmp_path, how):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), how], stdout=subprocess.PIPE, text=True
    )
    child = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if how == "fork":
            child = int(line)
            line = proc.stdout.readline().strip()
        assert line == "ready"
        with pytest.raises(tg.TrainguardError) as e:
            quiet_guard(tmp_path)
        assert f"{tmp_path} is in use by another trainguard run (pid {proc.pid} on host " in str(
            e.value
        )
        assert str(e.value).endswith("give each run its own run_dir, or stop the other one")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        guard = quiet_guard(tmp_path)  # the kernel dropped the lock with its process
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
        guard.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if child is not None:
            os.kill(child, signal.SIGKILL)


def test_a_file_system_without_locks_is_a_warning(tmp_path, monkeypatch, capsys):
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    guard = quiet_guard(tmp_path)
    observe(guard, 3)
    guard.close()
    assert guard.run_lock is None
    err = capsys.readouterr().err
    assert err.count("cannot lock") == 1
    assert "the run goes on without a lock: make sure no other run writes to" in err
