"""`read_log`: a loss log as columns, in any format `analysis.formats` knows (CSV, TSV, JSONL,
TensorBoard event files, and the native logs of the trainers people use), gzip-compressed or
not, streamed so that memory stays bounded on any input: past `MAX_ROWS` rows a log is thinned
as it is read (`Thinner`), and a line over `MAX_LINE_BYTES` is passed over unread."""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import math
import re
import warnings
import zlib
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import numpy as np

from trainguard.detectors.base import EvalPoint
from trainguard.detectors.series import MetricSeries
from trainguard.events import TrainguardError
from trainguard.line_writer import flush_writers

if TYPE_CHECKING:
    from trainguard.analysis.formats import LogFormat, ReadOptions

# the count columns: NaN and skipped iterations (`side_columns.COUNT_COLUMNS`)
OPTIONAL = (
    "grad_norm",
    "lr",
    "loss_scale",
    "token_accuracy",
    "nan_iterations",
    "skipped_iterations",
)
MAX_WARNED_ROWS = 10
USE_PANDAS = True  # parse clean blocks with pandas when it is installed
BLOCK_BYTES = 1 << 24  # bytes parsed at once; a block with a bad row is parsed row by row
MAX_ROWS = 1_000_000  # training rows judged at most; past it a log is thinned (`Thinner`)
MAX_EVAL_ROWS = 20_000  # values of one evaluation judged at most, thinned the same way
MAX_LINE_BYTES = 1 << 20  # a longer line (or CSV row, or header) is passed over, never held
READ_BYTES = 1 << 20  # the block a line reader reads at once
FLUSH_ROWS = 1 << 16  # rows gathered one by one are handed to a `Thinner` this many at a time
MAX_STEP = 2.0**63  # a step must fit the int64 step column
LONG_INT_DIGITS = 300  # longer JSON integers are read as floats: no later float() overflows
SNIFF_BYTES = 1 << 20  # the head a format is recognised by (a log may open with source code)
BINARY_SHARE = 0.1  # a head with more undecodable characters than this is not a text log
MAX_NAMES_SHOWN = 12  # column names an error lists
PRESCAN_LINES = 200  # a JSONL log's first objects, whose keys choose the columns read
GZIP_MAGIC = b"\x1f\x8b"  # the first bytes of a gzip file, whatever its name
LOG_SUFFIXES = (".log", ".txt", ".out", ".err", ".csv", ".tsv", ".jsonl", ".json")  # and .gz
MAX_FOLDER_FILES = 100  # the files of a folder looked into for its one log
MIN_FOLDER_SCORE = 2  # how sure a format must be that a file of a folder is a log
TOKEN_ACCURACY_NAMES = (
    "token_accuracy",
    "train/token_accuracy",
    "train_token_accuracy",
    "mean_token_accuracy",
    "train/mean_token_accuracy",
)
# the columns of a log that hold an evaluation: named with one of these prefixes, and not one of
# the timing figures an evaluation logs beside its results
EVAL_PREFIXES = ("eval_", "eval/", "val_", "val/", "valid_", "valid/", "validation_", "validation/")
EVAL_NOT = (  # runtime, throughput and counts
    "time", "per_second", "samples", "num_tokens", "epoch", "_number", "_support", "_count",
)  # fmt: skip
MAX_EVALUATIONS = 16  # evaluations read from one log: losses first, then one-word metrics
TB_TAGS = {  # TensorBoard tags tried in order when none is named
    "loss": ("loss", "train/loss", "train_loss", "training/loss", "loss/train"),
    "grad_norm": ("grad_norm", "train/grad_norm", "gradient_norm", "train/gradient_norm"),
    "lr": ("lr", "learning_rate", "train/learning_rate", "train/lr", "lr-AdamW", "lr-Adam"),
    "loss_scale": ("loss_scale", "train/loss_scale"),
    "token_accuracy": TOKEN_ACCURACY_NAMES,
    "nan_iterations": ("nan_iterations", "train/nan_iterations", "num_nan_iterations"),
    "skipped_iterations": ("skipped_iterations", "train/skipped_iterations", "skipped_steps"),
}


