"""A NaN that only a side column of a log shows: the grad norm (a step's, or an average over the
logging interval) NaN while the loss stayed finite, a skipped iteration a reader turned into
one (Megatron's `number of skipped iterations`), or a count column of NaN or skipped iterations
(`nan_iterations`, `skipped_iterations`) that rises above 0."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from trainguard.detectors.series import true_runs
from trainguard.events import Event, Severity

DENSE_SHARE = 0.9  # a column with a value on this share of the rows: its NaN is a NaN, not a gap
# the count columns a log reader fills (`OPTIONAL` in analysis/logs.py): what a counted
# iteration was, and the severity of a rise; a NaN loss is critical as a NaN loss row is
COUNT_COLUMNS: dict[str, tuple[str, Severity]] = {
    "nan_iterations": ("iteration(s) with a NaN or Inf loss", "critical"),
    "skipped_iterations": ("iteration(s) skipped for non-finite gradients", "warning"),
}


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
    for a, b in true_runs(bad):
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


def side_column_counts(
    steps: np.ndarray,
    loss: np.ndarray,
    counts: Mapping[str, np.ndarray],
    loss_scale: np.ndarray | None = None,
    reported: list[Event] | None = None,
) -> list[Event]:
    """One `nonfinite` event for each stretch of rows where a count column of `COUNT_COLUMNS`
    rose above the row before (a cumulative count) or above 0 (a count per logging interval,
    which falls back to 0), where the loss is finite (a NaN loss row is its own event). NaN
    iterations are critical; skipped iterations a warning, except where the loss scale fell (an
    fp16 scaler calibrating). A stretch that holds the step of a `reported` event is left out:
    the grad-norm column showed it. No event where a column is 0 throughout."""
    said = {e.step for e in reported or []}
    events: list[Event] = []
    for key, values in counts.items():
        if key not in COUNT_COLUMNS or len(values) != len(loss):
            continue
        what, severity = COUNT_COLUMNS[key]
        added = _added(values)
        rose = (added > 0) & np.isfinite(loss)
        for a, b in true_runs(rose):
            first, last = int(steps[a]), int(steps[b])
            if any(first <= s <= last for s in said):
                continue
            skipped = key == "skipped_iterations"
            if skipped and loss_scale is not None and _scale_fell(loss_scale, a, b):
                continue
            total = float(added[a : b + 1][rose[a : b + 1]].sum())
            told = f"{total:g}" if np.isfinite(total) else "an unbounded number of"
            message = (
                f"the log's {key} column counts {told} {what} at steps {first}..{last} while "
                "the loss stayed finite"
                + (" and the loss scale did not fall" if skipped else "")
                + ": the trainer averaged over or skipped them, and only this column shows it"
            )
            metrics = {
                "first_step": first,
                "last_step": last,
                "points": b - a + 1,
                "count": total,
                "loss": float(loss[a]),
                "column": key,
            }
            events.append(Event(first, "nonfinite", severity, message, metrics))
    return sorted(events, key=lambda e: e.step)


def _added(count: np.ndarray) -> np.ndarray:
    """What each row adds to a count column (0 where the row has no value): its rise over the
    row before where the column never falls (a running total), else its value (a count per
    logging interval)."""
    known = np.flatnonzero(~np.isnan(count))
    values = count[known]
    with np.errstate(invalid="ignore"):  # inf - inf: a count already unbounded stays so
        running = bool(np.all(np.diff(values) >= 0))
        rise = values - np.concatenate(([0.0], values[:-1])) if running else values
    added = np.zeros(len(count))
    added[known] = np.where(np.isnan(rise), 0.0, rise)
    return added
