"""nanoGPT's stdout (`iter N: loss X, time ...`, `step N: train loss X, val loss X`), and
build-nanogpt's `log.txt` (`N train X`, `N val X`) and stdout (`step N | loss: X | lr X |
norm: X | ...`, `validation loss: X`)."""

from __future__ import annotations

from trainguard.analysis.formats.lines import LineFormat, pattern

FORMAT = LineFormat(
    "nanogpt",
    "nanoGPT stdout (iter N: loss X; step N: train loss X, val loss X)",
    train=(pattern(r"\biter\s+(?P<step>\d+):\s*loss\s+(?P<loss>{N})"),),
    evals=(pattern(r"\bstep\s+(?P<step>\d+):\s*train loss\s+{N},\s*val loss\s+(?P<loss>{N})"),),
).log_format()

BUILD_NANOGPT = LineFormat(
    "build_nanogpt",
    "build-nanogpt log.txt (N train X) and stdout (step N | loss: X | lr X | norm: X)",
    train=(
        pattern(r"^(?P<step>\d+)\s+train\s+(?P<loss>{N})\s*$"),
        pattern(r"\bstep\s+(?P<step>\d+)\s*\|\s*loss:\s*(?P<loss>{N})"),
    ),
    fields={
        "lr": pattern(r"\|\s*lr:?\s+(?P<lr>{N})"),
        "grad_norm": pattern(r"\|\s*norm:\s*(?P<grad_norm>{N})"),
    },
    evals=(
        pattern(r"^(?P<step>\d+)\s+val\s+(?P<loss>{N})\s*$"),
        pattern(r"^validation loss:\s*(?P<loss>{N})"),
    ),
).log_format()
