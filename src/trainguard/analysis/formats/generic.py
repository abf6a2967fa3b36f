"""Generic logs: CSV/TSV with a header and JSONL, one row or object per step; the step and loss
columns are the ones named, else the first of the usual names the file has."""

from __future__ import annotations

import re
from pathlib import Path

from trainguard.analysis.formats import LIKELY, SURE, LogFormat, ReadOptions
from trainguard.analysis.logs import (
    TOKEN_ACCURACY_NAMES,
    LogData,
    delimited,
    delimiter_of,
    evaluation_columns,
    header_line,
    header_of,
    json_object,
    jsonl,
    with_evaluations,
)

STEP_NAMES = ("step", "global_step", "iteration", "iter", "_step", "Step", "trainer/global_step")
LOSS_NAMES = ("loss", "train_loss", "train/loss", "training_loss", "train_loss_step", "lm_loss")
HEADER_CELL = re.compile(r"^[\w .,/\-\[\]()%#@+]+$")  # a column name, not a printed dict
OPTIONAL_NAMES = {
    "grad_norm": (  # the last four: a grad norm averaged over the logging interval
        *("grad_norm", "train/grad_norm", "gradient_norm", "grad-norm", "norm"),
        *("grad_norm_avg", "avg_grad_norm", "grad_norm_mean", "mean_grad_norm"),
    ),
    "lr": ("lr", "learning_rate", "train/learning_rate", "train/lr", "lr-AdamW", "lr-Adam"),
    "loss_scale": ("loss_scale", "train/loss_scale", "scale"),
    "token_accuracy": TOKEN_ACCURACY_NAMES,
    "nan_iterations": (  # iterations whose loss was NaN or Inf (the loss column averages them out)
        *("nan_iterations", "num_nan_iterations", "nan_iteration_count", "num_nan", "nan_count"),
        *("nan_steps", "num_nan_steps", "number_of_nan_iterations"),
    ),
    "skipped_iterations": (  # iterations skipped for non-finite gradients (fp16 overflow too)
        *("skipped_iterations", "num_skipped_iterations", "skipped_iters", "skipped_steps"),
        *("num_skipped", "skipped", "number_of_skipped_iterations", "overflow", "overflows"),
        *("overflow_count", "num_overflow", "num_overflows", "overflow_steps"),
    ),
}


def names_for(columns: list[str] | set[str], options: ReadOptions) -> dict[str, str]:
    """The columns to read: the named ones where the user named them (or the file has the
    default names), else the first usual name the file has; optional ones where present."""
    chosen = {"step": options.step_column, "loss": options.loss_column}
    usual_names: dict[str, tuple[str, ...]] = {"step": STEP_NAMES, "loss": LOSS_NAMES}
    for key, usual in usual_names.items():
        if chosen[key] == key and key not in columns:
            chosen[key] = next((n for n in usual if n in columns), key)
    for key, usual in OPTIONAL_NAMES.items():
        found = next((n for n in usual if n in columns), None)
        if found is not None and found not in chosen.values():
            chosen[key] = found
    return chosen


def comma_header(text: str) -> list[str]:
    """The column names of a text's first line, where it is comma-separated; none otherwise."""
    first = text.splitlines()[0] if text else ""
    return header_of(first, ",") if "," in first else []


def first_of(columns: list[str], usual: tuple[str, ...], *words: str) -> str | None:
    """The first usual name the columns have, else the first column with every word (and not
    an epoch mean)."""
    found = next((n for n in usual if n in columns), None)
    if found is not None:
        return found
    return next(
        (c for c in columns if all(w in c.lower() for w in words) and "epoch" not in c.lower()),
        None,
    )


def _sniff_csv(path: Path, head: str) -> int:
    first = head.splitlines()[0] if head else ""
    if path.suffix.lower() in (".csv", ".tsv"):
        return LIKELY
    delimiter = delimiter_of(path, first)
    if delimiter is None:
        return 0
    columns = header_of(first, delimiter)
    usual = any(n in columns for n in STEP_NAMES) and any(n in columns for n in LOSS_NAMES)
    if usual:
        return LIKELY
    names = len(columns) > 1 and all(HEADER_CELL.match(c) for c in columns)
    return 1 if names else 0  # a header of other names (--column names them)


def _read_csv(path: Path, options: ReadOptions) -> list[LogData]:
    first = header_line(path)
    delimiter = delimiter_of(path, first) or ","
    columns = header_of(first, delimiter, path)
    names = names_for(columns, options)
    evaluated = evaluation_columns(columns, exclude=list(names.values()))
    data = delimited(path, delimiter, names, other_rows=bool(evaluated))
    return [with_evaluations(path, data, names["step"], evaluated, delimiter)]


def _sniff_jsonl(path: Path, head: str) -> int:
    if path.suffix.lower() == ".jsonl" or path.name == "metrics.jsonl":
        return SURE if path.name == "metrics.jsonl" else LIKELY
    first = next((line for line in head.splitlines() if line.strip()), "")
    if json_object(first) is not None:
        return LIKELY
    return 1 if path.suffix.lower() == ".json" else 0


def _read_jsonl(path: Path, options: ReadOptions) -> list[LogData]:
    return [jsonl(path, options, names_for)]


CSV = LogFormat("csv", "CSV or TSV with a header row: step and loss columns", _sniff_csv, _read_csv)
JSONL = LogFormat(
    "jsonl",
    "JSON lines, one object per step (trainguard's metrics.jsonl too)",
    _sniff_jsonl,
    _read_jsonl,
)
