"""Hugging Face Trainer's `trainer_state.json`: its `log_history` list holds the training logs
(`step`, `loss`, `grad_norm`, `learning_rate`) and the evaluations (`eval_loss`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainguard.analysis.formats import SURE, LogFormat, ReadOptions
from trainguard.analysis.logs import LogData, columns_of, number, open_text
from trainguard.events import TrainguardError

KEYS = {"grad_norm": "grad_norm", "lr": "learning_rate"}


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
    data = columns_of(path, rows, evals, "log_history entry")
    return [data]


FORMAT = LogFormat(
    "hf_trainer_state",
    "Hugging Face Trainer's trainer_state.json (log_history)",
    _sniff,
    _read,
)
