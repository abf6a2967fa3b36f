"""Weights & Biases CSV exports: a run's history (`_step`, `train/loss`, ... with empty cells
where a row logged other keys) and a panel's export (`Step`, `<run> - <metric>` with
`__MIN`/`__MAX` columns beside each), whose runs are read one by one."""

from __future__ import annotations

from pathlib import Path

from trainguard.analysis.formats import LIKELY, LogFormat, ReadOptions
from trainguard.analysis.formats.generic import comma_header, first_of
from trainguard.analysis.logs import (
    LogData,
    delimited,
    evaluation_columns,
    header_line,
    with_evals,
    with_evaluations,
)
from trainguard.events import TrainguardError

STEPS = ("train/global_step", "trainer/global_step", "global_step", "_step")
TRAIN = ("train/loss", "train_loss", "loss", "train/train_loss", "training/loss", "loss/train")
EVAL = ("eval/loss", "val/loss", "val_loss", "eval_loss", "validation/loss", "loss/val")
LR = ("train/learning_rate", "train/lr", "learning_rate", "lr")
NORM = ("train/grad_norm", "grad_norm", "train/gradient_norm")
SEPARATOR = " - "  # a panel export's "<run> - <metric>"


def _panel_runs(columns: list[str]) -> dict[str, str]:
    """A panel export's runs and the column of each run's metric (a loss where there is one)."""
    runs: dict[str, list[str]] = {}
    for c in columns:
        if SEPARATOR in c and not c.endswith(("__MIN", "__MAX")):
            run, metric = c.rsplit(SEPARATOR, 1)
            runs.setdefault(run, []).append(metric)
    chosen = {}
    for run, metrics in runs.items():
        metric = first_of(metrics, TRAIN, "loss") or metrics[0]
        chosen[run] = f"{run}{SEPARATOR}{metric}"
    return chosen


def _sniff(path: Path, head: str) -> int:
    columns = comma_header(head)
    if "_step" in columns and ("_runtime" in columns or "_timestamp" in columns):
        return LIKELY + 20
    if "Step" in columns and _panel_runs(columns):
        return LIKELY + 20
    return 0


def _read(path: Path, options: ReadOptions) -> list[LogData]:
    columns = comma_header(header_line(path))
    if "Step" in columns and "_step" not in columns:
        runs = []
        for run, column in _panel_runs(columns).items():
            data = delimited(path, ",", {"step": "Step", "loss": column}, other_rows=True)
            data.run = run
            runs.append(data)
        return runs
    step = next((c for c in STEPS if c in columns), "_step")
    loss = first_of(columns, TRAIN, "train", "loss") or first_of(columns, (), "loss")
    if loss is None:
        raise TrainguardError(f"{path}: no loss column among {', '.join(columns[:12])}")
    names = {"step": step, "loss": loss}
    for key, usual in (("lr", LR), ("grad_norm", NORM)):
        found = next((c for c in usual if c in columns), None)
        if found is not None:
            names[key] = found
    data = delimited(path, ",", names, other_rows=True)
    evaluated = first_of(columns, EVAL, "eval", "loss") or first_of(columns, (), "val", "loss")
    data = with_evals(path, data, step, evaluated if evaluated != loss else None)
    return [with_evaluations(path, data, step, evaluation_columns(columns, exclude=[loss]))]


FORMAT = LogFormat(
    "wandb_csv",
    "W&B CSV export (run history with _step, or a panel's <run> - <metric>)",
    _sniff,
    _read,
)
