"""torchtitan's stdout: `step: N  loss: X  grad_norm: X  memory: ... tps: ... mfu: ...` (in
colour codes, which are dropped)."""

from __future__ import annotations

from trainguard.analysis.formats.lines import LineFormat, pattern

FORMAT = LineFormat(
    "torchtitan",
    "torchtitan stdout (step: N  loss: X  grad_norm: X ...)",
    train=(pattern(r"(?<!validate )\bstep:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{N})"),),
    fields={"grad_norm": pattern(r"\bgrad_norm:\s*(?P<grad_norm>{N})")},
    evals=(pattern(r"\bvalidate step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{N})"),),
).log_format()
