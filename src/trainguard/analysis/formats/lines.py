"""`LineFormat`: a log a trainer prints line by line (stdout, log.txt), read with patterns for
its training lines and its evaluation lines."""

from __future__ import annotations

import gzip
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainguard.analysis import logs
from trainguard.analysis.formats import LogFormat, ReadOptions
from trainguard.analysis.logs import (
    BoundedLines,
    LogData,
    Thinner,
    columns_of,
    open_bytes,
)
from trainguard.events import TrainguardError

NUMBER = r"[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|NaN|NAN|inf|Inf|INF|infinity)"
NUMERIC = re.compile(NUMBER)  # a value `adjust` took from free text must be a number
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # colour codes (torchtitan, rich, loguru)
FIELDS = ("grad_norm", "lr", "loss_scale")
MAX_LINE = 1 << 16  # a longer line is no trainer's log line (a data dump): passed over
MOST_SURE = 99  # a count of matching lines scores at most this: a format's own marker wins

Row = dict[str, str]  # a line's values: step, loss, and any of FIELDS


def first_match(patterns: Iterable[re.Pattern[str]], line: str) -> Row | None:
    """The named groups that matched, of the first of `patterns` that matches `line`."""
    for found in patterns:
        match = found.search(line)
        if match is not None:
            return {k: v for k, v in match.groupdict().items() if v is not None}
    return None


def numeric(row: Row) -> Row:
    """The fields of `row` whose text is a number."""
    return {k: v for k, v in row.items() if NUMERIC.fullmatch(v.strip())}


