"""The log formats `read_log` knows, one module each: found by content, or named with
`--format`. A format says how sure it is that a file is its own (`sniff`) and reads it into
`LogData` runs (`read`); adding one is a module and a line in `formats()`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.events import TrainguardError

if TYPE_CHECKING:
    from trainguard.analysis.logs import LogData


@dataclass(frozen=True)
class ReadOptions:
    """What the user named: the loss and step columns (or TensorBoard tag) of a generic log."""

    loss_column: str = "loss"
    step_column: str = "step"
    tag: str | None = None


@dataclass(frozen=True)
class LogFormat:
    """One format: `sniff(path, head)` scores a file (0: not this format; higher: surer),
    `read(path, options)` reads it into one `LogData` per run the file holds."""

    name: str
    description: str
    sniff: Callable[[Path, str], int]
    read: Callable[[Path, ReadOptions], list[LogData]]


SURE = 100  # a format's own marker (a file name, a key only it writes)
LIKELY = 50  # a structure that fits (a header with its columns)


def formats() -> list[LogFormat]:
    """Every known format, the most specific first."""
    from trainguard.analysis.formats import (
        deepspeed,
        generic,
        hf_stdout,
        hf_trainer_state,
        lightning_csv,
        llmc,
        megatron,
        modded_nanogpt,
        nanochat,
        nanogpt,
        nemo,
        olmo,
        torchtitan,
        wandb_csv,
    )

    return [
        hf_trainer_state.FORMAT,
        wandb_csv.FORMAT,
        lightning_csv.FORMAT,
        generic.JSONL,
        generic.CSV,
        megatron.FORMAT,
        torchtitan.FORMAT,
        llmc.FORMAT,
        nanogpt.FORMAT,
        nanogpt.BUILD_NANOGPT,
        modded_nanogpt.FORMAT,
        nanochat.FORMAT,
        deepspeed.FORMAT,
        nemo.FORMAT,
        olmo.FORMAT,
        hf_stdout.FORMAT,
    ]


def names() -> list[str]:
    """The names `--format` takes."""
    return [f.name for f in formats()] + ["tensorboard"]


def by_name(name: str) -> LogFormat:
    """The format called `name`; a one-line error listing the names otherwise."""
    for f in formats():
        if f.name == name:
            return f
    raise TrainguardError(f"no log format '{name}'; the formats are: {', '.join(names())}")


GENERIC = ("csv", "jsonl")  # the formats whose columns the user may name


def detect(path: Path, head: str, shown: Path | None = None) -> LogFormat:
    """The format that scores `head` (the file's first bytes) highest; a one-line error that
    lists the formats when none does, naming the file `shown` (`path` when None)."""
    scored = [(f.sniff(path, head), i, f) for i, f in enumerate(formats())]
    best = max(scored, key=lambda s: (s[0], -s[1]))
    if best[0] <= 0:
        raise TrainguardError(
            f"{shown or path}: no known log format matched; the formats are: {', '.join(names())} "
            "(force one with --format NAME, or give a CSV/JSONL log with step and loss columns)"
        )
    return best[2]
