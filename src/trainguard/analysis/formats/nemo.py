"""NVIDIA NeMo's stdout: the progress bar's `reduced_train_loss=X, global_step=N, ...` (drawn
again and again on one line with carriage returns), with `lr=X` and `val_loss=X` where shown."""

from __future__ import annotations

from trainguard.analysis.formats.lines import LineFormat, pattern

FORMAT = LineFormat(
    "nemo",
    "NeMo stdout (reduced_train_loss=X, global_step=N)",
    train=(pattern(r"\breduced_train_loss=(?P<loss>{N})"),),
    fields={
        "step": pattern(r"\bglobal_step=(?P<step>\d+)(?:\.0+)?\b"),
        "lr": pattern(r"\blr=(?P<lr>{N})"),
        "grad_norm": pattern(r"\bgrad_norm=(?P<grad_norm>{N})"),
    },
    evals=(pattern(r"\bval_loss=(?P<loss>{N})"),),
).log_format()
