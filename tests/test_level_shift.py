"""Level shifts and the logs of every length and density: a loss that steps up and stays (at a
restart or anywhere), a short run whose loss multiplies and freezes, a daily log's jump and
climb, and a NaN only the grad-norm column shows; healthy short and sparse logs stay quiet."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainguard.analysis import LogData, analyze, read_log
from trainguard.detectors.level_shift import level_shifts


def incidents(
    steps: np.ndarray, loss: np.ndarray, **extra: np.ndarray
) -> list[tuple[int, str, str]]:
    data = LogData(np.asarray(steps, dtype=np.int64), np.asarray(loss, dtype=np.float64), extra)
    return [(e.step, e.kind, e.severity) for e in analyze(data).incidents]


def preempted_log(path: Path, jumps: list[float], noise: float, seed: int = 0) -> Path:
    """A run preempted at steps 1000, 2000, ...: each resume replays the last 37 steps from its
    checkpoint (the log's steps go back) and its loss comes back `jumps[k]` nats higher."""
    rng = np.random.default_rng(seed)
    rows: list[str] = []
    offset, step = 0.0, 0
    for k, end in enumerate(
        [1000 * (i + 1) for i in range(len(jumps))] + [1000 * (len(jumps) + 1)]
    ):
        while step < end:
            loss = 2.5 + 3 / np.sqrt(1 + step / 100) + offset + noise * rng.standard_normal()
            rows.append(f"{step},{loss:.5f}\n")
            step += 1
        if k < len(jumps):
            step, offset = end - 37, offset + jumps[k]
    path.write_text("step,loss\n" + "".join(rows))
    return path


def test_a_resume_whose_loss_steps_up_and_stays_is_an_incident_at_the_restart(tmp_path):
    # jumps of 0.55 and 0.6 nats against a per-step noise of 0.5 nats: each single step is
    # within the noise, the level is not
    log = preempted_log(tmp_path / "run.csv", [0.55, 0.0, 0.6, -0.3, 0.5], noise=0.5)
    result = analyze(read_log(log))
    shifts = [e for e in result.incidents if e.kind == "level_shift"]
    assert [e.step for e in shifts] == [963, 2963, 4963]  # the steps each replay began at
    for e in shifts:
        assert e.severity == "warning" and e.metrics["at_restart"]
        assert 0.35 < e.metrics["shift"] < 0.8 and e.metrics["shift_sigmas"] > 0.5
        assert e.metrics["points"] >= 100 and "at a restart" in e.message
    assert shifts[-1].metrics["still_up"]


def test_resumes_at_the_same_or_a_lower_level_raise_nothing(tmp_path):
    for k, jumps in enumerate(([0.0] * 5, [-0.2, 0.0, -0.1, 0.0, -0.3])):
        log = preempted_log(tmp_path / f"run{k}.csv", jumps, noise=0.25, seed=k)
        assert analyze(read_log(log)).incidents == []


def test_a_step_up_without_a_restart_is_found_at_its_step_and_sized():
    rng = np.random.default_rng(1)
    t = np.arange(5000)
    loss = 3.0 + 4 / np.sqrt(1 + t / 50) + 0.08 * rng.standard_normal(len(t))
    for at in (1000, 2000, 3000, 4000):
        loss[at:] += 0.55 * np.exp(-(t[at:] - at) / 3000.0)  # a lasting step, slowly healed
    events = level_shifts(t, loss)
    assert [e.step for e in events] == [1000, 2000, 3000, 4000]
    assert all(e.severity == "warning" and not e.metrics["at_restart"] for e in events)
    assert all(0.4 < e.metrics["shift"] < 0.6 and e.metrics["shift_sigmas"] > 4 for e in events)


def test_a_warm_restart_of_the_lr_lifts_the_loss_without_a_level_shift():
    rng = np.random.default_rng(2)
    t = np.arange(4000)
    lr = np.where(t < 2000, 3e-4 * (1 - t / 2000) + 1e-5, 3e-4)
    loss = 2.5 + 3 / np.sqrt(1 + t / 100) + 0.02 * rng.standard_normal(len(t))
    loss[2000:] += 0.3 * np.exp(-(t[2000:] - 2000) / 800)  # the restart's lift
    assert level_shifts(t, loss) != []  # without the LR it reads as a step up
    assert level_shifts(t, loss, lr) == []


def test_a_short_fine_tune_whose_loss_multiplies_and_freezes_is_critical(tmp_path):
    # a 10-step QLoRA run at LR 5: 1.64 -> 11.8, then the constant 10.37 (a dead run)
    losses = [1.64, 1.71, 5.2, 11.8, 10.37, 10.37, 10.37, 10.37, 10.37, 10.37]
    state = {
        "global_step": 10,
        "log_history": [
            {"step": i + 1, "loss": v, "learning_rate": 5.0, "grad_norm": 1.0, "epoch": i / 10}
            for i, v in enumerate(losses)
        ],
    }
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps(state))
    result = analyze(read_log(path))
    [event] = result.incidents
    assert (event.step, event.kind, event.severity) == (4, "level_shift", "critical")
    assert event.metrics["frozen"] and event.metrics["ratio"] > 5
    assert "froze at 10.37" in event.message and "multiplied" in event.message


