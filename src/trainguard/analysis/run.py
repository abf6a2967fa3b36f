"""`load_run`: what a report shows of a run directory (metrics, events, config) or of a bare
loss log (judged by `analyze` on the way)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainguard.analysis import logs
from trainguard.analysis.logs import BoundedLines, final_timeline, json_object, timeline_of
from trainguard.config import GuardConfig
from trainguard.events import TrainguardError
from trainguard.line_writer import flush_writers

COLUMNS = ("loss", "grad_norm", "lr", "loss_scale")
MAX_STEP = 2**63  # a step must fit the int64 step column
MAX_DEPTH = 32  # an event or config nested deeper is not one the guard wrote
SEVERITIES = ("info", "warning", "critical")
MAX_RECORDS = 100_000  # events or evaluations read from one file at most


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
    evals: dict[str, tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict
    )  # name: steps, values

    @property
    def abandoned_label(self) -> str:
        """What the abandoned rows were: steps a rollback undid, or rows a restart replaced."""
        if self.action_counts.get("rollback"):
            return "abandoned by a rollback"
        return "replaced on a restart"


def load_run(
    path: str | Path,
    config: GuardConfig | None = None,
    log_format: str | None = None,
    run: str | None = None,
    loss_column: str = "loss",
    step_column: str = "step",
    tag: str | None = None,
) -> RunRecord:
    """A run directory with metrics.jsonl (and events.jsonl, config.json), or any log that
    `read_log` reads (in `log_format`, or the one its content shows; the run named `run` of a
    file of several), which is then judged by the detectors."""
    flush_writers()  # a live run of this process: every line it recorded
    p = Path(path)
    if p.is_dir() and (p / "metrics.jsonl").is_file():
        try:
            return _run_dir(p)
        except OSError as exc:
            raise TrainguardError(
                f"cannot read {exc.filename or p}: {exc.strerror or exc}; check the run "
                "directory and its permissions"
            ) from None
    from trainguard.analysis.analyzer import analyze
    from trainguard.analysis.logs import read_log

    cfg = config or GuardConfig(console=False)
    data = read_log(p, loss_column, step_column, tag, log_format, run)
    result = analyze(data, cfg)
    columns = {"loss": data.loss, **data.extra}
    evals = data.named_evaluations()
    return RunRecord(
        source=p,
        steps=data.steps,
        columns=columns,
        abandoned=dict(data.abandoned),
        events=[e.to_dict() for e in result.events],
        config=cfg.model_dump(mode="json"),
        warnings=list(data.warnings),
        judged=True,
        evals=evals,
    )


def _number(value: Any) -> float:
    if isinstance(value, bool) or value is None:
        return math.nan
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an integer past 1e308
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return math.nan


def is_step(value: Any) -> bool:
    """An integer step that fits the int64 step column (JSON's true and false are no steps)."""
    return isinstance(value, int) and not isinstance(value, bool) and -MAX_STEP <= value < MAX_STEP


def _depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deep lists and objects nest in `value`, counted up to just past `limit`."""
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    items = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


def _is_event(record: dict[str, Any]) -> bool:
    """Whether a line of events.jsonl reads as an event: a string kind, an integer step, a
    known severity, and metrics (when given) that are an object."""
    return (
        isinstance(record.get("kind"), str)
        and is_step(record.get("step"))
        and record.get("severity", "info") in SEVERITIES
        and isinstance(record.get("metrics", {}), dict)
        and _depth(record) <= MAX_DEPTH
    )


def _read_lines(
    path: Path, warnings: list[str], exact: bool = True, most: int | None = None
) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, in order; unreadable lines are passed over with one
    warning, and a truncated last line, as a run cut short leaves it, with another. A line over
    `MAX_LINE_BYTES` is passed over unread, and past `most` objects (`MAX_RECORDS` when None)
    the rest are counted, not kept: memory stays bounded."""
    most = MAX_RECORDS if most is None else most
    records: list[dict[str, Any]] = []
    bad = more = 0
    number, last_bad = 0, -1
    with path.open("rb") as f:
        lines = BoundedLines(f)
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json_object(line, exact=exact)
            if record is None:
                bad, last_bad = bad + 1, number
            elif len(records) < most:
                records.append(record)
            else:
                more += 1
    if last_bad == number and lines.unfinished:
        bad -= 1
        warnings.append(f"skipped the truncated last line {number} of {path.name}")
    if bad:
        warnings.append(f"passed over {bad} unreadable line(s) of {path.name}")
    long = lines.note(path.name)
    if long is not None:
        warnings.append(long)
    if more:
        warnings.append(
            f"{path.name}: read its first {most:,} lines; passed over {more:,} more (the limit "
            "that keeps memory bounded)"
        )
    return records


def recorded_events(path: Path, warnings: list[str]) -> list[dict[str, Any]]:
    """The events of a guard's events.jsonl as JSON objects, in order; lines that are not
    events are passed over with a warning."""
    lines = _read_lines(path, warnings, exact=False)
    events = [e for e in lines if _is_event(e)]
    if len(events) < len(lines):
        warnings.append(
            f"passed over {len(lines) - len(events)} line(s) of {path.name} that are not "
            "events (a string kind, an integer step, a known severity)"
        )
    return events


def recorded_evaluations(
    path: Path, warnings: list[str]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The evaluations of a guard's evals.jsonl by name: (steps, values) on the final timeline
    (a step evaluated again after a rollback keeps its last value); lines that are not
    evaluations (an integer step, an object of values) are passed over with a warning."""
    lines = _read_lines(path, warnings)
    found: dict[str, tuple[list[int], list[float]]] = {}
    bad = 0
    for line in lines:
        values = line.get("values")
        if not is_step(line.get("step")) or not isinstance(values, dict):
            bad += 1
            continue
        for name, value in values.items():
            steps, kept = found.setdefault(str(name), ([], []))
            steps.append(int(line["step"]))
            kept.append(_number(value))
    if bad:
        warnings.append(f"passed over {bad} line(s) of {path.name} that are not evaluations")
    return {
        name: timeline_of(np.asarray(steps, dtype=np.int64), np.asarray(values))
        for name, (steps, values) in found.items()
    }


def _run_dir(p: Path) -> RunRecord:
    warnings: list[str] = []
    lines = _read_lines(p / "metrics.jsonl", warnings, most=logs.MAX_ROWS)
    records = [r for r in lines if is_step(r.get("step"))]
    if len(records) < len(lines):
        warnings.append(
            f"passed over {len(lines) - len(records)} line(s) of metrics.jsonl without an "
            "integer step"
        )
    if not records:
        raise TrainguardError(
            f"{p / 'metrics.jsonl'} has no step records: nothing to report; give the run_dir "
            "of a Guard, or a loss log"
        )
    # a step replayed after a rollback or resume: the last row counts, the others are abandoned
    kept_rows, dropped_rows = final_timeline(np.array([r["step"] for r in records], dtype=np.int64))
    kept, dropped = kept_rows.tolist(), dropped_rows.tolist()
    steps = np.array([records[i]["step"] for i in kept], dtype=np.int64)
    columns = {
        name: np.array([_number(records[i].get(name)) for i in kept])
        for name in COLUMNS
        if name == "loss" or any(name in records[i] for i in kept)  # a loss column, even empty
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
        events = recorded_events(p / "events.jsonl", warnings)
    evals: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if (p / "evals.jsonl").is_file():
        evals = recorded_evaluations(p / "evals.jsonl", warnings)
    config: dict[str, Any] = {}
    if (p / "config.json").is_file():
        with (p / "config.json").open("rb") as f:
            raw = f.read(logs.MAX_LINE_BYTES + 1)  # no config the guard wrote is longer
        read = json_object(raw, exact=False) if len(raw) <= logs.MAX_LINE_BYTES else None
        if read is None or _depth(read) > MAX_DEPTH:
            warnings.append("config.json is not a JSON object: the config is not shown")
        else:
            config = read
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
        evals=evals,
    )
