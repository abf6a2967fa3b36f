"""`trainguard analyze`: any loss log judged by the same detectors, with clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trainguard as tg
from test_real_curves import CURVES
from trainguard.analysis import analyze, read_log, spike_score

EXE = shutil.which("trainguard", path=str(Path(sys.executable).parent))


def run(*args: str) -> subprocess.CompletedProcess[str]:
    assert EXE
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [EXE, "analyze", *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def test_a_real_run_with_spikes_exits_1_with_one_json_object():
    out = run(str(CURVES / "megatron-mixtral8x7b-release-v080.csv"), "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)  # exactly one JSON object on stdout
    spikes = [e["step"] for e in report["events"] if e["kind"] == "loss_spike"]
    assert 2675 in spikes and 3775 in spikes
    assert set(report["events"][0]) == {"step", "kind", "severity", "type", "message", "metrics"}
    assert report["summary"]["steps"] == 5162 and report["summary"]["incidents"] >= 2
    assert 0 < report["summary"]["spike_score"]["loss"] < 0.01


def test_a_healthy_run_exits_0():
    out = run(str(CURVES / "megatron-gpt3-15b-release-h100-dev.csv"))
    assert out.returncode == 0, out.stderr
    assert "healthy" in out.stdout


def test_trainguards_own_metrics_log(tmp_path):
    guard = tg.Guard(config=tg.GuardConfig(console=False), run_dir=tmp_path)
    for step in range(300):
        guard.observe(step, loss=9.0 if step == 200 else 3.0 - step * 1e-3, grad_norm=1.0)
    guard.close()
    result = analyze(read_log(tmp_path / "metrics.jsonl"))
    assert [e.step for e in result.events if e.kind == "loss_spike"] == [200]
    assert "grad_norm" in result.summary["spike_score"]


def test_tsv_with_other_column_names(tmp_path):
    log = tmp_path / "run.tsv"
    rows = ["iteration\ttrain_loss"] + [f"{i}\t{3.0 - i * 1e-3:.6f}" for i in range(200)]
    log.write_text("\n".join(rows) + "\n")
    assert run(str(log)).returncode == 2  # no 'step' column: named in the error
    out = run(str(log), "--column", "train_loss", "--step-column", "iteration", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["summary"]["steps"] == 200


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("empty.csv", "", "is empty"),
        ("cols.csv", "a,b\n1,2\n", "no 'step' column"),
        ("words.csv", "step,loss\nx,y\n", "no row has a numeric step"),
        ("blob.bin", "\x00\x01\x02", "unknown format"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, name, text, fragment):
    log = tmp_path / name
    log.write_text(text)
    out = run(str(log))
    assert out.returncode == 2 and fragment in out.stderr
    assert "Traceback" not in out.stderr
    assert run(str(tmp_path / "missing.csv")).returncode == 2


def test_bad_rows_are_passed_over_with_a_warning_naming_them(tmp_path):
    log = tmp_path / "messy.csv"
    lines = ["step,loss,grad_norm"] + [f"{i},{3.0 - i * 1e-3},1.0" for i in range(100)]
    lines[11] = "10,not-a-number,1.0"
    lines[21] = "20,nan,1.0"
    lines += ["50,2.95,1.0", "5,2.99,1.0"]  # a repeated and an out-of-order step
    log.write_text("\n".join(lines) + "\n")
    data = read_log(log)
    assert "line 12, 22" in data.warnings[0]
    assert "unsorted or repeated" in data.warnings[1]
    assert list(data.steps) == sorted(set(data.steps)) and len(data.steps) == 98
    out = run(str(log))
    assert out.returncode == 0 and "passed over 2 row(s)" in out.stderr


def test_spike_score_counts_six_sigma_points():
    rng = np.random.default_rng(0)
    values = 2.0 + 0.01 * rng.standard_normal(10_000)
    assert spike_score(values) < 1e-3
    values[[2000, 6000]] = 5.0
    assert spike_score(values) == pytest.approx(2 / (10_000 - 128), rel=0.3)


def test_blocks_of_a_large_file_keep_line_numbers_and_match_numpys_reader(tmp_path, monkeypatch):
    from trainguard.analysis import logs

    log = tmp_path / "big.csv"
    lines = ["step,loss,grad_norm,lr"]
    lines += [f"{i},{3.0 - i * 1e-5:.6f},{1 + (i % 7) / 10},3e-4" for i in range(20_000)]
    lines[5_001] = "5000,oops,1.0,3e-4"  # line 5002 of the file
    lines[17_001] = "17000,,1.0,3e-4"  # line 17002
    lines[9_001] = "9000,2.9,,3e-4"  # a missing grad norm is not a bad row
    log.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(logs, "BLOCK_BYTES", 4096)  # about 150 blocks, the bad rows in two
    data = read_log(log)
    assert len(data.steps) == 19_998 and data.steps[0] == 0 and data.steps[-1] == 19_999
    assert data.warnings == [
        "passed over 2 row(s) without a numeric step and finite loss: line 5002, 17002"
    ]
    assert np.isnan(data.extra["grad_norm"][list(data.steps).index(9000)])
    monkeypatch.setattr(logs, "USE_PANDAS", False)
    plain = read_log(log)
    assert np.array_equal(plain.steps, data.steps) and np.array_equal(plain.loss, data.loss)
    assert np.array_equal(plain.extra["lr"], data.extra["lr"])


def test_tensorboard_event_files_and_run_directories(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    curve = np.random.default_rng(1)
    writer = SummaryWriter(str(tmp_path / "tb"))
    for step in range(3000):
        loss = 3.0 / (1 + step / 300) + 0.01 * curve.standard_normal()
        writer.add_scalar("train/loss", loss + (4.0 if step == 2000 else 0.0), step)
        writer.add_scalar("train/grad_norm", 1.0, step)
        writer.add_scalar("eval/accuracy", 0.5, step)
    writer.close()
    data = read_log(tmp_path / "tb")
    assert len(data.steps) == 3000 and "grad_norm" in data.extra
    assert "train/loss" in data.warnings[0]
    result = analyze(data)
    assert [e.step for e in result.incidents] == [2000]
    out = run(str(tmp_path / "tb"), "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["events"][0]["step"] == 2000
    other = run(str(tmp_path / "tb"), "--tag", "eval/accuracy", "--json")
    assert other.returncode == 0, other.stderr
    missing = run(str(tmp_path / "tb"), "--tag", "val/loss")
    assert missing.returncode == 2 and "no TensorBoard scalar 'val/loss'" in missing.stderr
    assert "Traceback" not in missing.stderr