@dataclass
class LogData:
    """Sorted, de-duplicated steps with their loss (NaN or Inf where the run logged a non-finite
    loss) and, when present, grad norm, LR, loss scale; the rows a later row of the same step
    replaced (`abandoned`, as a rollback leaves them); the events a guarded run recorded beside
    its metrics.jsonl (`recorded`, JSON objects of events.jsonl)."""

    steps: np.ndarray
    loss: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    abandoned: dict[str, np.ndarray] = field(default_factory=dict)  # "step", "loss"
    recorded: list[dict[str, Any]] | None = None  # None: no events.jsonl beside the log
    evals: dict[str, np.ndarray] = field(default_factory=dict)  # "step", "loss": evaluations
    # every evaluation by name: (steps, values), in step order
    evaluations: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    format: str = ""  # the format it was read as
    run: str | None = None  # the run's name, in a file that holds several
    # a guarded run's precursors (metrics.jsonl's `precursors`), one entry a step (None: none)
    precursors: list[dict[str, dict[str, float]] | None] | None = None

    def named_evaluations(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every evaluation by name: `evaluations`, else the evaluation loss of `evals` (the
        text formats' validation loss) as `val_loss`."""
        if self.evaluations:
            return self.evaluations
        if len(self.evals.get("step", ())):
            return {"val_loss": (self.evals["step"], self.evals["loss"])}
        return {}

    def series(self) -> MetricSeries:
        """The columns as the detectors read them (NaN marks a missing value), with the
        evaluations in step order."""
        points = [
            EvalPoint.of(int(step), name, float(value))
            for name, (steps, values) in self.named_evaluations().items()
            for step, value in zip(steps.tolist(), values.tolist(), strict=True)
        ]
        return MetricSeries(
            self.steps,
            self.loss,
            grad_norm=self.extra.get("grad_norm"),
            lr=self.extra.get("lr"),
            loss_scale=self.extra.get("loss_scale"),
            token_accuracy=self.extra.get("token_accuracy"),
            evals=sorted(points, key=lambda e: e.step),
            precursors=self.precursors,
        )


class Thinner:
    """Rows (columns step, loss, ...) kept within `cap` while they stream in, deterministically:
    under the cap every row; past it, of each run of `stride` rows (a power of two, doubled as
    needed) the first, the highest loss and grad norm (and the lowest loss, with `lowest`), and
    the first and last non-finite one, so spikes and NaNs are still found. Picking composes:
    thinning kept rows at a doubled stride keeps what thinning every row would."""

    def __init__(self, cap: int, lowest: bool = False) -> None:
        self.cap = cap
        self.lowest = lowest
        self.stride = 1
        self.total = 0
        self.parts: list[dict[str, np.ndarray]] = []  # under the cap: the blocks as they came
        self.index = np.empty(0, dtype=np.int64)  # past it: the row numbers kept...
        self.kept: dict[str, np.ndarray] = {}  # ...and their values

    def add(self, block: Mapping[str, np.ndarray]) -> None:
        """Take a block of rows (equal-length columns, the same keys every time)."""
        n = len(block["step"]) if "step" in block else 0
        if n == 0:
            return
        start, self.total = self.total, self.total + n
        if self.stride == 1 and self.total <= self.cap:
            self.parts.append(dict(block))
            return
        if self.stride == 1:  # the first time over the cap: every row so far
            parts, self.parts = [*self.parts, dict(block)], []
            self.kept = {k: np.concatenate([b[k] for b in parts]) for k in block}
            self.index = np.arange(self.total, dtype=np.int64)
            del parts
        else:  # the new rows, with the kept rows of the run they continue
            cut = int(np.searchsorted(self.index, start - start % self.stride))
            index = np.concatenate([self.index[cut:], np.arange(start, self.total)])
            rest = {k: np.concatenate([self.kept[k][cut:], block[k]]) for k in block}
            keep = _picked(index // self.stride, rest, self.lowest)
            self.index = np.concatenate([self.index[:cut], index[keep]])
            self.kept = {k: np.concatenate([self.kept[k][:cut], rest[k][keep]]) for k in block}
        while len(self.index) > self.cap and self.stride < self.total:  # one run holds all
            self.stride *= 2
            keep = _picked(self.index // self.stride, self.kept, self.lowest)
            self.index = self.index[keep]
            self.kept = {k: v[keep] for k, v in self.kept.items()}

    @property
    def thinned(self) -> bool:
        """Whether rows were dropped."""
        return self.stride > 1

    def columns(self) -> dict[str, np.ndarray]:
        """The rows kept, as columns (released from the thinner)."""
        if not self.thinned:
            parts, self.parts = self.parts, []
            keys = parts[0].keys() if parts else ()
            return {k: np.concatenate([b[k] for b in parts]) for k in keys}
        kept, self.kept = self.kept, {}
        return kept

    def note(self, name: str, what: str = "rows") -> str:
        """The line that says how a thinned stream was judged."""
        extreme = "highest and lowest" if self.lowest else "highest loss and grad norm"
        return (
            f"{name}: {self.total:,} {what}, over the limit of {self.cap:,}; judged "
            f"{len(self.index):,} of them: every {_nth(self.stride)} plus, of each "
            f"{self.stride:,}, the {extreme} and the first and last non-finite one"
        )


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n:,}{suffix}"


def _picked(bucket: np.ndarray, cols: Mapping[str, np.ndarray], lowest: bool) -> np.ndarray:
    """Which rows (sorted by row number; `bucket` is each one's run of rows) a thinning keeps:
    of each run the first, the highest (and lowest) finite loss, the highest grad norm and
    counts, and the first and last row with a non-finite loss or an infinite figure."""
    n = len(bucket)
    keep = np.zeros(n, dtype=bool)
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    keep[starts] = True
    sizes = np.diff(np.r_[starts, n])
    extremes = [("loss", 1.0), ("grad_norm", 1.0), ("nan_iterations", 1.0)]
    extremes += [("skipped_iterations", 1.0)] + ([("loss", -1.0)] if lowest else [])
    for key, sign in extremes:
        if key not in cols:
            continue
        values = cols[key]
        finite = np.isfinite(values)
        filled = np.where(finite, values * sign, -np.inf)
        top = np.maximum.reduceat(filled, starts)
        hit = np.flatnonzero(finite & (filled == np.repeat(top, sizes)))
        keep[_ends(bucket, hit, first=True)] = True
    bad = ~np.isfinite(cols["loss"])
    for key in OPTIONAL:
        if key in cols:
            bad |= np.isinf(cols[key])
    rows = np.flatnonzero(bad)
    keep[_ends(bucket, rows, first=True)] = True
    keep[_ends(bucket, rows, first=False)] = True
    return keep


def _ends(bucket: np.ndarray, rows: np.ndarray, first: bool) -> np.ndarray:
    """The first (or last) of `rows` in each run they fall in."""
    if len(rows) == 0:
        return rows
    runs = bucket[rows]
    change = runs[1:] != runs[:-1]
    return rows[np.r_[True, change] if first else np.r_[change, True]]


class BoundedLines:
    """The lines of a binary stream, without their ends, read a block at a time: a line over
    `limit` bytes is passed over (counted in `long`) as it streams by, never held whole. With
    `cr`, a carriage return ends a line too (a progress bar's redraws)."""

    def __init__(self, f: IO[bytes], limit: int | None = None, cr: bool = False) -> None:
        self.f = f
        self.limit = MAX_LINE_BYTES if limit is None else limit
        self.cr = cr
        self.long = 0  # lines passed over for their length
        self.unfinished = False  # the last line had no newline

    def __iter__(self) -> Iterator[bytes]:
        rest, skipping = b"", False
        while True:
            chunk = self.f.read(READ_BYTES)
            if not chunk:
                break
            if self.cr:
                chunk = chunk.replace(b"\r", b"\n")
            if skipping:  # the rest of a long line
                end = chunk.find(b"\n")
                if end < 0:
                    continue
                chunk, skipping = chunk[end + 1 :], False
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                if len(line) > self.limit:
                    self.long += 1
                else:
                    yield line
            if len(rest) > self.limit:
                self.long += 1
                rest, skipping = b"", True
        if rest:
            self.unfinished = True
            yield rest
        elif skipping:
            self.unfinished = True

    def note(self, name: str) -> str | None:
        """The line that says how many long lines were passed over; None when none was."""
        if not self.long:
            return None
        return (
            f"{name}: passed over {self.long:,} line(s) longer than {self.limit:,} bytes, "
            "unread (no log line is that long)"
        )


class _Columns:
    """Rows gathered into typed arrays (8 bytes a value), with the line numbers passed over."""

    def __init__(
        self, unit: str = "line", other_rows: bool = False, evaluation: bool = False
    ) -> None:
        self.unit = unit  # what a passed-over row is named by: a file's line, or a step
        self.other_rows = other_rows  # rows without a loss are another kind's: no warning
        # an evaluation's values are thinned to fewer, keeping its lowest as well as its highest
        self.rows = Thinner(MAX_EVAL_ROWS if evaluation else MAX_ROWS, lowest=evaluation)
        self.notes: list[str] = []  # said before the others (long lines passed over)
        self.bad: list[int] = []
        self.bad_count = 0
        self.last_bad: int | None = None
        self.unfinished: int | None = None  # the last line, when the file ends without a newline

    def add(self, block: dict[str, np.ndarray]) -> None:
        self.rows.add(block)

    def skip(self, line: int) -> None:
        self.bad_count += 1
        self.last_bad = line
        if len(self.bad) < MAX_WARNED_ROWS:
            self.bad.append(line)

    def _truncated_note(self) -> str | None:
        """A passed-over last line without a newline is a write cut short (a crash, a full
        disk): it is told apart from the bad rows."""
        if self.unfinished is None or self.last_bad != self.unfinished:
            return None
        self.bad_count -= 1
        if self.unfinished in self.bad:
            self.bad.remove(self.unfinished)
        return f"skipped the truncated last line {self.unfinished}, as a run cut short leaves it"

    def finish(self, p: Path) -> LogData:
        columns = self.rows.columns()
        steps = columns.pop("step", np.empty(0))
        if len(steps) == 0:
            raise TrainguardError(
                f"{p}: no row has a numeric step and a numeric loss; give a log of the run's "
                "loss (NaN and Inf count as numbers)"
            )
        loss = columns.pop("loss")
        extra = {k: columns.pop(k) for k in OPTIONAL if k in columns}
        notes = list(self.notes)
        if self.rows.thinned:
            notes.insert(0, self.rows.note(p.name))
        truncated = self._truncated_note()
        if self.bad_count:
            shown = ", ".join(str(n) for n in self.bad)
            more = self.bad_count - len(self.bad)
            notes.append(
                f"passed over {self.bad_count} row(s) without a numeric step and loss: "
                f"{self.unit} {shown}" + (f" and {more} more" if more > 0 else "")
            )
        if truncated:
            notes.append(truncated)
        order = steps.astype(np.int64)
        del steps
        abandoned: dict[str, np.ndarray] = {}
        if len(order) > 1 and not np.all(order[1:] > order[:-1]):
            notes.append(
                "steps go back or repeat (a restart, or a rollback's replay): kept the last row "
                "of each step, the earlier ones apart as abandoned"
            )
            keep, dropped = final_timeline(order)
            abandoned = {"step": order[dropped], "loss": loss[dropped]}
            order, loss = order[keep], loss[keep]
            extra = {k: v[keep] for k, v in extra.items()}
        extra = {k: v for k, v in extra.items() if (~np.isnan(v)).any()}  # an all-Inf column stays
        return LogData(order, loss, extra, notes, abandoned)


def columns_of(
    p: Path,
    rows: Mapping[str, Sequence[float] | np.ndarray],
    evals: Mapping[str, Sequence[float] | np.ndarray],
    unit: str = "line",
    notes: Sequence[str] = (),
) -> LogData:
    """`LogData` from a format's rows (step, loss and any of OPTIONAL, in file order) and its
    evaluations (step, loss), with the format's `notes` said first (how it thinned them). A log
    with evaluations alone is judged on them, with a warning."""
    eval_steps = np.asarray(evals.get("step", ()), dtype=np.float64)
    eval_loss = np.asarray(evals.get("loss", ()), dtype=np.float64)
    fits = np.abs(eval_steps) < MAX_STEP  # a step must fit the int64 step column
    eval_steps, eval_loss = eval_steps[fits], eval_loss[fits]
    only_evals = len(rows.get("step", ())) == 0 and len(eval_steps) > 0
    out = _Columns(unit=unit)
    out.notes += notes
    huge = 0
    if only_evals:
        out.add({"step": eval_steps, "loss": eval_loss})
    elif len(rows.get("step", ())):
        block = {k: np.asarray(v, dtype=np.float64) for k, v in rows.items()}
        fits = np.abs(block["step"]) < MAX_STEP
        huge = int((~fits).sum())
        out.add({k: v[fits] for k, v in block.items()})  # finish drops all-NaN columns
    data = out.finish(p)
    if huge:
        data.warnings.append(f"passed over {huge} row(s) whose step does not fit 64 bits")
    if only_evals:
        data.warnings.insert(0, "the log has no training loss: judging its evaluation loss")
    elif len(eval_steps):
        order = eval_steps.astype(np.int64)
        keep, _ = final_timeline(order)
        data.evals = {"step": order[keep], "loss": eval_loss[keep]}
    return data


def final_timeline(steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of the final timeline (the last row of each step, in step order) and the rows a
    later row of the same step replaced, in file order: the steps a rollback or resume
    abandoned and replayed."""
    order = np.asarray(steps, dtype=np.int64)
    # the last row of each step: unique over the reversed rows keeps first occurrences
    _, first = np.unique(order[::-1], return_index=True)
    keep = len(order) - 1 - first
    gone = np.ones(len(order), dtype=bool)
    gone[keep] = False
    return keep, np.flatnonzero(gone)


def read_log(
    path: str | Path,
    loss_column: str = "loss",
    step_column: str = "step",
    tag: str | None = None,
    format: str | None = None,
    run: str | None = None,
) -> LogData:
    """Read a log of one run (or the run named `run` of a file that holds several); see
    `read_runs`."""
    runs = read_runs(path, loss_column, step_column, tag, format, run)
    if len(runs) > 1:
        shown = ", ".join(str(r.run) for r in runs[:MAX_NAMES_SHOWN])
        raise TrainguardError(f"{path} holds {len(runs)} runs ({shown}); name one with --run NAME")
    return runs[0]


def read_runs(
    path: str | Path,
    loss_column: str = "loss",
    step_column: str = "step",
    tag: str | None = None,
    format: str | None = None,
    run: str | None = None,
) -> list[LogData]:
    """Read a log, in the format named or the one its content shows (`analysis.formats`), as
    one `LogData` per run it holds. Rows with a missing or non-numeric loss or step are passed
    over with a warning naming them (a NaN or Inf loss is kept: it is the run's, and an
    incident); unsorted and repeated steps are sorted (the last row wins, the rows it replaced
    are kept apart as `abandoned`). A trainguard metrics.jsonl brings the events.jsonl beside
    it (`recorded`)."""
    from trainguard.analysis import formats

    flush_writers()  # a live run of this process: every line it recorded

    p = Path(path)
    options = formats.ReadOptions(loss_column, step_column, tag)
    tb_tag = tag or (loss_column if loss_column != "loss" else None)
    chosen = formats.by_name(format) if format not in (None, "tensorboard") else None
    note = None  # which file of a folder was read, when the folder named no run file
    if p.is_dir():
        found = next(
            (
                p / n
                for n in ("metrics.jsonl", "trainer_state.json", "metrics.csv")
                if (p / n).is_file()
            ),
            None,
        )
        if found is not None and format != "tensorboard":
            p = found
        elif any(p.rglob("events.out.tfevents.*")):
            return _tensorboard_runs(p, tb_tag, run)
        else:
            p, note = _the_log_in(p, chosen)
    if not p.exists():
        raise TrainguardError(f"{p}: no such file; give the path of a training log")
    if not p.is_file():
        raise TrainguardError(
            f"{p} is not a regular file (a pipe, socket or device): give the path of a log file"
        )
    try:
        if p.stat().st_size == 0:
            raise TrainguardError(f"{p} is empty: there is nothing to analyse")
        if format == "tensorboard" or p.name.startswith("events.out.tfevents"):
            return _tensorboard_runs(p, tb_tag, run)
        head, named = text_head(p)
        fmt = chosen or formats.detect(named, head, shown=p)
        if (loss_column, step_column) != ("loss", "step") and fmt.name not in formats.GENERIC:
            raise TrainguardError(
                f"{p} reads as a {fmt.name} log: --column and --step-column name the columns "
                "of a CSV or JSONL log; drop them"
            )
        runs = fmt.read(p, options)
        for data in runs:
            data.format = fmt.name
            data.warnings = _one_line_for_thinned_evaluations(p.name, data.warnings)
            if note is not None:
                data.warnings.insert(0, note)
        if p.name == "metrics.jsonl" and (p.parent / "events.jsonl").is_file():
            from trainguard.analysis.run import recorded_events

            runs[0].recorded = recorded_events(p.parent / "events.jsonl", runs[0].warnings)
        if p.name == "metrics.jsonl" and (p.parent / "evals.jsonl").is_file():
            from trainguard.analysis.run import recorded_evaluations

            runs[0].evaluations = recorded_evaluations(p.parent / "evals.jsonl", runs[0].warnings)
        return _chosen_run(p, runs, run)
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise _damaged_gzip(p, exc) from None
    except OSError as exc:
        raise TrainguardError(
            f"cannot read {p}: {exc.strerror or exc}; check the path and its permissions"
        ) from None


def _one_line_for_thinned_evaluations(name: str, warnings: list[str]) -> list[str]:
    """The notes of evaluations thinned past `MAX_EVAL_ROWS` as one line where there are more
    than two (a log may have 16 evaluations)."""
    found = re.compile(rf"^{re.escape(name)} (.+?): [\d,]+ values, over the limit of ([\d,]+);")
    thinned = [(w, m) for w in warnings if (m := found.match(w)) is not None]
    if len(thinned) <= 2:
        return warnings
    names = [m[1] for _, m in thinned]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    line = (
        f"{name}: {len(names)} evaluations over the limit of {thinned[0][1][2]} values each "
        f"({shown}); each judged on a thinning that keeps its highest, lowest and first and last "
        "non-finite values"
    )
    at = warnings.index(thinned[0][0])
    dropped = {w for w, _ in thinned}
    rest = [w for w in warnings if w not in dropped]
    return [*rest[:at], line, *rest[at:]]


def _the_log_in(folder: Path, chosen: LogFormat | None) -> tuple[Path, str]:
    """The one log of a folder that holds no run file (metrics.jsonl, ...): the one file, by
    its name a log (`LOG_SUFFIXES`, gzipped or not), whose content a format (`chosen`, else any)
    recognises, with a note that says so. Several such files, or none, are a one-line error
    that names the files found."""
    files = sorted(
        f
        for f in folder.iterdir()
        if f.is_file()
        and not f.name.startswith(".")
        and f.name != "events.jsonl"  # a guarded run's events, never its loss log
        and f.name.lower().removesuffix(".gz").endswith(LOG_SUFFIXES)
    )
    if not files:
        raise TrainguardError(
            f"{folder} is a directory without metrics.jsonl, trainer_state.json, metrics.csv, "
            "TensorBoard event files or a log file (.log, .txt, .out, .csv, .jsonl, ...); "
            "give the path of a log"
        )
    logs = [f for f in files[:MAX_FOLDER_FILES] if _is_log(f, chosen)]
    if len(logs) == 1:
        return logs[0], f"read {logs[0].name}: the one log in {folder}"
    if logs:
        raise TrainguardError(
            f"{folder} holds {len(logs)} logs ({_listed(logs)}): pass one of them, e.g. "
            f"trainguard analyze {logs[0]}"
        )
    kind = f"in the {chosen.name} format" if chosen is not None else "in a known format"
    raise TrainguardError(
        f"{folder} holds no log {kind} (found: {_listed(files)}); pass one of these files, "
        "with --format NAME if its format is not found"
    )


def _is_log(p: Path, chosen: LogFormat | None) -> bool:
    """Whether a file's content is a log of the format `chosen` (of any known format when
    None) by more than a hint: more than one line of a text log, or a CSV header whose columns
    are found without --column (a note with a comma in it is no log)."""
    from trainguard.analysis import formats

    try:
        head, named = text_head(p)
    except (TrainguardError, OSError, EOFError, zlib.error):
        return False
    candidates = [chosen] if chosen is not None else formats.formats()
    return max(f.sniff(named, head) for f in candidates) >= MIN_FOLDER_SCORE


def _listed(files: Sequence[Path]) -> str:
    shown = ", ".join(f.name for f in files[:MAX_NAMES_SHOWN])
    more = len(files) - MAX_NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _damaged_gzip(p: Path, exc: Exception) -> TrainguardError:
    return TrainguardError(
        f"{p}: a damaged gzip file ({exc}): it was cut short or corrupted; compress the log "
        "again, or give it uncompressed"
    )


def is_gzip(p: Path) -> bool:
    """Whether a file is gzip-compressed, told by its first bytes (not its name)."""
    with p.open("rb") as f:
        return f.read(len(GZIP_MAGIC)) == GZIP_MAGIC


def open_bytes(p: Path) -> IO[bytes]:
    """A log opened for reading its bytes, decompressed as it is read when it is gzipped."""
    if is_gzip(p):
        return cast(IO[bytes], gzip.open(p, "rb"))  # a GzipFile reads as a binary file does
    return p.open("rb")


def open_text(p: Path, errors: str = "replace", newline: str | None = None) -> IO[str]:
    """A log opened for reading its UTF-8 text (a byte order mark dropped), decompressed as it
    is read when it is gzipped."""
    if is_gzip(p):
        return gzip.open(p, "rt", encoding="utf-8-sig", errors=errors, newline=newline)
    return p.open(encoding="utf-8-sig", errors=errors, newline=newline)


def text_head(p: Path) -> tuple[str, Path]:
    """A log's first bytes as text (decompressed when it is gzipped), by which its format is
    found, and the name it is found by (a gzipped log's without `.gz`). A head that is empty
    once decompressed, or not text, is a one-line error."""
    compressed = is_gzip(p)
    with open_bytes(p) as f:
        raw = f.read(SNIFF_BYTES)
    if compressed and not raw:
        raise TrainguardError(f"{p} is empty once decompressed: there is nothing to analyse")
    head = raw.decode("utf-8", errors="replace").removeprefix("\ufeff")  # a BOM
    if _is_binary(raw[:4096], raw[:4096].decode("utf-8", errors="replace")):
        raise TrainguardError(
            f"{p} is not a text log (binary data, or text that is not UTF-8): give a CSV, "
            "TSV, JSONL or text log saved as UTF-8 (gzipped or not), or TensorBoard event files"
        )
    named = p.with_suffix("") if compressed and p.suffix.lower() == ".gz" else p
    return head, named


def _tensorboard_runs(p: Path, tag: str | None, run: str | None) -> list[LogData]:
    data = _tensorboard(p, tag)
    data.format = "tensorboard"
    return _chosen_run(p, [data], run)


def _chosen_run(p: Path, runs: list[LogData], run: str | None) -> list[LogData]:
    """The run named `run` (every run when None)."""
    if run is None:
        return runs
    kept = [r for r in runs if r.run == run]
    if not kept:
        if len(runs) == 1 and runs[0].run is None:
            raise TrainguardError(f"{p} holds one run: drop --run")
        shown = ", ".join(str(r.run) for r in runs[:MAX_NAMES_SHOWN])
        raise TrainguardError(f"{p}: no run '{run}' (the runs: {shown})")
    return kept


def delimiter_of(p: Path, first: str) -> str | None:
    """The delimiter of a CSV/TSV log from its name and header line; None when it has none."""
    if p.suffix.lower() == ".tsv" or "\t" in first:
        return "\t"
    if p.suffix.lower() == ".csv" or "," in first:
        return ","
    return None


def header_line(p: Path) -> str:
    """A file's first line, without its byte order mark and line end."""
    with open_bytes(p) as f:
        return header_bytes(f).decode("utf-8-sig", errors="replace").rstrip("\r\n")


def header_of(first: str, delimiter: str, p: Path | None = None) -> list[str]:
    """The column names of a header line."""
    try:
        with _field_limit(len(first)):
            header = next(csv.reader([first.rstrip("\r\n")], delimiter=delimiter), [])
    except csv.Error as exc:
        raise TrainguardError(
            f"{p or 'the log'}: the first line is not a header of column names ({exc}); "
            "the first line must name the columns"
        ) from None
    return [c.strip() for c in header]


def _is_binary(raw: bytes, head: str) -> bool:
    """A NUL byte, or many bytes that are not UTF-8, in the first block of a file."""
    return b"\x00" in raw or head.count("\ufffd") > BINARY_SHARE * max(len(head), 1)


def json_object(line: str | bytes, exact: bool = True) -> dict[str, Any] | None:
    """The JSON object on one line of a JSONL file, or None when the line holds none (it is not
    JSON, nests too deeply, or holds another JSON value).

    Integers of over `LONG_INT_DIGITS` digits are read as floats (inf past 1e308), so that no
    later float() of them overflows; `exact` tries the faster plain parser first, which leaves
    integers of up to Python's 4300-digit limit as they are."""
    try:
        value = json.loads(line) if exact else _LONG_INTS_AS_FLOATS.decode(_text(line))
    except (RecursionError, json.JSONDecodeError):
        return None
    except ValueError:  # an integer past Python's digit limit, or bytes that are not UTF-8
        return json_object(line, exact=False) if exact else None
    return value if isinstance(value, dict) else None


def _text(line: str | bytes) -> str:
    return line if isinstance(line, str) else line.decode("utf-8", errors="replace")


def _int_or_float(digits: str) -> int | float:
    return int(digits) if len(digits) <= LONG_INT_DIGITS else float(digits)


_LONG_INTS_AS_FLOATS = json.JSONDecoder(parse_int=_int_or_float)


def _missing(p: Path, name: str, found: set[str] | list[str]) -> TrainguardError:
    shown = [n if len(n) <= 40 else n[:37] + "..." for n in sorted(found)[:MAX_NAMES_SHOWN]]
    if len(found) > MAX_NAMES_SHOWN:
        shown.append(f"and {len(found) - MAX_NAMES_SHOWN} more")
    return TrainguardError(
        f"{p}: no '{name}' column (found: {', '.join(shown) or 'none'}); "
        "name the columns with --step-column and --column"
    )


def with_evals(p: Path, data: LogData, step: str, evaluated: str | None) -> LogData:
    """`data` with the evaluations of a CSV log's column `evaluated` (rows of other kinds
    leave it empty) kept apart; as it was when there is no such column or it holds nothing."""
    if evaluated is None:
        return data
    try:
        evals = delimited(
            p, ",", {"step": step, "loss": evaluated}, other_rows=True, evaluation=True
        )
    except TrainguardError:  # a column with no value in any row
        return data
    data.evals = {"step": evals.steps, "loss": evals.loss}
    data.warnings += thinning_notes(p, evals, evaluated)
    return data


def thinning_notes(p: Path, read: LogData, column: str) -> list[str]:
    """The note of an evaluation column read apart that was thinned, naming the column."""
    return [
        w.replace(f"{p.name}:", f"{p.name} {column}:", 1)
        for w in read.warnings
        if w.startswith(f"{p.name}:") and "over the limit of" in w
    ]


def is_evaluation(name: str) -> bool:
    """Whether a log's column (or a Trainer's metric) holds an evaluation's result: `eval_*`,
    `val_*`, `eval/*`, `val/*` and the like, but not its runtime or throughput."""
    low = name.lower()
    return low.startswith(EVAL_PREFIXES) and not low.endswith(EVAL_NOT)


def evaluation_columns(columns: Sequence[str], exclude: Sequence[str | None] = ()) -> list[str]:
    """The columns that hold evaluations (`is_evaluation`), less those in `exclude` (the
    training loss's), `MAX_EVALUATIONS` at most as `first_evaluations` picks them."""
    return first_evaluations([c for c in columns if is_evaluation(c) and c not in exclude])


def first_evaluations(names: Sequence[str]) -> list[str]:
    """The `MAX_EVALUATIONS` evaluations a log is judged on, in their order: losses first
    (`eval_loss`), then one-word metrics (`eval_accuracy`, `eval_f1`), then the rest (a
    per-class `eval_PER_f1`), so per-class columns never crowd out the loss."""

    def rank(name: str) -> int:
        low = name.lower()
        rest = low[next(len(p) for p in EVAL_PREFIXES if low.startswith(p)) :]
        return 0 if "loss" in low else 1 if "_" not in rest and "/" not in rest else 2

    return sorted(names, key=rank)[:MAX_EVALUATIONS]


def with_evaluations(
    p: Path, data: LogData, step: str, columns: Sequence[str], delimiter: str = ","
) -> LogData:
    """`data` with each evaluation column of a delimited log read apart (rows of other kinds
    leave its cells empty): `data.evaluations`; a column without a value is left out."""
    for column in columns:
        try:
            read = delimited(
                p, delimiter, {"step": step, "loss": column}, other_rows=True, evaluation=True
            )
        except TrainguardError:  # no value in any row
            continue
        data.evaluations[column] = (read.steps, read.loss)
        data.warnings += thinning_notes(p, read, column)
    return data


def number(text: object) -> float | None:
    """A cell or JSON value as a float; None when it holds no number."""
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        try:
            return float(text)
        except OverflowError:  # an integer past 1e308
            return math.inf if text > 0 else -math.inf
    if not isinstance(text, str):  # a JSON list, object or boolean
        return None
    try:
        return float(text.strip())
    except ValueError:
        return None


def delimited(
    p: Path,
    delimiter: str,
    names: dict[str, str],
    other_rows: bool = False,
    evaluation: bool = False,
) -> LogData:
    """A CSV/TSV log's columns `names` (keys step, loss and any of OPTIONAL; values the
    file's column names). With `other_rows`, a row without a loss is another kind of row (an
    evaluation's, in an interleaved log), passed over without a warning; with `evaluation`, the
    loss column is an evaluation's, thinned past `MAX_EVAL_ROWS`. A row longer than
    `MAX_LINE_BYTES` that spans blocks is passed over, never gathered."""
    out = _Columns(other_rows=other_rows, evaluation=evaluation)
    cut = 0  # rows too long to hold, read from their first MAX_LINE_BYTES
    with open_bytes(p) as f:
        first = header_bytes(f).decode("utf-8-sig", errors="replace")
        columns = header_of(first, delimiter, p)
        for key in ("step", "loss"):
            if names[key] not in columns:
                raise _missing(p, names[key], columns)
        wanted = {k: v for k, v in names.items() if v in columns}
        where = {key: columns.index(name) for key, name in wanted.items()}
        line, rest, tail, head = 2, b"", first[-1:], None
        while True:
            chunk = f.read(BLOCK_BYTES)
            tail = chunk[-1:].decode("latin-1") if chunk else tail
            if head is not None:  # the rest of a row too long to hold streams by
                end = chunk.find(b"\n")
                if chunk and end < 0:
                    continue
                if chunk:
                    chunk = head + chunk[end:]
                else:  # the file ends inside it
                    rest = head
                head = None
            data = rest + chunk
            end = data.rfind(b"\n") + 1 if chunk else len(data)
            data, rest = data[:end], data[end:]
            if data.strip():
                block = _fast_block(data, delimiter, where)
                if block is None:
                    text = data.decode("utf-8", errors="replace")
                    with _field_limit(len(text)):
                        block = _slow_block(text.splitlines(), delimiter, where, line, out)
                out.add(block)
            line += data.count(b"\n")
            if len(rest) > MAX_LINE_BYTES:  # its first cells are kept, the rest passed over
                cut, head, rest = cut + 1, rest[:MAX_LINE_BYTES], b""
            if not chunk:
                break
    if tail and tail != "\n":
        out.unfinished = line
    if cut:
        out.notes.append(
            f"read {cut:,} row(s) longer than {MAX_LINE_BYTES:,} bytes from their first "
            f"{MAX_LINE_BYTES:,} bytes only (a cell after that reads as empty)"
        )
    return out.finish(p)


def header_bytes(f: IO[bytes]) -> bytes:
    """A CSV's first line as read from `f`: its first `MAX_LINE_BYTES` when it is longer (the
    rest passed over as it streams by, never held)."""
    first = f.readline(MAX_LINE_BYTES)
    if len(first) == MAX_LINE_BYTES and not first.endswith(b"\n"):
        while (more := f.readline(READ_BYTES)) and not more.endswith(b"\n"):
            pass
    return first


def _fast_block(data: bytes, delimiter: str, where: dict[str, int]) -> dict[str, np.ndarray] | None:
    """A clean block parsed by a C reader (pandas' when installed, else numpy's); None when any
    row needs a closer look."""
    keys = list(where)
    cols = [where[k] for k in keys]
    try:
        table = _parse_pandas(data, delimiter, cols)
        if table is None:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                table = np.loadtxt(
                    io.BytesIO(data), delimiter=delimiter, usecols=cols, ndmin=2, dtype=np.float64
                )
    except Exception:  # any trouble in a C reader: the row-by-row path judges each row
        return None
    block = {k: table[:, i] for i, k in enumerate(keys)}
    if np.isnan(block["loss"]).any() or not (np.abs(block["step"]) < MAX_STEP).all():
        return None  # a NaN may be a reader's empty cell: the row-by-row path tells them apart
    return block


def _parse_pandas(data: bytes, delimiter: str, cols: list[int]) -> np.ndarray | None:
    """The block through pandas' C parser (about 5x numpy's speed), or None without pandas."""
    if not USE_PANDAS:
        return None
    try:
        import pandas as pd
    except ImportError:
        return None
    frame = pd.read_csv(
        io.BytesIO(data),
        sep=delimiter,
        header=None,
        usecols=cols,
        dtype=np.float64,
        skip_blank_lines=True,
        na_filter=False,
    )
    table: np.ndarray = frame[cols].to_numpy(dtype=np.float64)
    return table


@contextlib.contextmanager
def _field_limit(size: int) -> Iterator[None]:
    """csv's field size limit raised to at least `size` for a while: a field of a log may be as
    long as the text it is read from (a 50 MB note column is no reason to pass a row over)."""
    old = csv.field_size_limit()
    csv.field_size_limit(max(old, size))
    try:
        yield
    finally:
        csv.field_size_limit(old)


def _slow_block(
    lines: list[str],
    delimiter: str,
    where: dict[str, int],
    first_line: int,
    out: _Columns,
) -> dict[str, np.ndarray]:
    cols: dict[str, array[float]] = {k: array("d") for k in where}
    reader = csv.reader(lines, delimiter=delimiter)
    while True:
        lineno = first_line + reader.line_num  # where the next row starts
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error:  # a stray carriage return, or whatever else csv refuses
            out.skip(lineno)
            continue
        if not row or not any(cell.strip() for cell in row):
            continue
        cells = {k: (row[i] if i < len(row) else None) for k, i in where.items()}
        if not _keep(cells, cols) and not (out.other_rows and not (cells["loss"] or "").strip()):
            out.skip(lineno)
    return {
        k: np.frombuffer(v, dtype=np.float64) if len(v) else np.empty(0) for k, v in cols.items()
    }


def _keep(cells: Mapping[str, object], cols: dict[str, array[float]]) -> bool:
    step, loss = number(cells.get("step")), number(cells.get("loss"))
    if step is None or loss is None or not abs(step) < MAX_STEP:
        return False
    cols["step"].append(step)
    cols["loss"].append(loss)
    for key in OPTIONAL:
        if key in cols:
            v = number(cells.get(key))
            cols[key].append(math.nan if v is None else v)
    return True


def jsonl(
    p: Path,
    options: ReadOptions,
    names_for: Callable[[set[str], ReadOptions], dict[str, str]],
) -> LogData:
    """A JSONL log: the keys to read are chosen (`names_for`) from those of its first objects,
    with its evaluations (`evaluation_columns`), on rows of their own or not. Lines over
    `MAX_LINE_BYTES` are passed over with a count, and past `MAX_ROWS` rows the log is thinned."""
    seen: set[str] = set()
    with open_bytes(p) as f:
        for _, line in zip(range(PRESCAN_LINES), BoundedLines(f), strict=False):
            record = json_object(_no_bom(line)) if line.strip() else None
            if record is not None:
                seen.update(record)
    names = names_for(seen, options)
    evaluated = evaluation_columns(sorted(seen), exclude=list(names.values()))
    found = {name: Evaluation() for name in evaluated}
    out = _Columns()
    cols: dict[str, array[float]] = {k: array("d") for k in names}
    precursors: dict[int, Any] = {}  # step -> its last row's precursors, where any row had some
    lineno = pruned = 0  # pruned: the precursors kept at the last pruning
    with open_bytes(p) as f:
        lines = BoundedLines(f)
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json_object(_no_bom(line) if lineno == 1 else line)
            if record is None:
                out.skip(lineno)
                continue
            if len(seen) < 64:
                seen.update(record)
            cells = {key: record.get(name) for key, name in names.items()}
            evaluation = _keep_evaluations(record, names["step"], found)
            if _keep(cells, cols):  # a training row: its precursors, where it has any
                _note_precursors(record, cols["step"][-1], precursors)
            elif not evaluation:
                out.skip(lineno)
            if len(cols["step"]) >= FLUSH_ROWS:
                out.add({k: np.frombuffer(v, dtype=np.float64) for k, v in cols.items()})
                cols = {k: array("d") for k in names}
                if out.rows.thinned and len(precursors) > max(FLUSH_ROWS, 2 * pruned):
                    pruned = _prune_precursors(precursors, out.rows)
    if lines.unfinished:
        out.unfinished = lineno
    for key in ("step", "loss"):
        if names[key] not in seen:
            raise _missing(p, names[key], seen)
    out.add({k: np.frombuffer(v, dtype=np.float64) for k, v in cols.items() if len(v)})
    long = lines.note(p.name)
    if long is not None:
        out.notes.append(long)
    data = out.finish(p)
    for name, values in found.items():
        if values.count:
            data.evaluations[name] = timeline_of(*values.columns())
            if values.rows.thinned:
                data.warnings.append(values.rows.note(f"{p.name} {name}", "values"))
    if precursors:
        data.precursors = [precursors.get(int(s)) for s in data.steps]
    return data


def _no_bom(line: bytes) -> bytes:
    return line.removeprefix(b"\xef\xbb\xbf")


def _prune_precursors(precursors: dict[int, Any], rows: Thinner) -> int:
    """Drop the precursors of steps a thinning dropped (they are judged on no kept row); how
    many are left."""
    kept = set(rows.kept["step"].astype(np.int64).tolist())
    for step in [s for s in precursors if s not in kept]:
        del precursors[step]
    return len(precursors)


class Evaluation:
    """One evaluation's (step, value) pairs appended one at a time, thinned past
    `MAX_EVAL_ROWS` (its highest and lowest values kept)."""

    def __init__(self) -> None:
        self.rows = Thinner(MAX_EVAL_ROWS, lowest=True)
        self.steps: array[float] = array("d")
        self.values: array[float] = array("d")
        self.count = 0

    def append(self, step: float, value: float) -> None:
        self.steps.append(step)
        self.values.append(value)
        self.count += 1
        if len(self.steps) >= FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        block = {"step": np.frombuffer(self.steps), "loss": np.frombuffer(self.values)}
        self.rows.add(block)
        self.steps, self.values = array("d"), array("d")

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """The steps and values kept, in file order."""
        self._flush()
        kept = self.rows.columns()
        if not kept:
            return np.empty(0), np.empty(0)
        return kept["step"], kept["loss"]


def _keep_evaluations(record: dict[str, Any], step_key: str, found: dict[str, Evaluation]) -> bool:
    """Keep a JSON record's evaluations (`found`: name -> its values); whether it had any."""
    if not found:
        return False
    step = number(record.get(step_key))
    if step is None or not abs(step) < MAX_STEP:
        return False
    kept = False
    for name, evaluation in found.items():
        value = number(record.get(name))
        if value is not None:
            evaluation.append(step, value)
            kept = True
    return kept


def timeline_of(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An evaluation's steps (as integers) and values on its final timeline: in step order, the
    last value of a step repeated (a rollback's replay, a restart)."""
    order = np.asarray(steps, dtype=np.int64)
    keep, _ = final_timeline(order)
    return order[keep], np.asarray(values, dtype=np.float64)[keep]


def _note_precursors(record: dict[str, Any], step: float, found: dict[int, Any]) -> None:
    """Keep a row's `precursors` (signal -> layer -> number) by its step; a later row of a step
    replaces an earlier one's, as the final timeline keeps the last row of each step."""
    value = record.get("precursors")
    key = int(step)
    if isinstance(value, dict):
        found[key] = {
            str(signal): {
                str(layer): v for layer, x in layers.items() if (v := number(x)) is not None
            }
            for signal, layers in value.items()
            if isinstance(layers, dict)
        }
    elif key in found:
        found[key] = None


def _tensorboard(p: Path, tag: str | None) -> LogData:
    """Scalars of TensorBoard event files (a file, or every file under a directory)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import (
            EventAccumulator,
        )
    except ImportError:
        raise TrainguardError(
            "reading TensorBoard event files needs the tensorboard package: "
            "pip install 'trainguard[tensorboard]'"
        ) from None
    series: dict[str, dict[int, float]] = {}
    sampled: set[str] = set()  # scalars whose reservoir filled: a uniform sample of them
    files = [p] if p.is_file() else sorted(p.rglob("events.out.tfevents.*"))
    for file in files:
        acc = EventAccumulator(str(file), size_guidance={"scalars": MAX_ROWS})
        try:
            acc.Reload()
        except Exception as exc:  # the reader raises several kinds on a damaged file
            raise TrainguardError(
                f"{file}: not a readable TensorBoard event file ({exc})"
            ) from None
        for name in acc.Tags().get("scalars", []):
            values = series.setdefault(name, {})
            kept = acc.Scalars(name)
            if len(kept) >= MAX_ROWS:
                sampled.add(name)
            for ev in kept:
                values[int(ev.step)] = float(ev.value)
    if not series:
        raise TrainguardError(
            f"{p}: the TensorBoard files hold no scalars (or are not TensorBoard files): "
            "give the event files of a run that logged its loss"
        )
    chosen = _tb_tag(p, series, "loss", tag, required=True)
    assert chosen is not None
    steps = sorted(series[chosen])
    out = _Columns(unit="step")
    loss = np.array([series[chosen][s] for s in steps])
    block = {"step": np.array(steps, dtype=np.float64), "loss": loss}
    for key in OPTIONAL:
        name = _tb_tag(p, series, key, None, required=False)
        if name is not None:
            block[key] = np.array([series[name].get(s, math.nan) for s in steps])
    out.add(block)  # a NaN or Inf loss is the run's: kept, and judged an incident
    data = out.finish(p)
    data.warnings.insert(0, f"read the TensorBoard scalar '{chosen}'")
    if sampled & {chosen, *(_tb_tag(p, series, k, None, required=False) for k in OPTIONAL)}:
        data.warnings.insert(
            1,
            f"{p.name}: a scalar has over {MAX_ROWS:,} values in a file; judged TensorBoard's "
            f"uniform sample of {MAX_ROWS:,} (the last kept; a NaN between may be missed)",
        )
    return data


def _tb_tag(
    p: Path, series: dict[str, dict[int, float]], key: str, tag: str | None, required: bool
) -> str | None:
    if tag is not None:
        if tag not in series:
            raise TrainguardError(
                f"{p}: no TensorBoard scalar '{tag}' (found: {', '.join(sorted(series))})"
            )
        return tag
    for name in TB_TAGS[key]:
        if name in series:
            return name
    pattern = re.compile(rf"(^|/){re.escape(key)}$")
    matches = [n for n in sorted(series) if pattern.search(n)]
    if matches:
        return matches[0]
    if required:
        raise TrainguardError(
            f"{p}: no TensorBoard scalar looks like the loss (found: "
            f"{', '.join(sorted(series))}); name it with --tag"
        )
    return None
