"""`load_run`: what a report shows of a run directory (metrics, events, config) or of a bare
loss log (judged by `analyze` on the way)."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainguard.config import GuardConfig
from trainguard.events import TrainguardError

COLUMNS = ("loss", "grad_norm", "lr", "loss_scale")


@dataclass
class RunRecord:
    """A run as columns over its final timeline, the steps it abandoned on a rollback, its
    events (as JSON objects) and its config."""

    source: Path
    steps: np.ndarray
    columns: dict[str, np.ndarray]
    actions: list[str] | None = None
    abandoned: dict[str, np.ndarray] = field(default_factory=dict)  # "step", "loss"
    groups: list[str] = field(default_factory=list)
    group_steps: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    group_norms: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))
    events: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    judged: bool = False  # events come from `analyze`, not from a live guard
    action_counts: dict[str, int] = field(default_factory=dict)  # over every record, replays too


def load_run(path: str | Path, config: GuardConfig | None = None) -> RunRecord:
    """A run directory with metrics.jsonl (and events.jsonl, config.json), or any log that
    `read_log` reads, which is then judged by the detectors."""
    p = Path(path)
    if p.is_dir() and (p / "metrics.jsonl").is_file():
        return _run_dir(p)
    from trainguard.analysis.analyzer import analyze
    from trainguard.analysis.logs import read_log

    cfg = config or GuardConfig(console=False)
    data = read_log(p)
    result = analyze(data, cfg)
    columns = {"loss": data.loss, **data.extra}
    return RunRecord(
        source=p,
        steps=data.steps,
        columns=columns,
        events=[e.to_dict() for e in result.events],
        config=cfg.model_dump(mode="json"),
        warnings=list(data.warnings),
        judged=True,
    )


def _number(value: Any) -> float:
    if isinstance(value, bool) or value is None:
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return math.nan


def _run_dir(p: Path) -> RunRecord:
    records: list[dict[str, Any]] = []
    bad = 0
    with (p / "metrics.jsonl").open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                bad += 1  # a line cut short by a kill is expected at the end
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            else:
                bad += 1
    if not records:
        raise TrainguardError(f"{p / 'metrics.jsonl'} has no step records: nothing to report")
    warnings = [f"passed over {bad} unreadable line(s) of metrics.jsonl"] if bad else []
    last: dict[int, int] = {}
    for i, r in enumerate(records):
        last[r["step"]] = i  # a step replayed after a rollback or resume: the last one counts
    kept = sorted(last.values(), key=lambda i: records[i]["step"])
    dropped = sorted(set(range(len(records))) - set(kept))
    steps = np.array([records[i]["step"] for i in kept], dtype=np.int64)
    columns = {
        name: np.array([_number(records[i].get(name)) for i in kept])
        for name in COLUMNS
        if any(name in records[i] for i in kept)
    }
    abandoned = {
        "step": np.array([records[i]["step"] for i in dropped], dtype=np.int64),
        "loss": np.array([_number(records[i].get("loss")) for i in dropped]),
    }
    names: list[str] = []
    seen: set[str] = set()
    rows = [i for i in kept if isinstance(records[i].get("group_grad_norms"), dict)]
    for i in rows:
        for name in records[i]["group_grad_norms"]:
            if name not in seen:
                seen.add(name)
                names.append(name)
    norms = np.full((len(rows), len(names)), math.nan)
    for row, i in enumerate(rows):
        for c, name in enumerate(names):
            norms[row, c] = _number(records[i]["group_grad_norms"].get(name))
    events: list[dict[str, Any]] = []
    if (p / "events.jsonl").is_file():
        with (p / "events.jsonl").open(encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(event, dict) and "kind" in event:
                    events.append(event)
    config: dict[str, Any] = {}
    if (p / "config.json").is_file():
        try:
            config = json.loads((p / "config.json").read_text())
        except json.JSONDecodeError:
            warnings.append("config.json is not valid JSON: the config is not shown")
    return RunRecord(
        source=p,
        steps=steps,
        columns=columns,
        actions=[str(records[i].get("action", "step")) for i in kept],
        abandoned=abandoned,
        groups=names,
        group_steps=np.array([records[i]["step"] for i in rows], dtype=np.int64),
        group_norms=norms,
        events=events,
        config=config,
        warnings=warnings,
        action_counts=dict(Counter(str(r.get("action", "step")) for r in records)),
    )
