"""A NaN that only a side column of a log shows: the grad norm (a step's, or an average over the
logging interval) NaN while the loss stayed finite, or a skipped iteration a reader turned into
one (Megatron's `number of skipped iterations`)."""

from __future__ import annotations

import numpy as np

from trainguard.events import Event

DENSE_SHARE = 0.9  # a column with a value on this share of the rows: its NaN is a NaN, not a gap


def side_column_nans(
    steps: np.ndarray,
    loss: np.ndarray,
    grad_norm: np.ndarray | None,
    loss_scale: np.ndarray | None = None,
) -> list[Event]:
    """One `nonfinite` warning for each stretch of rows whose grad norm is NaN while the loss is
    finite, in a grad-norm column that has a value on `DENSE_SHARE` of the rows (in a sparser
    column a NaN is a row the column skips) and on both sides of the stretch; a stretch where the
    loss scale fell (an fp16 scaler calibrating) is left to the overflow rules. The loss of such
    a step was skipped or averaged over, so nothing else in the log shows it."""
    if grad_norm is None or len(grad_norm) < 3:
        return []
    present = ~np.isnan(grad_norm)
    if present.mean() < DENSE_SHARE:
        return []
    bad = ~present & np.isfinite(loss)
    events: list[Event] = []
    starts = np.flatnonzero(bad & ~np.concatenate(([False], bad[:-1])))
    ends = np.flatnonzero(bad & ~np.concatenate((bad[1:], [False])))
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        if a == 0 or b == len(bad) - 1 or not (present[a - 1] and present[b + 1]):
            continue  # a column that starts or stops late, or a gap of the log
        if loss_scale is not None and _scale_fell(loss_scale, a, b):
            continue
        first, last = int(steps[a]), int(steps[b])
        count = b - a + 1
        message = (
            f"the gradient norm is NaN on {count} logged point(s) (steps {first}..{last}) while "
            "the loss stayed finite and the loss scale did not fall: a step's gradients were not "
            "finite (a NaN norm, an average over the logging interval that a NaN poisoned, or an "
            "iteration the trainer skipped), and only the log's grad-norm column shows it"
        )
        metrics = {
            "first_step": first,
            "last_step": last,
            "points": count,
            "loss": float(loss[a]),
            "column": "grad_norm",
        }
        events.append(Event(first, "nonfinite", "warning", message, metrics))
    return events


def _scale_fell(loss_scale: np.ndarray, a: int, b: int) -> bool:
    """Whether the loss scale after rows a..b is under the one before them (a scaler that met
    an overflow and lowered it); False where either is unknown."""
    before = loss_scale[:a][~np.isnan(loss_scale[:a])]
    after = loss_scale[b + 1 :][~np.isnan(loss_scale[b + 1 :])]
    return bool(len(before) and len(after) and after[0] < before[-1])