@pytest.mark.parametrize("n", [10, 20, 50])
def test_a_loss_that_multiplies_and_stays_flat_is_critical_at_any_length(n):
    rng = np.random.default_rng(n)
    loss = 2.0 + np.exp(-np.arange(n) / 5) + 0.01 * rng.standard_normal(n)
    at = n // 2
    loss[at:] = 9.0 + 0.02 * rng.standard_normal(n - at)  # not constant: flat at 4x
    found = [e for e in incidents(np.arange(n), loss) if e[1] == "level_shift"]
    assert found == [(at, "level_shift", "critical")]


def daily(seed: int, n: int = 130, noise: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """A long run logged once a day (1000 steps a day): a slow fall with day-to-day noise that
    carries over from one day to the next."""
    rng = np.random.default_rng(seed)
    e = np.zeros(n)
    for k in range(1, n):
        e[k] = 0.4 * e[k - 1] + rng.standard_normal()
    loss = (2.0 + 1.5 / np.sqrt(1 + np.arange(n) / 3)) * (1 + noise * e / e.std())
    return (np.arange(n) + 1) * 1000, loss


def test_a_daily_log_day_whose_loss_jumps_48_percent_is_found():
    steps, loss = daily(0)
    loss[80] = loss[79] * 1.48  # one day: 2.07 -> 3.07
    assert any(step == steps[80] for step, _, _ in incidents(steps, loss))


def test_a_daily_log_two_day_climb_of_14_percent_is_found():
    steps, loss = daily(1)
    loss[60] *= 1.07
    loss[61:] *= 1.14  # a data-loader bug: two days of climb, and the level stays
    found = incidents(steps, loss)
    assert any(steps[60] <= step <= steps[63] for step, _, _ in found)
    assert ("level_shift", "warning") in {(k, s) for _, k, s in found}


@pytest.mark.parametrize("seed", range(12))
def test_healthy_short_and_sparse_logs_stay_quiet(seed):
    rng = np.random.default_rng(100 + seed)
    for n, spacing in ((10, 1), (24, 5), (60, 100), (130, 1000)):
        t = np.arange(n)
        loss = 1.5 + rng.uniform(0.5, 3) / np.sqrt(1 + t / rng.uniform(1, n / 2))
        loss *= 1 + rng.uniform(0.002, 0.03) * rng.standard_normal(n)
        assert incidents((t + 1) * spacing, loss) == [], (n, spacing)


def test_a_coarsely_printed_log_is_not_frozen_by_its_rounding():
    rng = np.random.default_rng(3)
    t = np.arange(300)
    loss = np.round(2.3 + 0.002 * rng.standard_normal(300), 2)  # repeats by itself
    loss[150:] += 0.3
    [event] = level_shifts(t, loss)
    assert event.step == 150 and event.severity == "warning" and not event.metrics["frozen"]


def test_a_nan_that_only_the_grad_norm_average_column_shows_is_reported(tmp_path):
    steps, loss = daily(4)
    grad = 0.3 + 0.01 * np.arange(len(steps)) / len(steps)
    cells = [f"{g:.4f}" for g in grad]
    cells[70] = "nan"  # one day's average grad norm: a step's gradients were NaN
    path = tmp_path / "daily.csv"
    rows = (f"{s},{v:.5f},{c}\n" for s, v, c in zip(steps, loss, cells, strict=True))
    path.write_text("step,loss,grad_norm_avg\n" + "".join(rows))
    found = [e for e in analyze(read_log(path)).incidents if e.kind == "nonfinite"]
    assert [(e.step, e.severity) for e in found] == [(int(steps[70]), "warning")]
    assert "grad-norm column" in found[0].message


def test_a_grad_norm_column_with_gaps_or_an_fp16_scaler_raises_no_side_nan(tmp_path):
    steps, loss = daily(5)
    grad = np.full(len(steps), 0.3)
    sparse = grad.copy()
    sparse[::3] = np.nan  # logged on two rows of three: a NaN there is a row it skipped
    assert incidents(steps, loss, grad_norm=sparse) == []
    scale = np.full(len(steps), 65536.0)
    scale[41:] = 32768.0
    calibrating = grad.copy()
    calibrating[40] = np.nan  # the scaler met an overflow and halved the scale
    assert incidents(steps, loss, grad_norm=calibrating, loss_scale=scale) == []


def test_a_real_eight_point_lora_log_whose_loss_multiplies_and_stays_is_critical():
    # mlx-examples issue 620 (tests/data/level_shift/SOURCES.md): 1.41 -> 6.44, then 4.6-5.5
    path = Path(__file__).parent / "data" / "level_shift" / "mlx-lora-issue620-loss-rise.csv"
    [event] = analyze(read_log(path)).incidents
    assert (event.step, event.kind, event.severity) == (100, "level_shift", "critical")
    assert event.metrics["ratio"] > 3 and event.metrics["still_up"]


MEGATRON = Path(__file__).parent / "data" / "native_logs" / "megatron"


def megatron_rows() -> list[str]:
    text = (MEGATRON / "megatron_lm_resume_from_14000_srun_prefixed.log").read_text()
    return [ln for ln in text.splitlines() if "iteration " in ln and "lm loss" in ln]


def test_a_megatron_skipped_iteration_at_a_constant_loss_scale_is_reported(tmp_path):
    rows = megatron_rows()
    rows[10] = rows[10].replace("skipped iterations:   0", "skipped iterations:   1")
    log = tmp_path / "megatron.log"
    log.write_text("\n".join(rows) + "\n")
    found = [e for e in analyze(read_log(log)).incidents if e.kind == "nonfinite"]
    assert [(e.step, e.severity) for e in found] == [(14011, "warning")]


def test_a_megatron_skipped_iteration_where_the_loss_scale_falls_is_calibration(tmp_path):
    rows = megatron_rows()
    rows[10] = rows[10].replace("skipped iterations:   0", "skipped iterations:   1")
    rows[11:] = [r.replace("loss scale: 1.0 |", "loss scale: 0.5 |") for r in rows[11:]]
    log = tmp_path / "megatron.log"
    log.write_text("\n".join(rows) + "\n")
    assert analyze(read_log(log)).incidents == []


def count_log(path: Path, counts: dict[str, list[float]], seed: int = 6) -> Path:
    """A daily log (`daily`) with count columns beside its loss, as CSV or JSONL by the name."""
    steps, loss = daily(seed)
    rows = [
        {"step": int(s), "loss": round(float(v), 5), **{k: c[i] for k, c in counts.items()}}
        for i, (s, v) in enumerate(zip(steps, loss, strict=True))
    ]
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        names = list(rows[0])
        lines = [",".join(names)] + [",".join(str(r[n]) for n in names) for r in rows]
        path.write_text("\n".join(lines) + "\n")
    return path


def test_a_nan_iteration_count_in_a_csv_that_rises_above_0_is_critical(tmp_path):
    per_interval = [0.0] * 130
    per_interval[70] = 2.0  # one logging interval counted 2 NaN iterations; the loss averaged them
    path = count_log(tmp_path / "nan.csv", {"nan_iterations": per_interval})
    found = analyze(read_log(path)).incidents
    assert [(e.step, e.kind, e.severity) for e in found] == [(71_000, "nonfinite", "critical")]
    assert "nan_iterations column counts 2 " in found[0].message
    assert found[0].metrics["column"] == "nan_iterations"


def test_a_running_count_of_skipped_iterations_in_jsonl_is_reported_where_it_rises(tmp_path):
    running = [0.0] * 40 + [1.0] * 50 + [3.0] * 40  # DeepSpeed's `skipped=K`: a running total
    path = count_log(tmp_path / "skips.jsonl", {"skipped": running})
    found = analyze(read_log(path)).incidents
    assert [(e.step, e.severity, e.metrics["count"]) for e in found] == [
        (41_000, "warning", 1.0),
        (91_000, "warning", 2.0),
    ]
    assert all(e.metrics["column"] == "skipped_iterations" for e in found)


@pytest.mark.parametrize("name", ["run.csv", "run.jsonl"])
def test_count_columns_at_0_throughout_raise_nothing(tmp_path, name):
    zeros = [0.0] * 130
    counts = {"nan_iterations": zeros, "num_skipped_iterations": zeros, "overflow": zeros}
    path = count_log(tmp_path / name, counts)
    data = read_log(path)
    assert {"nan_iterations", "skipped_iterations"} <= set(data.extra)  # read, and quiet
    assert analyze(data).incidents == []


def test_a_skipped_iteration_count_where_the_loss_scale_falls_is_calibration(tmp_path):
    skipped = [0.0] * 130
    skipped[40] = 1.0
    scale = [65536.0] * 41 + [32768.0] * 89  # the scaler met an overflow and halved the scale
    path = count_log(tmp_path / "fp16.csv", {"skipped_iterations": skipped, "loss_scale": scale})
    assert analyze(read_log(path)).incidents == []
    scale = [65536.0] * 130  # the same skip at a scale that did not fall
    path = count_log(tmp_path / "bf16.csv", {"skipped_iterations": skipped, "loss_scale": scale})
    assert [(e.step, e.severity) for e in analyze(read_log(path)).incidents] == [
        (41_000, "warning")
    ]


def test_a_skip_that_the_grad_norm_column_shows_too_is_one_event(tmp_path):
    skipped = [0.0] * 130
    skipped[40] = 1.0
    grad: list[float | str] = [0.3] * 130
    grad[40] = "nan"
    path = count_log(tmp_path / "both.csv", {"skipped_iterations": skipped, "grad_norm": grad})
    [event] = analyze(read_log(path)).incidents
    assert (event.step, event.metrics["column"]) == (41_000, "grad_norm")
