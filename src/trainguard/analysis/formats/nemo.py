"""NVIDIA NeMo's stdout: NeMo 1's progress bar (`reduced_train_loss=X, global_step=N, ...`,
drawn again and again on one line with carriage returns) and NeMo 2's lines (`Training epoch 0,
iteration N/M | lr: X | global_step: N | reduced_train_loss: X | ... | val_loss: X`), with the LR,
grad norm and `val_loss` where shown. Both print the last evaluation's loss again on every later
line: an unchanged `val_loss` is that evaluation, not a new one."""

from __future__ import annotations

from trainguard.analysis.formats.lines import LineFormat, pattern

KEY = r"(?<![-\w/])"  # a field of the bar or the line, not part of a checkpoint's file name

FORMAT = LineFormat(
    "nemo",
    "NeMo stdout (reduced_train_loss=X, global_step=N; NeMo 2: | reduced_train_loss: X |)",
    train=(pattern(KEY + r"reduced_train_loss[=:]\s*(?P<loss>{N})"),),
    fields={
        "step": pattern(KEY + r"global_step[=:]\s*(?P<step>\d+)(?:\.0+)?(?![\w.])"),
        "lr": pattern(KEY + r"lr[=:]\s*(?P<lr>{N})"),
        "grad_norm": pattern(KEY + r"(?:grad|gradient)_norm[=:]\s*(?P<grad_norm>{N})"),
    },
    evals=(pattern(KEY + r"val_loss[=:]\s*(?P<loss>{N})(?![\w.-])"),),
    repeats_last_eval=True,
).log_format()
