"""`read_log`: a loss log (CSV, TSV, trainguard's metrics.jsonl or generic JSONL) as columns."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainguard.events import TrainguardError

OPTIONAL = ("grad_norm", "lr", "loss_scale")
MAX_WARNED_ROWS = 10


@dataclass
class LogData:
    """Sorted, de-duplicated steps with their loss and, when present, grad norm, LR, loss scale."""

    steps: np.ndarray
    loss: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _number(text: object) -> float | None:
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        return float(text)
    try:
        return float(str(text).strip())
    except ValueError:
        return None


def read_log(path: str | Path, loss_column: str = "loss", step_column: str = "step") -> LogData:
    """Read a log; rows with a missing, non-numeric or non-finite loss or step are passed over
    with a warning naming them; unsorted and repeated steps are sorted (the last row wins)."""
    p = Path(path)
    if not p.is_file():
        raise TrainguardError(f"{p}: no such file; give the path of a CSV, TSV or JSONL log")
    if p.stat().st_size == 0:
        raise TrainguardError(f"{p} is empty: there is nothing to analyse")
    suffix = p.suffix.lower()
    with p.open(encoding="utf-8", errors="replace") as f:
        head = f.read(4096)
    if suffix in (".jsonl", ".json") or head.lstrip().startswith("{"):
        rows, columns = _jsonl(p)
    elif suffix in (".csv", ".tsv", ".txt") or "," in head or "\t" in head:
        rows, columns = _delimited(
            p, "\t" if suffix == ".tsv" or "\t" in head.splitlines()[0] else ","
        )
    else:
        raise TrainguardError(
            f"{p}: unknown format; trainguard reads CSV/TSV with a header and JSONL"
        )
    for needed in (step_column, loss_column):
        if needed not in columns:
            raise TrainguardError(
                f"{p}: no '{needed}' column (found: {', '.join(sorted(columns)) or 'none'}); "
                "name the columns with --step-column and --column"
            )
    kept: dict[int, tuple[float, dict[str, float]]] = {}
    bad: list[int] = []
    last = -math.inf
    unsorted = repeated = False
    for number, row in rows:
        step, loss = _number(row.get(step_column)), _number(row.get(loss_column))
        if step is None or loss is None or not math.isfinite(step) or not math.isfinite(loss):
            bad.append(number)
            continue
        if step < last:
            unsorted = True
        if int(step) in kept:
            repeated = True
        last = step
        extra = {k: v for k in OPTIONAL if (v := _number(row.get(k))) is not None}
        kept[int(step)] = (loss, extra)
    if not kept:
        raise TrainguardError(f"{p}: no row has a numeric step and a finite loss")
    warnings = []
    if bad:
        shown = ", ".join(str(n) for n in bad[:MAX_WARNED_ROWS])
        more = f" and {len(bad) - MAX_WARNED_ROWS} more" if len(bad) > MAX_WARNED_ROWS else ""
        warnings.append(
            f"passed over {len(bad)} row(s) without a numeric step and finite loss: "
            f"line {shown}{more}"
        )
    if unsorted or repeated:
        warnings.append("steps were unsorted or repeated: sorted, keeping the last row per step")
    ordered = sorted(kept)
    losses = np.array([kept[s][0] for s in ordered], dtype=np.float64)
    optional: dict[str, np.ndarray] = {}
    for key in OPTIONAL:
        values = [kept[s][1].get(key, math.nan) for s in ordered]
        if any(math.isfinite(v) for v in values):
            optional[key] = np.array(values, dtype=np.float64)
    return LogData(np.array(ordered, dtype=np.int64), losses, optional, warnings)


def _jsonl(p: Path) -> tuple[list[tuple[int, dict[str, object]]], set[str]]:
    rows: list[tuple[int, dict[str, object]]] = []
    columns: set[str] = set()
    with p.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                rows.append((number, {}))
                continue
            if isinstance(record, dict):
                columns.update(record)
                rows.append((number, record))
    return rows, columns


def _delimited(p: Path, delimiter: str) -> tuple[list[tuple[int, dict[str, object]]], set[str]]:
    with p.open(newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        columns = {c.strip() for c in reader.fieldnames or []}
        rows = [
            (number, {(k or "").strip(): v for k, v in row.items()})
            for number, row in enumerate(reader, 2)
        ]
    return rows, columns
