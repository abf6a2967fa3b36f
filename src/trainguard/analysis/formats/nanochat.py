"""nanochat's base-training stdout, as its speedrun's `speedrun.log` keeps it: `step N/M (p%) |
loss: X | [grad norm: X |] lrm: X | dt: ...` and `Step N | Validation bpb: X`; and the line of
its fork nanoswe, `[time] step N | loss X | lrm X | dt_ms X`. The speedrun's later stages in the
same file (mid-training and SFT) are other runs: reading stops where an evaluation's step goes
back, and their training lines (without the `/M` total) are not this format's."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from trainguard.analysis.formats import LogFormat, ReadOptions
from trainguard.analysis.formats.lines import ANSI, LineFormat, pattern, read_lines
from trainguard.analysis.logs import LogData

EVAL = pattern(r"^Step\s+(?P<step>\d+)\s*\|\s*Validation bpb:\s*(?P<loss>{N})")

LINES = LineFormat(
    "nanochat",
    "nanochat base_train stdout (step N/M (p%) | loss: X | lrm: X; Step N | Validation bpb: X)",
    train=(
        # no \b before `step`: a terminal's echoed arrow keys (`^[[A`) may stand right before it
        pattern(r"step\s+(?P<step>\d+)/\d+\s+\([\d.]+%\)\s*\|\s*loss:\s*(?P<loss>{N})"),
        pattern(r"\bstep\s+(?P<step>\d+)\s*\|\s*loss\s+(?P<loss>{N})\s*\|\s*lrm\b"),
    ),
    fields={"grad_norm": pattern(r"\|\s*grad norm:\s*(?P<grad_norm>{N})")},
    evals=(EVAL,),
)


def base_stage(lines: Iterable[str]) -> Iterator[str]:
    """The lines up to the first evaluation whose step is below the one before (mid-training's
    `Step 00000 | Validation bpb`, after base training's last)."""
    last = -1
    for line in lines:
        found = EVAL.search(ANSI.sub("", line) if "\x1b" in line else line)
        if found is not None:
            step = int(found["step"])
            if step < last:
                return
            last = step
        yield line


def _read(path: Path, options: ReadOptions) -> list[LogData]:
    return read_lines(
        path,
        lambda lines: LINES.parse_lines(base_stage(lines)),
        "no line of the nanochat format holds a step and a loss",
    )


FORMAT = LogFormat("nanochat", LINES.description, LINES.sniff, _read)
