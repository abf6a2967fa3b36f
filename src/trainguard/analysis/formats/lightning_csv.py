"""Lightning's `CSVLogger` `metrics.csv`: `epoch`, `step` and one column per logged metric,
with training and validation rows interleaved (each leaves the other's cells empty)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainguard.analysis.formats import LIKELY, LogFormat, ReadOptions
from trainguard.analysis.formats.generic import comma_header, first_of
from trainguard.analysis.logs import (
    TOKEN_ACCURACY_NAMES,
    LogData,
    delimited,
    evaluation_columns,
    header_line,
    with_evals,
    with_evaluations,
)
from trainguard.events import TrainguardError

TRAIN = ("train_loss_step", "train_loss", "train/loss", "loss_step", "loss", "training_loss")
TOTAL = ("total_loss", "mean_loss", "loss_total")  # a sum or mean of several losses
EVAL = ("val_loss", "val_loss_epoch", "valid_loss", "val/loss", "validation_loss", "eval_loss")


def _sniff(path: Path, head: str) -> int:
    columns = comma_header(head)
    if "epoch" in columns and "step" in columns and any("loss" in c for c in columns):
        return LIKELY + 10
    return 0


def _read(path: Path, options: ReadOptions) -> list[LogData]:
    columns = comma_header(header_line(path))
    loss = first_of(columns, TRAIN, "train", "loss") or first_of(columns, TOTAL, "loss")
    if loss is None:
        raise TrainguardError(f"{path}: no loss column among {', '.join(columns)}")
    data = delimited(path, ",", {"step": "step", "loss": loss}, other_rows=True)
    lr = next((c for c in columns if c == "lr" or c.startswith("lr-")), None)
    norm = next((c for c in columns if "grad" in c and "norm" in c), None)
    for key, name in (("lr", lr), ("grad_norm", norm)):
        if name is not None:
            _align(path, data, key, name)
    evaluated = first_of(columns, EVAL, "val", "loss")
    data = with_evals(path, data, "step", evaluated if evaluated != loss else None)
    accuracy = next((c for c in TOKEN_ACCURACY_NAMES if c in columns), None)
    if accuracy is not None:
        _align_exact(path, data, "token_accuracy", accuracy)
    return [with_evaluations(path, data, "step", evaluation_columns(columns, exclude=[loss]))]


def _align_exact(path: Path, data: LogData, key: str, column: str) -> None:
    """A metric logged on some training rows (token accuracy on sampled steps) as a column of
    the training steps: NaN at a step without it."""
    try:
        logged = delimited(path, ",", {"step": "step", "loss": column}, other_rows=True)
    except TrainguardError:  # no value in any row
        return
    at = np.clip(np.searchsorted(logged.steps, data.steps), 0, len(logged.steps) - 1)
    hit = logged.steps[at] == data.steps
    values = np.where(hit, logged.loss[at], np.nan)
    if hit.any():
        data.extra[key] = values


def _align(path: Path, data: LogData, key: str, column: str) -> None:
    """A metric logged on rows of its own (LearningRateMonitor writes `lr-AdamW` apart from the
    loss) as a column of the training steps: the last value at or before each step."""
    try:
        logged = delimited(path, ",", {"step": "step", "loss": column}, other_rows=True)
    except TrainguardError:  # no value in any row
        return
    at = np.searchsorted(logged.steps, data.steps, side="right") - 1
    values = np.where(at >= 0, logged.loss[np.clip(at, 0, None)], np.nan)
    if not np.isnan(values).all():
        data.extra[key] = values


FORMAT = LogFormat(
    "lightning_csv",
    "Lightning CSVLogger metrics.csv (epoch, step, interleaved rows)",
    _sniff,
    _read,
)