@dataclass
class ParsedLines:
    """Training rows and evaluation rows, in file order; a row printed again for the same step
    right after (a progress bar's redraw) replaces the one before. With `repeats_last_eval`, an
    evaluation's loss printed again unchanged on later lines is that evaluation, not a new one."""

    rows: dict[str, list[float]] = field(
        default_factory=lambda: {k: [] for k in ("step", "loss", *FIELDS)}
    )
    evals: dict[str, list[float]] = field(default_factory=lambda: {"step": [], "loss": []})
    repeats_last_eval: bool = False
    pending: Row | None = None  # fields printed for a step whose row is yet to come
    # rows before the last, handed on a block at a time and thinned past the limits
    done: Thinner = field(default_factory=lambda: Thinner(logs.MAX_ROWS))
    done_evals: Thinner = field(default_factory=lambda: Thinner(logs.MAX_EVAL_ROWS, lowest=True))

    def _flush(self) -> None:
        """Hand every row but the last (which a redraw may still replace) to the thinners."""
        for lists, thinner in ((self.rows, self.done), (self.evals, self.done_evals)):
            if len(lists["step"]) > logs.FLUSH_ROWS:
                thinner.add({k: np.asarray(v[:-1], dtype=np.float64) for k, v in lists.items()})
                for v in lists.values():
                    del v[:-1]

    def columns(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every training row and evaluation kept, as columns in file order."""
        out = []
        for lists, thinner in ((self.rows, self.done), (self.evals, self.done_evals)):
            if lists["step"]:
                thinner.add({k: np.asarray(v, dtype=np.float64) for k, v in lists.items()})
            out.append(thinner.columns())
        return out[0], out[1]

    def notes(self, name: str) -> list[str]:
        """The lines that say how rows and evaluations were thinned, where they were."""
        return [
            thinner.note(name, what)
            for thinner, what in ((self.done, "rows"), (self.done_evals, "evaluations"))
            if thinner.thinned
        ]

    def add(self, row: Row) -> None:
        step = float(row["step"])
        if self.pending is not None:
            if float(self.pending["step"]) == step:
                row = {**{k: v for k, v in self.pending.items() if k in FIELDS}, **row}
            self.pending = None
        again = bool(self.rows["step"]) and self.rows["step"][-1] == step
        for key in ("step", "loss", *FIELDS):
            value = step if key == "step" else value_of(row.get(key))
            if again:
                if key not in FIELDS or key in row:  # a field the redraw lacks is kept
                    self.rows[key][-1] = value
            else:
                self.rows[key].append(value)
        if not again:
            self._flush()

    def add_fields(self, row: Row) -> None:
        """Fields a line without a loss printed for a step: they fill that step's row, printed
        just before or just after it (a value the row has is kept)."""
        step = float(row["step"])
        if self.rows["step"] and self.rows["step"][-1] == step:
            for key in FIELDS:
                if key in row and math.isnan(self.rows[key][-1]):
                    self.rows[key][-1] = value_of(row[key])
        else:
            self.pending = row

    def add_eval(self, row: Row) -> None:
        step = float(row["step"]) if "step" in row else self.last_step
        loss = value_of(row["loss"])
        if self.repeats_last_eval and self.evals["loss"] and _same(self.evals["loss"][-1], loss):
            return
        if self.evals["step"] and self.evals["step"][-1] == step:
            self.evals["loss"][-1] = loss
            return
        self.evals["step"].append(step)
        self.evals["loss"].append(loss)
        self._flush()

    @property
    def last_step(self) -> float:
        return self.rows["step"][-1] if self.rows["step"] else 0.0


@dataclass(frozen=True)
class LineFormat:
    """A text log. `train` matches a training line (groups `step` and `loss`); `fields` find
    grad_norm, lr or loss_scale on it (or the step, printed apart from the loss); `evals` match
    an evaluation line (`loss`, and `step` unless it is the last training step's); `adjust` may
    rewrite a matched row from its line, or drop it (None); `repeats_last_eval` says the format
    prints its last evaluation's loss again on every later line (NeMo's); `side` match a line
    with a step and fields but no loss (DeepSpeed's `step=N, ..., lr=[...]`), whose fields fill
    that step's row."""

    name: str
    description: str
    train: tuple[re.Pattern[str], ...]
    fields: dict[str, re.Pattern[str]] = field(default_factory=dict)
    evals: tuple[re.Pattern[str], ...] = ()
    adjust: Callable[[Row, str], Row | None] | None = None
    repeats_last_eval: bool = False
    side: tuple[re.Pattern[str], ...] = ()

    def sniff(self, path: Path, head: str) -> int:
        """How many lines of `head` are this format's (at most MOST_SURE)."""
        count = 0
        for line in head.splitlines():  # at \r too: a progress bar's redraws
            if len(line) > MAX_LINE:
                continue
            clean = ANSI.sub("", line) if "\x1b" in line else line
            if any(p.search(clean) for p in self.train + self.evals):
                count += 1
                if count >= MOST_SURE:
                    break
        return count

    def parse_lines(self, lines: Iterable[str]) -> ParsedLines:
        """The rows of `lines` (as a file opened with newline="" yields them: split at \r too,
        ends kept)."""
        out = ParsedLines(repeats_last_eval=self.repeats_last_eval)
        for line in lines:
            line = line.rstrip("\r\n")
            if not line.strip() or len(line) > MAX_LINE:
                continue
            if "\x1b" in line:
                line = ANSI.sub("", line)
            row = self._train_row(line)
            if row is not None:
                out.add(row)
            else:
                fields = self._side_row(line)
                if fields is not None:
                    out.add_fields(fields)
            evaluated = self._eval_row(line)  # a line may hold both (a progress bar's)
            if evaluated is not None:
                out.add_eval(evaluated)
        return out

    def _train_row(self, line: str) -> Row | None:
        row = first_match(self.train, line)
        if row is None:
            return None
        for key, found in self.fields.items():
            hit = found.search(line)
            if hit is not None and key not in row:
                row[key] = hit[key]
        if self.adjust is not None:
            row = self.adjust(row, line)
            if row is None:
                return None
        row = numeric(row)  # "n/a", "--"
        return row if "step" in row and "loss" in row else None

    def _side_row(self, line: str) -> Row | None:
        row = first_match(self.side, line)
        if row is None:
            return None
        row = numeric(row)
        return row if "step" in row and any(k in row for k in FIELDS) else None

    def _eval_row(self, line: str) -> Row | None:
        row = first_match(self.evals, line)
        if row is None:
            return None
        step = self.fields.get("step")
        hit = step.search(line) if step is not None and "step" not in row else None
        if hit is not None:
            row["step"] = hit["step"]
        return row

    def read(self, path: Path, options: ReadOptions) -> list[LogData]:
        return read_lines(
            path, self.parse_lines, f"no line of the {self.name} format holds a step and a loss"
        )

    def log_format(self) -> LogFormat:
        return LogFormat(self.name, self.description, self.sniff, self.read)


def read_lines(
    path: Path, parse: Callable[[Iterable[str]], ParsedLines], none_found: str
) -> list[LogData]:
    """A text log read line by line (gzip or plain, decoded, bounded) and parsed by `parse`;
    `none_found` says what was missing where no row came out."""
    try:
        with open_bytes(path) as f:
            lines = BoundedLines(f, cr=True)  # a progress bar's redraws are lines
            parsed = parse(_decoded(lines))
    except gzip.BadGzipFile:  # said by read_runs, as every damaged gzip is
        raise
    except OSError as exc:
        raise TrainguardError(
            f"cannot read {path}: {exc.strerror or exc}; check the path and its permissions"
        ) from None
    rows, evals = parsed.columns()
    if not len(rows.get("step", ())) and not len(evals.get("step", ())):
        raise TrainguardError(f"{path}: {none_found}; name another format with --format")
    long = lines.note(path.name)
    notes = parsed.notes(path.name) + ([long] if long is not None else [])
    return [columns_of(path, rows, evals, notes=notes)]


def _decoded(lines: BoundedLines) -> Iterator[str]:
    """The lines as text (UTF-8, undecodable bytes replaced, a byte order mark dropped)."""
    for number, line in enumerate(lines):
        text = line.decode("utf-8", errors="replace")
        yield text.removeprefix("\ufeff") if number == 0 else text


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def value_of(text: str | None) -> float:
    """A printed number as a float (NaN where none was printed)."""
    if text is None:
        return float("nan")
    return float(text.strip().lower().replace("infinity", "inf"))


def pattern(text: str, flags: int = 0) -> re.Pattern[str]:
    """A line pattern with `{N}` standing for a printed number (NaN and Inf included)."""
    return re.compile(text.replace("{N}", NUMBER), flags)
