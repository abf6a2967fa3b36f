"""`trainguard watch` against a process that writes a run as it goes."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from rich.console import Console

import trainguard as tg
from trainguard.analysis import RunWatcher
from trainguard.analysis.watch import sparkline

WRITER = textwrap.dedent(
    """
    import sys, time
    import trainguard as tg
    cfg = tg.GuardConfig(console=False, policy={"halt_on": ["loss_spike"]})
    guard = tg.Guard(config=cfg, run_dir=sys.argv[1])
    for step in range(150):
        guard.observe(step, loss=9.0 if step == 140 else 3.0 - step * 1e-3, grad_norm=1.0)
        time.sleep(0.02)
    guard.close()
    """
)


def test_watch_follows_a_writer_and_stops_when_the_run_halts(tmp_path):
    exe = shutil.which("trainguard", path=str(Path(sys.executable).parent))
    assert exe
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    try:
        start = time.monotonic()
        out = subprocess.run(
            [exe, "watch", str(tmp_path), "--refresh", "0.2", "--duration", "120"],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "COLUMNS": "160"},
            check=False,
        )
        elapsed = time.monotonic() - start
    finally:
        writer.wait(timeout=60)
    assert out.returncode == 0, out.stderr
    assert elapsed < 100  # it stopped at the halt, not at --duration
    final = out.stdout
    assert "step 140" in final and "halted" in final
    assert "loss_spike" in final and "halt" in final


def test_partial_lines_wait_for_their_end(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "loss": 2.0, "grad_norm": 1.0}\n{"step": 1, "lo'
    )
    watcher = RunWatcher(tmp_path)
    watcher.poll()
    assert watcher.step == 0 and list(watcher.loss) == [2.0]
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('ss": "nan", "grad_norm": 1.5}\n')
    watcher.poll()
    assert watcher.step == 1 and watcher.health == "ok"
    assert sparkline([1.0, 2.0, 3.0]) == "▁▄█"
    assert sparkline([1.0, float("nan")]).endswith("!")


def test_sparkline_of_values_near_the_float_limit():
    assert sparkline([-1.7e308, 0.0, 1.7e308]) == "▁▄█"


def watch_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`trainguard watch ARGS` as a user runs it; without --duration it must stop by itself."""
    exe = shutil.which("trainguard", path=str(Path(sys.executable).parent))
    assert exe
    return subprocess.run(
        [exe, "watch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )


def shown(watcher: RunWatcher) -> str:
    """The dashboard as a terminal shows it, as plain text."""
    console = Console(file=io.StringIO(), width=200)
    console.print(watcher.render())
    return console.file.getvalue()


def quiet_guard(run_dir: Path) -> tg.Guard:
    return tg.Guard(config=tg.GuardConfig(console=False), run_dir=run_dir)


def observe(guard: tg.Guard, steps: range, spike_at: int | None = None) -> None:
    for step in steps:
        guard.observe(step, loss=9.0 if step == spike_at else 3.0 - step * 1e-3, grad_norm=1.0)


def test_watch_waits_for_a_run_folder_that_does_not_exist_yet(tmp_path):
    missing = tmp_path / "not-yet"
    out = watch_cli(str(missing), "--refresh", "0.05", "--duration", "0.3")
    assert out.returncode == 0, out.stderr
    assert f"waiting for {missing} to appear" in out.stdout


def test_a_folder_that_appears_is_followed_to_the_end_of_its_run(tmp_path):
    run_dir = tmp_path / "run"
    watcher = RunWatcher(run_dir)
    watcher.poll()
    assert f"waiting for {run_dir} to appear" in shown(watcher)
    guard = quiet_guard(run_dir)
    watcher.poll()
    assert "waiting for the first step" in shown(watcher)
    observe(guard, range(40))
    watcher.poll()
    assert "step 39" in shown(watcher) and "healthy" in shown(watcher)
    assert not watcher.finished
    guard.close()
    watcher.poll()
    assert watcher.finished and "finished" in shown(watcher)


def test_health_is_back_to_healthy_after_a_quiet_stretch(tmp_path):
    guard = quiet_guard(tmp_path)
    watcher = RunWatcher(tmp_path, quiet_steps=50)
    observe(guard, range(90), spike_at=60)
    watcher.poll()
    assert watcher.health == "critical"
    assert "critical (incident at step 60)" in shown(watcher)
    observe(guard, range(90, 110))
    watcher.poll()
    assert watcher.health == "critical"  # step 109: 49 quiet steps
    observe(guard, range(110, 111))
    watcher.poll()
    assert watcher.health == "ok"
    assert "healthy (last incident at step 60)" in shown(watcher)
    assert "loss_spike" in shown(watcher)  # the incident stays listed
    guard.close()


def test_a_new_run_in_the_folder_of_a_closed_one_is_not_finished(tmp_path):
    first = quiet_guard(tmp_path)
    observe(first, range(20))
    first.close()
    second = quiet_guard(tmp_path)  # holds the folder's lock: a live writer
    watcher = RunWatcher(tmp_path)
    watcher.poll()
    assert not watcher.finished and "finished" not in shown(watcher)
    second.close()
    watcher.poll()
    assert watcher.finished


KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import trainguard as tg
    guard = tg.Guard(config=tg.GuardConfig(console=False), run_dir=sys.argv[1])
    for step in range(30):
        guard.observe(step, loss=3.0, grad_norm=1.0)
    guard.flush()  # lines reach the disk within a second: a kill at once would lose the last
    os.kill(os.getpid(), signal.SIGKILL)  # no close
    """
)


def test_a_run_killed_without_close_is_not_finished_and_its_files_go_stale(tmp_path):
    killed = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    later = RunWatcher(tmp_path, clock=lambda: time.time() + 300)
    later.poll()
    assert not later.finished and not later.halted
    text = shown(later)
    assert "step 29" in text and "finished" not in text
    assert f"its writer (pid {killed_pid(tmp_path)}) exited without closing the run" in text
    assert "no new data for 5 min" in text


def killed_pid(run_dir: Path) -> int:
    pid = json.loads((run_dir / ".lock").read_text())["pid"]
    assert isinstance(pid, int)
    return pid


def test_watch_stops_by_itself_when_the_run_closes(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", CLOSES, str(tmp_path)])
    try:
        out = watch_cli(str(tmp_path), "--refresh", "0.1")  # no --duration: until it closes
    finally:
        writer.wait(timeout=60)
    assert out.returncode == 0, out.stderr
    assert "step 79" in out.stdout and "finished" in out.stdout
    lines = out.stdout.splitlines()  # piped: plain lines, the last one the final state
    assert lines and lines[-1].startswith("step 79 ") and lines[-1].endswith("finished")
    assert "\x1b" not in out.stdout and "╭" not in out.stdout  # no redrawn panel


def test_watch_to_a_pipe_prints_each_incident_once_as_a_line(tmp_path):
    guard = quiet_guard(tmp_path)
    observe(guard, range(120), spike_at=100)
    guard.close()
    out = watch_cli(str(tmp_path), "--refresh", "0.05", "--duration", "0.3")
    assert out.returncode == 0, out.stderr
    spikes = [line for line in out.stdout.splitlines() if "loss_spike" in line]
    assert len(spikes) == 1 and spikes[0].startswith("step 100: loss_spike (")
    assert out.stdout.splitlines()[-1].startswith("step 119 ")


CLOSES = textwrap.dedent(
    """
    import sys, time
    import trainguard as tg
    with tg.Guard(config=tg.GuardConfig(console=False), run_dir=sys.argv[1]) as guard:
        for step in range(80):
            guard.observe(step, loss=3.0 - step * 1e-3, grad_norm=1.0)
            time.sleep(0.01)
    """
)
