"""`trainguard watch` against a process that writes a run as it goes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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
