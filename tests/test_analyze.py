"""`trainguard analyze`: any loss log judged by the same detectors, with clear errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import trainguard as tg
from test_real_curves import CURVES
from trainguard.analysis import LogData, analyze, read_log, spike_score

from helpers import Ran, cli


def run(*args: str) -> Ran:
    """`trainguard analyze ARGS`, in this process (test_cli.py runs the console script)."""
    return cli("analyze", *args)


def test_a_real_run_with_spikes_exits_1_with_one_json_object():
    out = run(str(CURVES / "megatron-mixtral8x7b-release-v080.csv"), "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)  # exactly one JSON object on stdout
    spikes = [e["step"] for e in report["events"] if e["kind"] == "loss_spike"]
    assert 2675 in spikes and 3775 in spikes
    keys = {"step", "kind", "severity", "type", "message", "metrics", "source"}
    assert set(report["events"][0]) == keys and report["events"][0]["source"] == "analyze"
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
    out = run(str(log), "--json")  # the usual names are found without flags
    assert out.returncode == 0 and json.loads(out.stdout)["summary"]["steps"] == 200
    odd = tmp_path / "odd.tsv"
    odd.write_text(
        "\n".join(r.replace("iteration", "it").replace("train_loss", "nll") for r in rows)
    )
    refused = run(str(odd))
    assert refused.returncode == 2 and "no 'step' column (found: it, nll)" in refused.stderr
    out = run(str(odd), "--column", "nll", "--step-column", "it", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["summary"]["steps"] == 200


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("empty.csv", "", "is empty"),
        ("cols.csv", "a,b\n1,2\n", "no 'step' column"),
        ("words.csv", "step,loss\nx,y\n", "no row has a numeric step"),
        ("blob.bin", "\x00\x01\x02", "not a text log"),
        ("prose.txt", "hello\nthere\n", "no known log format matched; the formats are: "),
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
    lines[21] = "20,,1.0"  # no loss at all (a NaN loss is the run's, see below)
    lines += ["50,2.95,1.0", "5,2.99,1.0"]  # a repeated and an out-of-order step
    log.write_text("\n".join(lines) + "\n")
    data = read_log(log)
    assert "line 12, 22" in data.warnings[0]
    assert "steps go back or repeat" in data.warnings[1]
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
        "passed over 2 row(s) without a numeric step and loss: line 5002, 17002"
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


# -- non-finite values, a guarded run's own files, sparse logs (issue 17) ----------------------


def write_csv(path: Path, steps, losses, grads=None) -> Path:
    lines = ["step,loss" + (",grad_norm" if grads is not None else "")]
    for i, (s, v) in enumerate(zip(steps, losses, strict=True)):
        lines.append(f"{s},{v}" + (f",{grads[i]}" if grads is not None else ""))
    path.write_text("\n".join(lines) + "\n")
    return path


def write_jsonl(path: Path, steps, losses) -> Path:
    rows = [
        json.dumps({"step": int(s), "loss": v if np.isfinite(v) else str(v)})
        for s, v in zip(steps, losses, strict=True)
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def lm_curve(n: int, seed: int = 0, noise: float = 0.01) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return 2.0 + 3.0 / np.sqrt(1 + t / 50) + noise * rng.standard_normal(n)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_loss_that_turns_nan_is_a_critical_nonfinite_incident(tmp_path, suffix):
    loss = lm_curve(600)
    loss[300] = np.nan  # a single NaN
    loss[450:] = np.nan  # and the run dying
    loss[460] = np.inf
    writer = write_csv if suffix == ".csv" else write_jsonl
    log = writer(tmp_path / f"run{suffix}", range(600), loss)
    result = analyze(read_log(log))
    found = [e for e in result.events if e.kind == "nonfinite"]
    assert [e.step for e in found] == [300, 450]  # one event per stretch
    assert all(e.severity == "critical" for e in found)
    assert found[1].metrics["last_step"] == 599 and found[1].metrics["steps"] == 150
    assert result.summary["nonfinite_steps"] == 151
    out = run(str(log), "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert [e["step"] for e in report["events"] if e["kind"] == "nonfinite"] == [300, 450]
    assert report["summary"]["final_loss"] == pytest.approx(loss[449])
    assert report["summary"]["ends_nonfinite"] is True
    text = " ".join(run(str(log)).stdout.split())  # the console wraps its lines
    assert "600 steps (0..599" in text and "final loss NaN/Inf (the last finite one" in text
    sparse = writer(tmp_path / f"sparse{suffix}", range(0, 4000, 100), lm_curve(40))
    text = run(str(sparse)).stdout
    assert "40 logged points over steps (0..3900" in " ".join(text.split())


def test_a_log_that_is_nan_from_the_start_is_a_failed_run_not_bad_input(tmp_path):
    log = write_csv(tmp_path / "dead.csv", range(50), [float("nan")] * 50)
    out = run(str(log), "--json")
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    (event,) = [e for e in report["events"] if e["kind"] == "nonfinite"]
    assert event["step"] == 0 and event["severity"] == "critical"
    assert report["summary"]["final_loss"] is None
    text = run(str(log))
    assert text.returncode == 1 and "nonfinite" in text.stdout
    words = write_csv(tmp_path / "words.csv", range(5), ["x"] * 5)  # no number at all
    assert run(str(words)).returncode == 2


def test_an_inf_grad_norm_with_an_unmoved_loss_is_an_overflow_not_critical(tmp_path):
    loss = lm_curve(400)
    grads = np.ones(400)
    grads[200] = np.inf  # fp16 overflow: the scaler skipped the step, the loss did not move
    log = write_csv(tmp_path / "fp16.csv", range(400), loss, grads)
    result = analyze(read_log(log))
    assert [e.kind for e in result.events if e.step == 200] == ["fp16_overflow"]
    assert not result.incidents and run(str(log)).returncode == 0
    grads[250:290] = np.inf  # overflow on 40 steps in a row is no longer calibration
    log = write_csv(tmp_path / "fp16b.csv", range(400), loss, grads)
    result = analyze(read_log(log))
    assert any(e.kind == "nonfinite" and e.severity == "critical" for e in result.events)
    loss[330] = 3 * loss[329]  # an inf grad norm where the loss jumped is not an overflow
    grads[330] = np.inf
    log = write_csv(tmp_path / "fp16c.csv", range(400), loss, grads)
    result = analyze(read_log(log))
    assert any(e.kind == "nonfinite" and e.step == 330 for e in result.events)


def sparse_run(days: int, rise_from: int | None = None, flat: bool = False, seed: int = 1):
    """One point a day of a long run (about 2,400 steps a day): a power-law fall with a little
    noise, flat instead when `flat`, rising from day `rise_from` (a data-loader bug)."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, days + 1) * 2400
    if flat:
        loss = 2.3 + 0.002 * rng.standard_normal(days)
    else:
        loss = 1.9 + 2.0 / np.sqrt(1 + np.arange(days) / 2) + 0.004 * rng.standard_normal(days)
    if rise_from is not None:
        k = np.arange(days - rise_from)
        loss[rise_from:] = loss[rise_from - 1] * (1 + 0.06 * (k + 1))
    return steps, loss


