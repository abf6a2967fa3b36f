"""OLMo's stdout (allenai/OLMo `scripts/train.py`): a header line per logged step, `...INFO
[step=N/M,epoch=E]`, then one indented `name=value` line per metric (`train/CrossEntropyLoss=X`,
`optim/total_grad_norm=X`, `optim/learning_rate_group0=X`, `eval/<set>/CrossEntropyLoss=X`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from trainguard.analysis.formats import LogFormat, ReadOptions
from trainguard.analysis.formats.lines import (
    MAX_LINE,
    MOST_SURE,
    NUMERIC,
    ParsedLines,
    Row,
    read_lines,
)
from trainguard.analysis.logs import LogData

HEADER = re.compile(r"\[step=(\d+)(?:/\d+)?[,\]]")
METRIC = re.compile(r"^\s+([\w./ ()-]+?)=(\S+)\s*$")
KEYS = {
    "train/CrossEntropyLoss": "loss",
    "optim/total_grad_norm": "grad_norm",
    "optim/learning_rate_group0": "lr",
}


def sniff(path: Path, head: str) -> int:
    """How many training-loss lines of `head` follow a `[step=N` header (at most MOST_SURE)."""
    count, seen_header = 0, False
    for line in head.splitlines():
        if HEADER.search(line):
            seen_header = True
        elif seen_header and "train/CrossEntropyLoss=" in line:
            count += 1
            if count >= MOST_SURE:
                break
    return count


def parse_lines(lines: Iterable[str]) -> ParsedLines:
    """The rows of an OLMo log: each step's block of metric lines, gathered until the next
    unindented line."""
    out = ParsedLines()
    block: Row = {}
    evaluated: str | None = None

    def finish() -> None:
        if "step" in block and "loss" in block:
            out.add(block)
        if "step" in block and evaluated is not None:
            out.add_eval({"step": block["step"], "loss": evaluated})

    for line in lines:
        line = line.rstrip("\r\n")
        if not line.strip() or len(line) > MAX_LINE:
            continue
        header = HEADER.search(line)
        if header is not None:
            finish()
            block, evaluated = {"step": header[1]}, None
            continue
        metric = METRIC.match(line)
        if metric is None:
            if not line[0].isspace():  # the block ended
                finish()
                block, evaluated = {}, None
            continue
        name, value = metric[1], metric[2].replace(",", "")
        if not block or not NUMERIC.fullmatch(value):
            continue
        if name in KEYS:
            block[KEYS[name]] = value
        elif name.startswith("eval/") and name.endswith("/CrossEntropyLoss") and evaluated is None:
            evaluated = value
    finish()
    return out


def read(path: Path, options: ReadOptions) -> list[LogData]:
    return read_lines(
        path, parse_lines, "no [step=N] block of the olmo format holds a train/CrossEntropyLoss"
    )


FORMAT = LogFormat(
    "olmo",
    "OLMo stdout ([step=N/M] blocks of train/CrossEntropyLoss=X, optim/total_grad_norm=X)",
    sniff,
    read,
)
