"""The Hugging Face Trainer's stdout as ms-swift prints it: one dict per logging step,
`{'loss': '1.92', 'grad_norm': '32.75', 'learning_rate': '4e-08', ..., 'global_step/max_steps':
'1/2353', ...}` (values quoted or not, inside a progress bar's redraws), and `{'eval_loss': X,
...}` for an evaluation. A dict without a step (the plain Trainer's) is not this format: its
step cannot be told."""

from __future__ import annotations

from trainguard.analysis.formats.lines import LineFormat, pattern

QUOTED = r"'?(?P<{key}>{{N}})'?"
STEP = r"(?:'global_step/max_steps':\s*'|'step':\s*)(?P<step>\d+)\b"  # the plain Trainer's has none

FORMAT = LineFormat(
    "hf_stdout",
    "Hugging Face Trainer / ms-swift stdout ({'loss': X, ..., 'global_step/max_steps': 'N/M'})",
    train=(pattern(r"\{'loss':\s*" + QUOTED.format(key="loss") + ".*?" + STEP),),
    fields={
        "grad_norm": pattern(r"'grad_norm':\s*" + QUOTED.format(key="grad_norm")),
        "lr": pattern(r"'learning_rate':\s*" + QUOTED.format(key="lr")),
    },
    evals=(pattern(r"\{'eval_loss':\s*" + QUOTED.format(key="loss") + ".*?" + STEP),),
).log_format()
