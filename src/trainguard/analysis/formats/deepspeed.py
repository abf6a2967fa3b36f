"""DeepSpeed's stdout where it prints a step and a loss on one line: `steps: N loss: X ...`
(its timers and examples), or `step=N ... loss=X`; the engine's own `step=N, skipped=K,
lr=[x, y], mom=[...]` line gives step N its LR (the first parameter group's)."""

from __future__ import annotations

from trainguard.analysis.formats.lines import LineFormat, pattern

FORMAT = LineFormat(
    "deepspeed",
    "DeepSpeed stdout (steps: N loss: X, or step=N ... loss=X)",
    train=(
        pattern(r"\bsteps?:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{N})"),
        pattern(r"\bstep=(?P<step>\d+)\b.*?\bloss=(?P<loss>{N})"),
    ),
    fields={
        "lr": pattern(r"\blr[=:]\s*\[?(?P<lr>{N})"),
        "loss_scale": pattern(r"\b(?:loss_scale|cur_scale)[=:]\s*(?P<loss_scale>{N})"),
        "grad_norm": pattern(r"\bgrad_norm[=:]\s*(?P<grad_norm>{N})"),
    },
    side=(pattern(r"\bstep=(?P<step>\d+),\s*skipped=\d+,\s*lr=\[\s*(?P<lr>{N})"),),
).log_format()
