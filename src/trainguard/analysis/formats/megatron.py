"""Megatron-LM's stdout (and Megatron-DeepSpeed's): `iteration N/ M | ... | learning rate: X |
... | lm loss: X | loss scale: X | grad norm: X | ... | number of nan iterations: K |`, and
`validation loss at iteration N | lm loss value: X`. The loss is the mean over the logging
interval of the finite iterations: an interval that counted NaN iterations is read as NaN, and
one that counted skipped iterations (non-finite gradients) has no grad norm."""

from __future__ import annotations

import re

from trainguard.analysis.formats.lines import LineFormat, Row, pattern

FIELD = re.compile(r"([A-Za-z][A-Za-z _-]*?)\s*:\s*([^|]+?)\s*(?=\||$)")
KEYS = {"learning rate": "lr", "grad norm": "grad_norm", "loss scale": "loss_scale"}


def _adjust(row: Row, line: str) -> Row | None:
    """The line's `name: value` fields: the first loss that is not a validation's, the LR, grad
    norm and loss scale; NaN where the interval counted NaN iterations."""
    values = {name.strip().lower(): value for name, value in FIELD.findall(line)}
    loss = next(
        (v for k, v in values.items() if k.endswith("loss") and "valid" not in k),
        None,
    )
    if loss is None:
        return None
    row["loss"] = loss
    for name, key in KEYS.items():
        if name in values:
            row[key] = values[name]
    nans = values.get("number of nan iterations", "0")
    if nans.isdigit() and int(nans) > 0:
        row["loss"] = "nan"
    skipped = values.get("number of skipped iterations", "0")
    if skipped.isdigit() and int(skipped) > 0:
        row.pop("grad_norm", None)  # a step skipped for non-finite gradients: a NaN grad norm,
        # reported where the loss scale did not fall (`side_columns`; a scaler's calibration)
    return row


FORMAT = LineFormat(
    "megatron",
    "Megatron-LM stdout (iteration N/ M | lm loss: X | grad norm: X | ...)",
    # `, iteration N/M |` is NeMo 2's line (`Training epoch 0, iteration N/M | ...`)
    train=(pattern(r"(?<!, )\biteration\s+(?P<step>\d+)\s*/\s*\d+\s*\|"),),
    evals=(
        pattern(r"validation loss at iteration\s+(?P<step>\d+)\b.*?\bloss value:\s*(?P<loss>{N})"),
    ),
    adjust=_adjust,
).log_format()
