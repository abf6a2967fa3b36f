"""Small robust statistics shared by the detectors; pure functions of plain floats."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

MAD_TO_SIGMA = 1.4826
WARM_RESTART = 1.5  # an LR this many times the one before it is a restart, not a warmup step


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    if n == 0:
        return math.nan
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def noise_and_drift(values: Sequence[float]) -> tuple[float, float]:
    """Step-to-step noise of a series and its drift (the median first difference), both from
    its first differences, robust to trend and outliers.

    The differences less the drift are winsorised at 6 MADs and their RMS divided by sqrt(2);
    this keeps heavy tails in the estimate (unlike a bare MAD) while one outlier cannot inflate it.
    """
    diffs = [b - a for a, b in itertools.pairwise(values)]
    if len(diffs) < 2:
        return 0.0, 0.0
    centre = median(diffs)
    mad = median([abs(d - centre) for d in diffs])
    limit = 6.0 * MAD_TO_SIGMA * mad
    if limit > 0:
        diffs = [min(max(d - centre, -limit), limit) for d in diffs]
    else:
        diffs = [d - centre for d in diffs]
    return math.sqrt(sum(d * d for d in diffs) / len(diffs) / 2.0), centre


def lr_increased(lrs: Sequence[float], factor: float = WARM_RESTART) -> bool:
    """Whether the LR jumped by `factor` from one value to the next (a warm restart); a gradual
    warmup does not count."""
    return any(b > factor * a for a, b in itertools.pairwise(lrs))


def mann_kendall_z(values: Sequence[float]) -> float:
    """Mann-Kendall trend statistic as a z-score: large and positive for a steady rise."""
    n = len(values)
    if n < 4:
        return 0.0
    x = np.asarray(values, dtype=np.float64)
    s = float(np.sign(x[None, :] - x[:, None])[np.triu_indices(n, 1)].sum())
    var = n * (n - 1) * (2 * n + 5) / 18.0
    if s > 0:
        return (s - 1) / math.sqrt(var)
    if s < 0:
        return (s + 1) / math.sqrt(var)
    return 0.0


def detrended(values: Sequence[float] | np.ndarray, degree: int = 2) -> np.ndarray:
    """Residuals of a least-squares polynomial fit (a quadratic by default)."""
    y = np.asarray(values, dtype=np.float64)
    t = np.linspace(-1.0, 1.0, len(y))
    coeffs = np.polynomial.polynomial.polyfit(t, y, degree)
    fitted = np.asarray(np.polynomial.polynomial.polyval(t, coeffs), dtype=np.float64)
    residuals: np.ndarray = y - fitted
    return residuals


def dominant_period(residuals: np.ndarray, min_period: int) -> tuple[int, float]:
    """The period of the strongest repetition in a residual series and its autocorrelation.

    The period is the highest autocorrelation peak after the first zero crossing, the standard
    estimate that ignores the slow decay of a trend; (0, 0.0) when there is none.
    """
    r = residuals - residuals.mean()
    n = len(r)
    denom = float(np.dot(r, r))
    if n < 2 * min_period or denom <= 0:
        return 0, 0.0
    max_lag = n // 2
    full = np.correlate(r, r, mode="full")[n - 1 : n - 1 + max_lag + 1] / denom
    below = np.nonzero(full[1:] < 0)[0]
    if len(below) == 0:
        return 0, 0.0
    start = max(int(below[0]) + 1, min_period)
    if start > max_lag:
        return 0, 0.0
    lag = start + int(np.argmax(full[start:]))
    return lag, float(full[lag])


_T_INVERSE_NU = np.linspace(0.0, 1 / 2.2, 23)  # 1/nu of the Student-t tails fitted: 0 = Gaussian
_T_LOG_SHARE = np.linspace(math.log(1e-8), math.log(0.9), 240)


@functools.cache
def _student_t_log_quantiles() -> np.ndarray:
    """log |x| beyond which a share exp(_T_LOG_SHARE) of |T| lies, a row per 1/nu (built once)."""
    x = np.geomspace(1e-4, 1e6, 40_000)
    rows = []
    for inv in _T_INVERSE_NU.tolist():
        if inv == 0.0:
            survival = np.array([math.erfc(v / math.sqrt(2)) for v in x.tolist()])
        else:
            nu = 1.0 / inv
            c = math.exp(math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2)) / math.sqrt(nu * math.pi)
            pdf = 2 * c * (1 + x * x / nu) ** (-(nu + 1) / 2)
            beyond = 2 * c * nu ** ((nu + 1) / 2) * x[-1] ** -nu / nu  # the tail past x[-1]
            areas = np.diff(x) * 0.5 * (pdf[1:] + pdf[:-1])
            survival = np.concatenate((np.cumsum(areas[::-1])[::-1], [0.0])) + beyond
        survival = np.maximum(survival, 1e-300)[::-1]
        rows.append(np.interp(_T_LOG_SHARE, np.log(survival), np.log(x[::-1])))
    return np.array(rows)


def student_t_reach(q_hi: float, p_hi: float, q_lo: float, p_lo: float, p: float) -> float:
    """How far |z| reaches with a share `p` beyond, for a scaled Student-t through two of its
    quantiles (`q_hi` with a share `p_hi` beyond, `q_lo` with `p_lo`): nu from their ratio,
    from a Gaussian's tails to nu = 2.2."""
    table = _student_t_log_quantiles()

    def column(share: float) -> np.ndarray:
        log_share = math.log(share)
        return np.array([np.interp(log_share, _T_LOG_SHARE, row) for row in table])

    hi, lo, far = column(p_hi), column(p_lo), column(p)
    inverse_nu = float(np.interp(math.log(q_hi / q_lo), hi - lo, _T_INVERSE_NU))
    return q_hi * math.exp(float(np.interp(inverse_nu, _T_INVERSE_NU, far - hi)))
