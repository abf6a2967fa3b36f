"""benchmarks/gpu.py, the device check of issues 35 and 36, runs its smoke mode on the CPU: every
section reports, none fails, so a session with a GPU can spend its minutes measuring rather than
fixing. Off a GPU the guard with defaults is forced onto the lagged path (auto keeps the CPU
synchronous); the CPU's fused AdamW honours found_inf, so both paths run there."""

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
    assert counts == {
        "device": 0,
        "event": 0,
        "stream": 0,
        "other_threads": 0,
        "lagged_reads": 0,
        "lagged_wait": 0,
    }
    assert gpu.LaggedReads is not None and gpu.LaggedReads.read is not counts  # restored


def test_block_orders_put_each_variant_first_and_last_alike():
    orders = gpu.block_orders(["plain", "sync", "default"], 6)
    assert [o[0] for o in orders] == ["plain", "sync", "default", "default", "plain", "sync"]
    assert [o[-1] for o in orders] == ["default", "plain", "sync", "plain", "sync", "default"]
    assert gpu.block_orders(["plain", "guard"], 4) == [["plain", "guard"], ["guard", "plain"]] * 2


@pytest.mark.slow(
    "the GPU benchmark's every section (sizes, syncs, snapshots, checkpoints, faults on both "
    "paths) on tiny models on the CPU"
)
def test_smoke_run_reports_every_section(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["gpu.py", "--smoke", "--device", "cpu", "--sizes", "19M", "--steps", "10"]
    monkeypatch.setattr(sys, "argv", argv)
    gpu.main()
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["errors"] == {}
    overhead = result["overhead"]["19M"]
    assert overhead["steps_per_variant"] == 10
    assert overhead["variants"] == ["plain", "default", "sync"]
    guards = overhead["guards"]
    assert guards["default"]["hot_path"] == "lagged" and guards["sync"]["hot_path"] == "sync"
    for guard in guards.values():
        assert guard["guard_actions"] == {"step": 16}  # 6 warm-up and 10 measured, each judged
        assert guard["snapshots_detected_by"] == "ring"
        assert guard["target_ratio"] == 1.02 and isinstance(guard["target_ratio_met"], bool)
    # mid-block: the synchronous path takes the snapshot of step 10 in call 9, the lagged one
    # in call 10 (where it judges step 9)
    snapshots = guards["sync"]["snapshots_measured"]
    assert [(r["snapshot_step"], r["call"]) for r in snapshots] == [(10, 9)]
    snapshots = guards["default"]["snapshots_measured"]
    assert [(r["snapshot_step"], r["call"]) for r in snapshots] == [(10, 10)]
    assert result["snapshot"]["worst_blocked_s"] is not None
    assert result["snapshot"]["hot_path"] == "lagged"
    checkpoints = result["checkpoints"]
    assert checkpoints["saved_steps"] == [10, 20]
    assert [(r["checkpoint_step"], r["call"]) for r in checkpoints["checkpoints"]] == [
        (10, 9),
        (20, 19),
    ]
    assert all(r["on_disk"] and r["blocked_s"] is not None for r in checkpoints["checkpoints"])
    paths = result["syncs"]["paths"]
    assert paths["sync"]["hot_path"] == "sync" and paths["lagged"]["hot_path"] == "lagged"
    summary = paths["sync"]["summary"]
    assert summary["snapshot"]["steps"] == 2 and summary["checkpoint"]["steps"] == 1
    assert summary["ordinary"]["device"] == {"mean": 0.0, "max": 0}  # no CUDA, no waits
    assert summary["ordinary"]["syncs"] is None  # set_sync_debug_mode needs CUDA
    assert summary["ordinary"]["lagged_reads"] == {"mean": 0.0, "max": 0}
    lagged = paths["lagged"]["summary"]
    assert lagged["snapshot"]["steps"] == 1 and lagged["checkpoint"]["steps"] == 1
    assert lagged["ordinary"]["steps"] > 10 and lagged["sampled"]["steps"] > 0
    assert lagged["ordinary"]["lagged_reads"] == {"mean": 1.0, "max": 1}  # the step before's
    assert lagged["ordinary"]["lagged_wait"] == {"mean": 0.0, "max": 0}  # no event off CUDA
    assert paths["lagged"]["flush"]["lagged_reads"] == 1  # the last step, judged by flush()
    assert [c["call"] for c in paths["lagged"]["checkpoints_taken"]] == [25]
    assert [c["call"] for c in paths["sync"]["checkpoints_taken"]] == [24]
    assert result["syncs"]["target_lagged_ordinary_zero"] is None  # not counted off CUDA
    faults = result["faults"]
    assert faults["identical_actions"] is True and faults["weights_bitwise_equal"] is True
    rows = {r["fault"]: r for r in faults["faults"]}
    assert list(rows) == ["clean", "NaN batch", "LR x100 burst", "toxic batch", "corrupted weights"]
    assert not rows["clean"]["acted_on"]
    for name, row in rows.items():  # both paths acted, and alike: the comparison has teeth
        assert row["sync"]["actions"] == row["lagged"]["actions"], name
        assert row["sync"]["hot_path"] == "sync" and row["lagged"]["hot_path"] == "lagged"
        assert row["acted_on"] or name == "clean", name
    rolled_back = [
        name
        for name, row in rows.items()
        if ["rollback"] in [a[1:] for a in row["sync"]["actions"]]
    ]
    assert rolled_back, "no rollback: the lagged path's undone call is not exercised"
    targets = result["targets"]
    assert targets["faults: identical actions on both paths"] is True
    md = (tmp_path / "gpu.md").read_text()
    assert "Targets:" in md and "Faults on the device" in md and "| lagged | ordinary |" in md
