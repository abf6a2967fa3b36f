"""Hugging Face Trainer's `trainer_state.json`: its `log_history` list holds the training logs
(`step`, `loss`, `grad_norm`, `learning_rate`, TRL's `mean_token_accuracy`) and the evaluations
(every `eval_*` result: `eval_loss`, `eval_accuracy`, ...; not its runtime or throughput)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainguard.analysis.formats import SURE, LogFormat, ReadOptions
from trainguard.analysis.logs import (
    MAX_STEP,
    LogData,
    columns_of,
    first_evaluations,
    is_evaluation,
    number,
    open_text,
    timeline_of,
)
from trainguard.events import TrainguardError

KEYS = {"grad_norm": "grad_norm", "lr": "learning_rate", "token_accuracy": "mean_token_accuracy"}


def _sniff(path: Path, head: str) -> int:
    if '"log_history"' in head and head.lstrip().startswith("{"):
        return SURE
    return SURE if path.name == "trainer_state.json" else 0


def _read(path: Path, options: ReadOptions) -> list[LogData]:
    try:
        with open_text(path, errors="strict") as f:
            state = json.load(f)
    except (ValueError, RecursionError) as exc:
        raise TrainguardError(
            f"{path}: not a readable trainer_state.json ({exc}); give the file the Trainer "
            "wrote, whole"
        ) from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise TrainguardError(
            f"{path}: no 'log_history' list; give the trainer_state.json a Hugging Face "
            "Trainer wrote"
        )
    rows: dict[str, list[float]] = {k: [] for k in ("step", "loss", *KEYS)}
    evals: dict[str, list[float]] = {"step": [], "loss": []}
    named: dict[str, tuple[list[float], list[float]]] = {}  # every eval_* result, by name
    for entry in history:
        if not isinstance(entry, dict):
            continue
        step = number(entry.get("step"))
        if step is None:
            continue
        loss = number(entry.get("loss"))
        if loss is not None:
            rows["step"].append(step)
            rows["loss"].append(loss)
            for key, name in KEYS.items():
                value = number(entry.get(name))
                rows[key].append(np.nan if value is None else value)
        eval_loss = number(entry.get("eval_loss"))
        if eval_loss is not None:
            evals["step"].append(step)
            evals["loss"].append(eval_loss)
        for key, value in entry.items():
            result = number(value) if is_evaluation(key) else None
            if result is not None:
                steps, values = named.setdefault(key, ([], []))
                steps.append(step)
                values.append(result)
    data = columns_of(path, rows, evals, "log_history entry")
    if rows["step"]:  # evaluations beside a training loss (not standing in for it)
        data.evaluations = {
            key: timeline_of(np.asarray(steps), np.asarray(values))
            for key, (steps, values) in ((k, named[k]) for k in first_evaluations(list(named)))
            if np.all(np.abs(steps) < MAX_STEP)
        }
    return [data]


FORMAT = LogFormat(
    "hf_trainer_state",
    "Hugging Face Trainer's trainer_state.json (log_history)",
    _sniff,
    _read,
)
