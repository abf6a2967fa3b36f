"""llm.c's stdout (`step    N/M | loss X (+0.12z)| norm X (-0.3z)| lr X | ...`, and before its
z-scores `step    N/M | train loss X | norm X | lr X | ...`; `val loss X`) and its `main.log`
(`s:N trl:X lr:X norm:X`, `s:N tel:X`)."""

from __future__ import annotations

from trainguard.analysis.formats.lines import LineFormat, pattern

FORMAT = LineFormat(
    "llmc",
    "llm.c stdout (step N/M | loss X (z)| norm X | lr X) and main.log (s:N trl:X)",
    train=(
        pattern(r"\bstep\s+(?P<step>\d+)\s*/\s*\d+\s*[|:]\s*(?:train )?loss\s+(?P<loss>{N})"),
        pattern(r"^s:(?P<step>\d+)\s+trl:(?P<loss>{N})"),
    ),
    fields={
        "grad_norm": pattern(r"(?:\|\s*norm\s+|\bnorm:)(?P<grad_norm>{N})"),
        "lr": pattern(r"(?:\|\s*lr\s+|\blr:)(?P<lr>{N})"),
    },
    evals=(pattern(r"^val loss\s+(?P<loss>{N})"), pattern(r"^s:(?P<step>\d+)\s+tel:(?P<loss>{N})")),
).log_format()
