"""`MetricSeries`: a whole logged run as columns, and the window helpers the detectors compute
their per-step figures with, on a chunk of one step (`update`) or many (`advance`) alike."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trainguard.detectors.base import EvalPoint, MetricPoint

MIN_SPAN, MAX_SPAN = 1 << 10, 1 << 16  # steps one `advance` call looks ahead (see `span`)


@dataclass
class MetricSeries:
    """Columns of a run: `loss` and `steps` always, the rest optional; NaN marks a missing value
    in `grad_norm`, `lr` and `loss_scale`."""

    steps: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray | None = None
    lr: np.ndarray | None = None
    loss_scale: np.ndarray | None = None
    overflow: np.ndarray | None = None
    nonfinite_grads: np.ndarray | None = None
    group_grad_norms: list[dict[str, float] | None] | None = None
    group_param_norms: list[dict[str, float] | None] | None = None
    token_accuracy: np.ndarray | None = None  # NaN where the step has none
    # the run's evaluations in step order; each is fed after the steps up to its own
    evals: list[EvalPoint] = field(default_factory=list)
    # the sampled steps' precursors (signal -> layer -> value), None on the other steps
    precursors: list[dict[str, dict[str, float]] | None] | None = None
    span: int = MIN_SPAN  # look-ahead of `advance`: grows over quiet stretches, shrinks at events

    def __len__(self) -> int:
        return len(self.steps)

    def point(self, i: int) -> MetricPoint:
        return MetricPoint(
            step=int(self.steps[i]),
            loss=float(self.loss[i]),
            grad_norm=_present(self.grad_norm, i),
            lr=_present(self.lr, i),
            loss_scale=_present(self.loss_scale, i),
            overflow=bool(self.overflow[i]) if self.overflow is not None else False,
            nonfinite_grads=int(self.nonfinite_grads[i]) if self.nonfinite_grads is not None else 0,
            group_grad_norms=self.group_grad_norms[i] if self.group_grad_norms else None,
            group_param_norms=self.group_param_norms[i] if self.group_param_norms else None,
            token_accuracy=_present(self.token_accuracy, i),
            precursors=self.precursors[i] if self.precursors else None,
        )

    def part(self, start: int, end: int) -> MetricSeries:
        """The steps from `start` to `end` as a series of their own (views of the columns),
        without the evaluations."""

        def cut(column: np.ndarray | None) -> np.ndarray | None:
            return None if column is None else column[start:end]

        return MetricSeries(
            self.steps[start:end],
            self.loss[start:end],
            grad_norm=cut(self.grad_norm),
            lr=cut(self.lr),
            loss_scale=cut(self.loss_scale),
            overflow=cut(self.overflow),
            nonfinite_grads=cut(self.nonfinite_grads),
            group_grad_norms=self.group_grad_norms[start:end] if self.group_grad_norms else None,
            group_param_norms=(
                self.group_param_norms[start:end] if self.group_param_norms else None
            ),
            token_accuracy=cut(self.token_accuracy),
            precursors=self.precursors[start:end] if self.precursors else None,
        )

    @property
    def has_groups(self) -> bool:
        return bool(self.group_grad_norms) and any(self.group_grad_norms or ())

    @property
    def has_weight_norms(self) -> bool:
        return bool(self.group_param_norms) and any(self.group_param_norms or ())

    def finite_losses(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices (into the series) and values of the finite losses in the chunk at `start`."""
        end = self.chunk_end(start)
        idx = np.flatnonzero(np.isfinite(self.loss[start:end])) + start
        return idx, self.loss[idx]

    def finite_grads(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices and values of the steps in the chunk at `start` that a gradient detector reads:
        a present, finite grad norm and no non-finite gradient count."""
        assert self.grad_norm is not None, "a series without grad norms has none to read"
        end = self.chunk_end(start)
        g = self.grad_norm[start:end]
        ok = np.isfinite(g)
        if self.nonfinite_grads is not None:
            ok &= self.nonfinite_grads[start:end] == 0
        idx = np.flatnonzero(ok) + start
        return idx, self.grad_norm[idx]

    def chunk_end(self, start: int) -> int:
        return min(start + self.span, len(self))


def _present(column: np.ndarray | None, i: int) -> float | None:
    if column is None:
        return None
    v = float(column[i])
    return None if math.isnan(v) else v


def stop_at(idx: np.ndarray, first: int | None, series: MetricSeries, start: int) -> int:
    """Where `advance` stops: the series index of the first step needing `update`, or the end of
    the chunk when there is none."""
    if first is None:
        return series.chunk_end(start)
    return int(idx[first])


def true_runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """The first and last index of each run of True in a boolean array."""
    starts = np.flatnonzero(flags & ~np.concatenate(([False], flags[:-1])))
    ends = np.flatnonzero(flags & ~np.concatenate((flags[1:], [False])))
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def first_true(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


def trailing_means(values: np.ndarray, held: int, window: int) -> np.ndarray:
    """Mean of the (up to) `window` values before each new value, where `values` starts with the
    `held` values already in a detector's window."""
    if len(values) == held + 1:  # one new value, the live case: one sum, no prefix sums
        mean = mean_of(values[max(held - window, 0) : held])
        return np.array([mean], dtype=np.float64)
    sums = np.concatenate(([0.0], np.cumsum(values)))
    hi = np.arange(held, len(values))
    lo = np.maximum(hi - window, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        out: np.ndarray = (sums[hi] - sums[lo]) / (hi - lo)
    return out


def mean_of(values: np.ndarray) -> float:
    """The mean of one window (NaN when empty): `trailing_means` of a single new value."""
    return float(np.add.reduce(values)) / len(values) if len(values) else math.nan


def windows_of(values: np.ndarray, width: int) -> np.ndarray:
    """Each run of `width` consecutive values, a row each (a view); one window, the live case,
    without the cost of a strided view."""
    if len(values) == width:
        return values[None, :]
    return sliding_window_view(values, width)


def rolling_median(values: np.ndarray, width: int) -> np.ndarray:
    """Median of each run of `width` consecutive values (exact: a selection, not an estimate)."""
    if len(values) == width:  # one window, the live case: a sort of plain floats
        return np.array([median_of(values.tolist())], dtype=np.float64)
    if width == 5:  # the default level window: a min/max network, no sort
        a, b, c, d, e = (values[i : len(values) - 4 + i] for i in range(5))
        lo = np.maximum(np.minimum(a, b), np.minimum(c, d))
        hi = np.minimum(np.maximum(a, b), np.maximum(c, d))
        five: np.ndarray = np.maximum(np.minimum(lo, hi), np.minimum(np.maximum(lo, hi), e))
        return five
    if len(values) >= PANDAS_FROM * width:
        fast = _pandas_rolling_median(values, width)
        if fast is not None:
            return fast
    out: np.ndarray = np.median(windows_of(values, width), axis=1)
    return out


def median_of(values: list[float]) -> float:
    """The median of plain floats as `np.median` gives it (NaN where any value is NaN)."""
    if math.isnan(sum(values)) and any(v != v for v in values):  # NaN: the sum tells cheaply
        return math.nan
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


PANDAS_FROM = 64  # windows in a row from which pandas' rolling median (a skip list) pays off


def _pandas_rolling_median(values: np.ndarray, width: int) -> np.ndarray | None:
    """`rolling_median` in O(log width) a value through pandas (the `fast` extra), or None
    without it; the same selection, so the same figures."""
    try:
        import pandas as pd
    except ImportError:
        return None
    rolled = pd.Series(values).rolling(width).median().to_numpy(dtype=np.float64)
    out: np.ndarray = rolled[width - 1 :]
    return out


def noise_sigmas(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`stats.noise_and_drift` of each row, vectorised: (noises, drifts)."""
    diffs = np.diff(rows, axis=1)
    n = diffs.shape[1]
    if n < 2:
        return np.zeros(len(rows)), np.zeros(len(rows))
    centre = _median_rows(diffs)  # reorders the rows in place; what follows ignores order
    dev = diffs - centre
    mad = _median_rows(np.abs(dev))
    limit = 6.0 * 1.4826 * mad
    clipped = np.where(limit > 0, np.clip(dev, -limit, limit), dev)
    out: np.ndarray = np.sqrt(np.sum(clipped * clipped, axis=1) / n / 2.0)
    return out, centre[:, 0]


def _median_rows(rows: np.ndarray) -> np.ndarray:
    """The median of each row, as a column; partitions `rows` in place."""
    n = rows.shape[1]
    mid = n // 2
    if n % 2:
        rows.partition(mid, axis=1)
        return rows[:, mid : mid + 1].copy()
    rows.partition((mid - 1, mid), axis=1)
    out: np.ndarray = 0.5 * (rows[:, mid - 1 : mid] + rows[:, mid : mid + 1])
    return out


def ema(x: np.ndarray, start: float, alpha: float) -> np.ndarray:
    """y[0] = start, y[k+1] = (1 - alpha) y[k] + alpha x[k], vectorised in blocks short enough
    that the powers of (1 - alpha) stay well inside float range."""
    beta = 1.0 - alpha
    if len(x) == 1:  # one value, the live case: one multiply-add
        return np.array([start, ema_one(float(x[0]), start, alpha)], dtype=np.float64)
    block = max(1, min(4096, int(math.log(1e6) / -math.log(beta)))) if beta > 0 else 1
    out = np.empty(len(x) + 1)
    out[0] = start
    y = start
    for s in range(0, len(x), block):
        xs = x[s : s + block]
        k = np.arange(1, len(xs) + 1)
        powers = beta**k
        acc = np.cumsum(xs / beta ** np.arange(1, len(xs) + 1))
        seg = powers * y + alpha * powers * acc
        out[s + 1 : s + 1 + len(xs)] = seg
        y = float(seg[-1])
    return out


def ema_one(x: float, start: float, alpha: float) -> float:
    """`ema` after one value `x`."""
    return (1.0 - alpha) * start + alpha * x


def warm_ema_one(x: float, start: float, count: int, horizon: int) -> float:
    """`warm_ema` after one value `x`: the running mean while warming, else one EMA step."""
    if count < horizon:
        return (count * start + x) / (count + 1)
    return ema_one(x, start, 1.0 / horizon)


def warm_ema(x: np.ndarray, start: float, count: int, horizon: int) -> np.ndarray:
    """The running mean of the first values, then an EMA over `horizon`: y[k+1] = y[k] + a (x[k]
    - y[k]) with a = max(1 / horizon, 1 / n), n counting the values (`count` seen before)."""
    if len(x) == 1:  # one value, the live case
        return np.array([start, warm_ema_one(float(x[0]), start, count, horizon)])
    out = np.empty(len(x) + 1)
    out[0] = start
    warm = min(len(x), max(horizon - count, 0))
    if warm:
        n = count + np.arange(1, warm + 1)
        out[1 : warm + 1] = (count * start + np.cumsum(x[:warm])) / n
    if warm < len(x):
        out[warm:] = ema(x[warm:], float(out[warm]), 1.0 / horizon)
    return out


def maximum(a: Any, b: Any) -> Any:
    """`np.maximum`, on two floats without numpy's per-call cost where they differ (the same
    value: numpy decides ties, signed zeros and NaN)."""
    if type(a) is float and type(b) is float:
        if a > b:
            return a
        if b > a:
            return b
        return float(np.maximum(a, b))
    return np.maximum(a, b)


def square_root(x: Any) -> Any:
    """`np.sqrt`, on a float through `math.sqrt` (both correctly rounded) where it is defined."""
    if type(x) is float and x >= 0:
        return math.sqrt(x)
    return float(np.sqrt(x)) if isinstance(x, float) else np.sqrt(x)


def divide_where_positive(num: Any, den: Any, otherwise: float) -> Any:
    """`num / den` where `den` > 0, else `otherwise`: on arrays element by element, or on
    floats."""
    if isinstance(den, np.ndarray):
        with np.errstate(divide="ignore", invalid="ignore"):
            out: np.ndarray = np.where(den > 0, num / den, otherwise)
        return out
    return num / den if den > 0 else otherwise


def spread_sigmas(rows: np.ndarray) -> np.ndarray:
    """The noise of each row from its spread about a fitted quadratic (the MAD of the residuals,
    corrected for the three fitted terms): unlike first differences it does not shrink when the
    noise is correlated from step to step (the data order of a real run), and unlike an RMS it
    does not grow with heavy tails, which the tail estimates handle."""
    n = rows.shape[1]
    if n < 8:
        return np.zeros(len(rows))
    residuals = quadratic_residuals(rows)
    centre = _median_rows(residuals)
    mad = _median_rows(np.abs(residuals - centre))[:, 0]
    out: np.ndarray = 1.4826 * mad * math.sqrt(n / (n - 3))
    return out


def quadratic_residuals(rows: np.ndarray) -> np.ndarray:
    """Each row less its least-squares quadratic over t in [-1, 1]."""
    fit, basis_t = _quadratic_fit(rows.shape[1])
    out: np.ndarray = rows - (rows @ fit) @ basis_t
    return out


@functools.cache
def _quadratic_fit(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The transposed pseudo-inverse of the quadratic design matrix over `n` points and the
    transposed matrix itself, computed once a length."""
    t = np.linspace(-1.0, 1.0, n)
    basis = np.vstack((np.ones(n), t, t * t)).T
    fit, basis_t = np.linalg.pinv(basis).T, basis.T.copy()
    fit.flags.writeable = False
    basis_t.flags.writeable = False
    return fit, basis_t
