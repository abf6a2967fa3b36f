"""Evaluations read from logs (`trainguard analyze`) judged as the live guard judges them: the
same `eval_decline` events for the same shape, whatever the format carries the evaluations; a
real nanoGPT run that overfits (tests/data/native_logs, SOURCES.md) among them."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from test_evals import declines, live
from trainguard import GuardConfig
from trainguard.analysis.analyzer import analyze
from trainguard.analysis.logs import LogData, read_log
from trainguard.events import Event

LOGS = Path(__file__).parent / "data" / "native_logs"
EVERY = 250  # steps between evaluations, nanoGPT's shakespeare-char interval
LOG_EVERY = 10  # steps between logged training losses


def shape(overfits: bool, seed: int = 0) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """A small char-level run of 3000 steps as nanoGPT logs it: the training loss every 10 steps
    falling from ln(139) to ~0.04, and 13 evaluations from the untrained model's at step 0; the
    validation loss bottoms at step 500 and then rises by half (`overfits`) or keeps a flat,
    noisy level. Values are rounded to the 4 decimals nanoGPT prints."""
    rng = np.random.default_rng(seed)
    train = []
    for s in range(0, 3001, LOG_EVERY):
        level = 0.04 + 4.9 * math.exp(-s / 120)
        train.append((s, round(level * (1 + float(rng.normal(0, 0.03))), 4)))
    evals = []
    for s in range(0, 3001, EVERY):
        value = 0.66 + 4.3 * math.exp(-s / 110)
        if overfits and s > 500:
            value += 0.7 * math.sqrt((s - 500) / 2500)
        evals.append((s, round(value * (1 + float(rng.normal(0, 0.004))), 4)))
    return train, evals


def live_declines(
    train: list[tuple[int, float]], evals: list[tuple[int, float]], name: str
) -> list[Event]:
    """The `eval_decline` events of a live Monitor fed each training loss, then each evaluation
    made after the steps up to its own (as `analyze` orders them)."""
    steps, losses = (np.array(column) for column in zip(*train, strict=True))
    return declines(live(steps, losses, evals, name))


def offline_declines(data: LogData) -> list[Event]:
    return [e for e in analyze(data, GuardConfig(console=False)).events if e.kind == "eval_decline"]


def as_read(data: LogData) -> tuple[list[tuple[int, float]], list[tuple[int, float]], str]:
    """The training losses and the one evaluation a log gave, as (step, value) pairs."""
    (name, (steps, values)), *others = data.named_evaluations().items()
    assert not others
    train = list(zip(data.steps.tolist(), data.loss.tolist(), strict=True))
    return train, list(zip(steps.tolist(), values.tolist(), strict=True)), name


def nanogpt(path: Path, train: list[tuple[int, float]], evals: list[tuple[int, float]]) -> str:
    at = dict(evals)
    lines = []
    for step, loss in train:
        if step in at:
            lines.append(f"step {step}: train loss {loss:.4f}, val loss {at[step]:.4f}")
        lines.append(f"iter {step}: loss {loss:.4f}, time 31.2ms, mfu 2.04%")
    (path / "train.log").write_text("\n".join(lines) + "\n")
    return "train.log"


def build_nanogpt(
    path: Path, train: list[tuple[int, float]], evals: list[tuple[int, float]]
) -> str:
    at = dict(evals)
    lines = []
    for step, loss in train:
        if step in at:
            lines.append(f"{step} val {at[step]:.4f}")
        lines.append(f"{step} train {loss:.6f}")
    (path / "log.txt").write_text("\n".join(lines) + "\n")
    return "log.txt"


def trainer_state(
    path: Path, train: list[tuple[int, float]], evals: list[tuple[int, float]]
) -> str:
    at = dict(evals)
    history: list[dict[str, float]] = []
    for step, loss in train:
        history.append({"step": step, "loss": loss, "learning_rate": 1e-3, "epoch": step / 3000})
        if step in at:
            history.append({"step": step, "eval_loss": at[step], "eval_runtime": 1.5})
    (path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    return "trainer_state.json"


def delimited_rows(
    header: str, train_row: str, eval_row: str
) -> Callable[[Path, list[tuple[int, float]], list[tuple[int, float]]], str]:
    """A writer of a CSV log with training and evaluation rows interleaved."""

    def write(path: Path, train: list[tuple[int, float]], evals: list[tuple[int, float]]) -> str:
        at = dict(evals)
        rows = [header]
        for step, loss in train:
            rows.append(train_row.format(step=step, loss=loss))
            if step in at:
                rows.append(eval_row.format(step=step, value=at[step]))
        (path / "metrics.csv").write_text("\n".join(rows) + "\n")
        return "metrics.csv"

    return write


WRITERS = {
    "nanogpt": nanogpt,
    "build_nanogpt": build_nanogpt,
    "hf_trainer_state": trainer_state,
    "lightning_csv": delimited_rows(
        "epoch,step,train_loss,val_loss", "0,{step},{loss},", "0,{step},,{value}"
    ),
    "wandb_csv": delimited_rows(
        "_step,_runtime,train/loss,eval/loss", "{step},{step},{loss},", "{step},{step},,{value}"
    ),
    "csv": delimited_rows("step,loss,val_loss", "{step},{loss},", "{step},,{value}"),
}


def test_the_real_nanogpt_overfitting_log_warns_as_the_live_guard_does():
    """nanoGPT on a 139-character corpus: the val loss bottoms at 0.6678 at step 500 and rises
    to 1.041 by step 1500 (+56%) while the training loss falls 0.179 -> 0.051."""
    data = read_log(LOGS / "nanogpt" / "nanogpt_mitos_char_overfit.log")
    train, evals, name = as_read(data)
    assert data.format == "nanogpt" and name == "val_loss" and len(evals) == 7
    assert evals[2] == (500, 0.6678) and evals[-1] == (1500, 1.041)
    offline = offline_declines(data)
    assert [e.step for e in offline] == [1250]  # 3 evaluations past the best, +36%
    assert offline[0].metrics["best_step"] == 750 and offline[0].severity == "warning"
    live = live_declines(train, evals, name)
    assert [(e.step, e.message) for e in offline] == [(e.step, e.message) for e in live]


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_each_format_gives_the_events_of_the_live_guard_on_the_same_evaluations(tmp_path, fmt):
    train, evals = shape(overfits=True)
    expected = live_declines(train, evals, "val_loss")
    assert [e.step for e in expected] == [1250]  # 12% over the best, 3 evaluations after it
    file = WRITERS[fmt](tmp_path, train, evals)
    data = read_log(tmp_path / file)
    assert data.format == fmt
    read_train, read_evals, name = as_read(data)
    assert read_evals == evals and [v for _, v in read_train] == [v for _, v in train]
    offline = offline_declines(data)
    assert [(e.step, e.message) for e in offline] == [
        (e.step, e.message) for e in live_declines(read_train, read_evals, name)
    ]
    assert [e.step for e in offline] == [e.step for e in expected]
    assert [e.metrics["best_step"] for e in offline] == [e.metrics["best_step"] for e in expected]


@pytest.mark.parametrize("fmt", sorted(WRITERS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_evaluation_that_levels_off_after_the_untrained_one_stays_quiet(tmp_path, fmt, seed):
    train, evals = shape(overfits=False, seed=seed)
    assert live_declines(train, evals, "val_loss") == []
    data = read_log(tmp_path / WRITERS[fmt](tmp_path, train, evals))
    assert offline_declines(data) == []