@pytest.mark.parametrize("days", [30, 60, 200])
def test_a_healthy_sparse_log_is_healthy(tmp_path, days):
    steps, loss = sparse_run(days)
    result = analyze(read_log(write_csv(tmp_path / "daily.csv", steps, loss)))
    assert not result.incidents, [e.message for e in result.incidents]
    assert not [e for e in result.events if e.kind == "stall"]


@pytest.mark.parametrize("days", [30, 60, 200])
def test_a_three_day_rise_in_a_sparse_log_is_divergence(tmp_path, days):
    steps, loss = sparse_run(days, rise_from=days - 3)
    log = write_csv(tmp_path / "daily.csv", steps, loss)
    result = analyze(read_log(log))
    (event,) = [e for e in result.incidents if e.kind == "divergence"]
    assert event.step >= steps[days - 3] and event.severity == "critical"
    assert run(str(log)).returncode == 1


def test_three_points_rising_in_a_log_every_50_steps_are_no_divergence(tmp_path):
    """A point every 50 steps is not sparse: three of its points rising in a row, far over the
    noise, are a blip of 100 steps (a heavy-tailed loss makes them often), left to the trend
    test. The same three points a day apart are three days of a rising loss."""
    rng = np.random.default_rng(1)
    loss = (1e-4 + 1e-3 / np.sqrt(1 + np.arange(4000) / 10)) * (1 + 0.1 * rng.standard_normal(4000))
    loss[2000:2003] = loss[1990:2000].mean() * np.array([1.5, 2.2, 2.6])  # far over the noise
    every50 = analyze(read_log(write_csv(tmp_path / "every50.csv", np.arange(4000) * 50, loss)))
    assert not [e for e in every50.events if e.kind == "divergence"]
    assert [e.step for e in every50.incidents] == [100_050]  # a loss spike: it is back after
    daily = np.arange(1, 41) * 2400
    days = analyze(read_log(write_csv(tmp_path / "daily.csv", daily, loss[1970:2010])))
    assert [e.step for e in days.incidents if e.kind == "divergence"] == [daily[32]]


def test_a_flat_sparse_log_is_a_stall_only_when_truly_flat(tmp_path):
    steps, loss = sparse_run(60, flat=True)
    result = analyze(read_log(write_csv(tmp_path / "flat.csv", steps, loss)))
    (stall,) = [e for e in result.events if e.kind == "stall"]
    assert not result.incidents  # a stall is info
    assert result.summary["windows"]["stall"] == 20  # points: the message says what they span
    assert "over the last 20 logged points (steps 2400..48000)" in stall.message  # days 1..20


