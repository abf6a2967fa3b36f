"""benchmarks/gpu.py, the device check of issue 35, runs its smoke mode on the CPU: every section
reports, none fails, so a session with a GPU can spend its minutes measuring rather than fixing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu


def test_blocked_is_three_steps_over_the_median():
    times = [0.1, 0.1, 0.5, 0.3, 0.1]
    assert gpu.blocked(times, 2, 0.1) == pytest.approx(0.1 + 0.5 + 0.3 - 0.3)
    assert gpu.blocked(times, 0, 0.1) is None  # no step before it
    assert gpu.blocked(times, 4, 0.1) is None  # none after it


def test_waits_are_counted_and_the_originals_restored():
    original = torch.cuda.synchronize
    waits = gpu.Waits()
    with waits.counting() as counts:
        assert torch.cuda.synchronize is not original
    assert torch.cuda.synchronize is original
    assert counts == {"device": 0, "event": 0, "stream": 0, "other_threads": 0}


def test_smoke_run_reports_every_section(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["gpu.py", "--smoke", "--device", "cpu", "--sizes", "19M", "--steps", "10"]
    monkeypatch.setattr(sys, "argv", argv)
    gpu.main()
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["errors"] == {}
    overhead = result["overhead"]["19M"]
    assert overhead["steps_per_variant"] == 10
    assert overhead["snapshots_detected_by"] == "ring"
    snapshots = overhead["snapshots_measured"]
    assert [(r["snapshot_step"], r["call"]) for r in snapshots] == [(10, 9)]  # mid-block
    assert result["snapshot"]["worst_blocked_s"] is not None
    checkpoints = result["checkpoints"]
    assert checkpoints["saved_steps"] == [10, 20]
    assert [(r["checkpoint_step"], r["call"]) for r in checkpoints["checkpoints"]] == [
        (10, 9),
        (20, 19),
    ]
    assert all(r["on_disk"] and r["blocked_s"] is not None for r in checkpoints["checkpoints"])
    summary = result["syncs"]["summary"]
    assert summary["snapshot"]["steps"] == 2 and summary["checkpoint"]["steps"] == 1
    assert summary["ordinary"]["device"] == {"mean": 0.0, "max": 0}  # no CUDA, no waits
    assert summary["ordinary"]["syncs"] is None  # set_sync_debug_mode needs CUDA
    assert "Targets:" in (tmp_path / "gpu.md").read_text()
