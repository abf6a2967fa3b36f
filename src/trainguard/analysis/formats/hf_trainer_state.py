"""Hugging Face Trainer's `trainer_state.json`: its `log_history` list holds the training logs
(`step`, `loss`, `grad_norm`, `learning_rate`, TRL's `mean_token_accuracy`) and the evaluations
(every `eval_*` result: `eval_loss`, `eval_accuracy`, ...; not its runtime or throughput). The
file is streamed: `log_history`'s entries are decoded one at a time, never the whole document."""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from trainguard.analysis import logs
from trainguard.analysis.formats import SURE, LogFormat, ReadOptions
from trainguard.analysis.logs import (
    MAX_STEP,
    Evaluation,
    LogData,
    Thinner,
    columns_of,
    first_evaluations,
    is_evaluation,
    number,
    open_text,
    timeline_of,
)
from trainguard.events import TrainguardError

MAX_EVAL_NAMES = 256  # evaluation names gathered (16 are judged, losses first)
KEYS = {"grad_norm": "grad_norm", "lr": "learning_rate", "token_accuracy": "mean_token_accuracy"}


def _sniff(path: Path, head: str) -> int:
    if '"log_history"' in head and head.lstrip().startswith("{"):
        return SURE
    return SURE if path.name == "trainer_state.json" else 0


def _read(path: Path, options: ReadOptions) -> list[LogData]:
    rows: dict[str, array[float]] = {k: array("d") for k in ("step", "loss", *KEYS)}
    done = Thinner(logs.MAX_ROWS)  # the rows before, thinned past the limit
    evals = Evaluation()  # eval_loss, as the text formats' validation loss
    named: dict[str, Evaluation] = {}  # every eval_* result, by name
    dropped: set[str] = set()  # eval_* names past MAX_EVAL_NAMES
    try:
        with open_text(path, errors="strict") as f:
            for entry in _log_history(path, f):
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
                    if len(rows["step"]) >= logs.FLUSH_ROWS:
                        done.add({k: np.frombuffer(v) for k, v in rows.items()})
                        rows = {k: array("d") for k in rows}
                eval_loss = number(entry.get("eval_loss"))
                if eval_loss is not None:
                    evals.append(step, eval_loss)
                for key, value in entry.items():
                    result = number(value) if is_evaluation(key) else None
                    if result is None:
                        continue
                    if key not in named and len(named) >= MAX_EVAL_NAMES:
                        if len(dropped) < MAX_EVAL_NAMES:
                            dropped.add(key)
                        continue
                    named.setdefault(key, Evaluation()).append(step, result)
    except (ValueError, RecursionError) as exc:
        raise TrainguardError(
            f"{path}: not a readable trainer_state.json ({exc}); give the file the Trainer "
            "wrote, whole"
        ) from None
    if len(rows["step"]):
        done.add({k: np.frombuffer(v) for k, v in rows.items()})
    notes = [done.note(path.name)] if done.thinned else []
    if evals.rows.thinned:
        notes.append(evals.rows.note(f"{path.name} eval_loss", "values"))
    eval_steps, eval_values = evals.columns()
    columns = done.columns()
    data = columns_of(
        path, columns, {"step": eval_steps, "loss": eval_values}, "log_history entry", notes
    )
    if len(columns.get("step", ())):  # evaluations beside a training loss (not standing in)
        for key in first_evaluations(list(named)):
            steps, values = named[key].columns()
            if np.all(np.abs(steps) < MAX_STEP):
                data.evaluations[key] = timeline_of(steps, values)
                if named[key].rows.thinned:
                    data.warnings.append(named[key].rows.note(f"{path.name} {key}", "values"))
    if dropped:
        data.warnings.append(
            f"{path.name}: read the first {MAX_EVAL_NAMES} evaluation names only; passed over "
            f"{', '.join(sorted(dropped)[:5])}{' and more' if len(dropped) > 5 else ''}"
        )
    return [data]


class _Window:
    """A JSON document read a block at a time, with a window of its text held, never the whole:
    a value is decoded once the window holds it whole, and one over `MAX_LINE_BYTES` is
    refused."""

    def __init__(self, path: Path, f: IO[str]) -> None:
        self.path = path
        self.f = f
        self.text = ""
        self.at = 0
        self.ended = False

    def _more(self) -> bool:
        """Read another block into the window (dropping what was decoded); False at the end."""
        if self.ended:
            return False
        chunk = self.f.read(logs.READ_BYTES)
        self.text = self.text[self.at :] + chunk
        self.at = 0
        self.ended = not chunk
        return bool(chunk)

    def peek(self) -> str:
        """The next character that is not white space ("" at the end), not consumed."""
        while True:
            while self.at < len(self.text) and self.text[self.at] in " \t\r\n":
                self.at += 1
            if self.at < len(self.text) or not self._more():
                return self.text[self.at : self.at + 1]

    def expect(self, chars: str) -> str:
        """Consume the next character, which must be one of `chars`."""
        found = self.peek()
        if not found or found not in chars:
            shown = repr(found) if found else "the end of the file"
            raise ValueError(f"expected one of {chars!r}, found {shown}")
        self.at += 1
        return found

    def value(self) -> Any:
        """Decode the next JSON value, reading on until the window holds it whole."""
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, self.at)
            except json.JSONDecodeError:
                end = None
            # a value that ends where the window does may go on (a number cut in two)
            if end is not None and (end < len(self.text) or self.ended):
                self.at = end
                return value
            if len(self.text) - self.at > logs.MAX_LINE_BYTES:
                raise TrainguardError(
                    f"{self.path}: a value of over {logs.MAX_LINE_BYTES:,} bytes (no "
                    "log_history entry is that long); give the trainer_state.json the Trainer "
                    "wrote"
                )
            if not self._more():
                raise ValueError("the file ends inside a value")


_DECODER = json.JSONDecoder()


def _log_history(path: Path, f: IO[str]) -> Iterator[Any]:
    """The entries of a trainer_state.json's `log_history`, decoded one at a time as the file
    streams by (the other keys' values are decoded and dropped); a document that is not an
    object, or has no `log_history` list, is a one-line error."""
    window = _Window(path, f)
    window.expect("{")
    found = False
    if window.peek() == "}":
        window.expect("}")
    else:
        while True:
            key = window.value()
            window.expect(":")
            if key == "log_history" and window.peek() == "[":
                found = True
                window.expect("[")
                if window.peek() == "]":
                    window.expect("]")
                else:
                    while True:
                        yield window.value()
                        if window.expect(",]") == "]":
                            break
            else:
                window.value()
            if window.expect(",}") == "}":
                break
    if window.peek():
        raise ValueError("extra data after the JSON object")
    if not found:
        raise TrainguardError(
            f"{path}: no 'log_history' list; give the trainer_state.json a Hugging Face "
            "Trainer wrote"
        )


FORMAT = LogFormat(
    "hf_trainer_state",
    "Hugging Face Trainer's trainer_state.json (log_history)",
    _sniff,
    _read,
)