def guarded_run(run_dir: Path, nan_at: int = 120, steps: int = 200) -> None:
    """A small regression trained with a Guard on the CPU; its weights turn NaN at iteration
    `nan_at`, so three steps are non-finite and the guard rolls back to its step-100 snapshot
    and replays the steps after it."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    batches = []
    for i in range(steps + 200):
        x = torch.randn(32, 8, generator=g)
        batches.append((i, x, x @ w + 0.1 * torch.randn(32, 1, generator=g)))
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False), run_dir=run_dir)
    try:
        for it, (i, x, y) in enumerate(guard.batches(batches)):
            if guard.global_step >= steps:
                break
            if it == nan_at:
                with torch.no_grad():
                    model[2].weight.fill_(float("nan"))
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            guard.step(loss, batch_ids=[i])
            opt.zero_grad(set_to_none=True)
    finally:
        guard.close()


def test_a_guarded_runs_own_files_show_its_nan_and_rollback(tmp_path):
    guarded_run(tmp_path)
    recorded = [json.loads(line) for line in (tmp_path / "events.jsonl").open()]
    (rollback,) = [e for e in recorded if e["kind"] == "rollback"]
    nan_steps = [e["step"] for e in recorded if e["kind"] == "nonfinite"]
    assert nan_steps == [120, 121, 122] and rollback["metrics"]["to_step"] == 100
    rows = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").open()]
    replayed = sorted(s for s, n in Counter(rows).items() if n > 1)
    assert replayed == list(range(100, 123))  # from the snapshot's step to the rollback's
    for source in (tmp_path, tmp_path / "metrics.jsonl"):
        data = read_log(source)
        assert list(data.abandoned["step"]) == replayed
        assert np.isnan(data.abandoned["loss"][-3:]).all() and np.isfinite(data.loss).all()
        result = analyze(data)
        assert result.summary["recorded_events"] == len(recorded)
        assert result.summary["abandoned_steps"] == len(replayed)
        shown = [(e.step, e.kind, result.source(e)) for e in result.incidents]
        for step in nan_steps:
            assert (step, "nonfinite", "run") in shown
        assert (122, "rollback", "run") in shown
        # found again offline on the abandoned rows: the same incident as the recorded one
        assert [e.step for e in result.events if e.kind == "nonfinite"] == nan_steps
    cli = run(str(tmp_path), "--json")
    assert cli.returncode == 1, cli.stderr
    report = json.loads(cli.stdout)
    assert {e["source"] for e in report["events"]} <= {"run", "analyze"}
    assert {"nonfinite", "rollback"} <= {
        e["kind"] for e in report["events"] if e["source"] == "run"
    }
    text = run(str(tmp_path / "metrics.jsonl"))
    assert text.returncode == 1 and "undone by a rollback, or replaced on a restart" in text.stdout


def test_steps_a_rollback_abandoned_stay_visible(tmp_path):
    rows = [{"step": s, "loss": 3.0 - s * 1e-3, "action": "step"} for s in range(160)]
    rows[150] = {"step": 150, "loss": "nan", "action": "rollback"}
    rows += [{"step": s, "loss": 3.0 - s * 1e-3, "action": "step"} for s in range(101, 300)]
    log = tmp_path / "metrics.jsonl"  # no events.jsonl beside it: the rows alone tell
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = read_log(log)
    assert len(data.steps) == 300 and list(data.abandoned["step"]) == list(range(101, 160))
    result = analyze(data)
    (event,) = [e for e in result.events if e.kind == "nonfinite"]
    assert event.step == 150 and event.severity == "critical" and "abandoned" in event.message
    assert result.summary["abandoned_steps"] == 59
    assert run(str(log)).returncode == 1


def test_windows_follow_the_spacing_and_one_jump_is_no_sparse_divergence(tmp_path):
    dense = analyze(LogData(np.arange(10_000), lm_curve(10_000)))
    assert dense.summary["windows"] == {"stall": 2000, "divergence": 400, "oscillation": 200}
    every5 = analyze(LogData(np.arange(10_000) * 5, lm_curve(10_000)))
    assert every5.summary["windows"] == {"stall": 400, "divergence": 80, "oscillation": 40}
    short = analyze(LogData(np.arange(300), lm_curve(300)))  # no window longer than half of it
    assert short.summary["windows"] == {"stall": 150, "divergence": 150, "oscillation": 150}
    steps, loss = sparse_run(60)
    loss[40] *= 1.5  # one bad day, back the next
    loss[50:52] *= 1.3  # two
    result = analyze(read_log(write_csv(tmp_path / "daily.csv", steps, loss)))
    assert not [e for e in result.events if e.kind == "divergence"]
