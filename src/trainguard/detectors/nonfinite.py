"""`NonFiniteDetector`: NaN/Inf in the loss or gradients, and fp16 loss-scale overflow."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trainguard.config import OverflowConfig
from trainguard.detectors.base import Detector, MetricPoint, fmt
from trainguard.detectors.series import MetricSeries, first_true
from trainguard.events import Event

UNMOVED_REL = 0.1  # an overflow row's loss is at most this much over the recent losses' maximum
UNMOVED_POINTS = 8  # the finite losses before a row that it is held against


def inferred_overflow(loss: np.ndarray, grad_norm: np.ndarray | None) -> np.ndarray | None:
    """The rows of a log that read as fp16 overflow steps a GradScaler skipped: an infinite grad
    norm while the loss is finite and has not moved (at most `UNMOVED_REL` over the largest of
    the `UNMOVED_POINTS` finite losses before it). A log has no overflow flag of its own; with
    this one, such a row is `fp16_overflow` (info), critical only once overflow persists or the
    loss scale collapses, as in a live run. None when the log has no grad norm."""
    if grad_norm is None:
        return None
    candidates: np.ndarray = np.isinf(grad_norm) & np.isfinite(loss)
    if not candidates.any():
        return candidates
    idx = np.flatnonzero(np.isfinite(loss))
    v = loss[idx]
    padded = np.concatenate((np.full(UNMOVED_POINTS, -np.inf), v))
    recent = sliding_window_view(padded, UNMOVED_POINTS)[: len(v)].max(axis=1)  # before each
    with np.errstate(invalid="ignore", over="ignore"):  # no loss before the first rows
        limit = np.where(np.isfinite(recent), recent + UNMOVED_REL * np.abs(recent), np.inf)
    unmoved = np.zeros(len(loss), dtype=bool)
    unmoved[idx] = v <= limit
    out: np.ndarray = candidates & unmoved
    return out


def _flagged(loss: Any, grads_bad: Any, overflow: Any) -> Any:
    """The steps that raise an event: a non-finite loss or gradients, or an overflow (arrays of
    steps, or one step's float and bools)."""
    bad_loss = ~np.isfinite(loss) if isinstance(loss, np.ndarray) else not math.isfinite(loss)
    return bad_loss | grads_bad | overflow


class NonFiniteDetector(Detector):
    """NaN/Inf loss or gradients are `nonfinite` (critical), naming the parameters; a GradScaler
    overflow is `fp16_overflow` (info) until the scale collapses or overflow persists."""

    name = "nonfinite"
    _state = ("overflow_run", "overflow_total")

    def __init__(self, config: OverflowConfig | None = None) -> None:
        self.config = config or OverflowConfig()
        self.overflow_run = 0
        self.overflow_total = 0

    def update(self, point: MetricPoint) -> list[Event]:
        if point.overflow:
            return self._overflow(point)
        self.overflow_run = 0
        if not _flagged(point.loss, not point.grads_finite, point.overflow):
            return []
        parts = []
        if not point.loss_finite:
            parts.append(f"the loss is {point.loss}")
        if point.nonfinite_grads:
            names = ", ".join(point.nonfinite_params)
            more = point.nonfinite_grads - len(point.nonfinite_params)
            parts.append(
                f"{point.nonfinite_grads} parameter(s) have non-finite gradients: {names}"
                + (f" and {more} more" if more > 0 else "")
            )
        elif not point.grads_finite:
            parts.append(f"the gradient norm is {point.grad_norm}")
        metrics = {
            "loss": point.loss,
            "grad_norm": point.grad_norm,
            "nonfinite_grads": point.nonfinite_grads,
            "params": point.nonfinite_params,
        }
        return [self.event(point, "critical", "; ".join(parts), metrics)]

    def advance(self, series: MetricSeries, start: int) -> int:
        end = series.chunk_end(start)
        grads_bad = np.zeros(end - start, dtype=bool)
        if series.grad_norm is not None:  # NaN marks a grad norm the log does not have
            grads_bad |= np.isinf(series.grad_norm[start:end])
        if series.nonfinite_grads is not None:
            grads_bad |= series.nonfinite_grads[start:end] > 0
        overflow = np.zeros(end - start, dtype=bool)
        if series.overflow is not None:
            overflow = series.overflow[start:end]
        first = first_true(_flagged(series.loss[start:end], grads_bad, overflow))
        f = end - start if first is None else first
        if f > 0:
            self.overflow_run = 0
        return start + f

    def _overflow(self, point: MetricPoint) -> list[Event]:
        self.overflow_run += 1
        self.overflow_total += 1
        cfg = self.config
        scale = point.loss_scale
        metrics = {
            "loss_scale": scale,
            "consecutive": self.overflow_run,
            "total": self.overflow_total,
            "params": point.nonfinite_params,
        }
        collapsed = scale is not None and scale <= cfg.min_loss_scale
        if collapsed or self.overflow_run >= cfg.patience:
            why = (
                f"the loss scale fell to {fmt(scale)}"
                if collapsed
                else f"gradients overflowed on {self.overflow_run} steps in a row"
            )
            message = f"fp16 overflow is no longer calibration: {why}; gradients are non-finite"
            return [self.event(point, "critical", message, metrics, kind="nonfinite")]
        message = (
            f"fp16 overflow: the scaler skipped this step and lowers the loss scale "
            f"from {fmt(scale)}"
            if scale is not None
            else "fp16 overflow: the gradient norm is not finite while the loss did not move, "
            "as when a loss scaler skips a step (the log has no loss scale to tell)"
        )
        return [self.event(point, "info", message, metrics, kind="fp16_overflow")]
