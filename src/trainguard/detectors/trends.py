"""Trend detectors over the loss: stall, divergence and growing oscillation."""

from __future__ import annotations

import functools
import math
import warnings
from collections import deque
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trainguard.config import DivergenceConfig, OscillationConfig, StallConfig
from trainguard.detectors.base import Blocks, Detector, MetricPoint, fmt
from trainguard.detectors.series import (
    MetricSeries,
    first_true,
    median_of,
    quadratic_residuals,
    stop_at,
)
from trainguard.detectors.stats import (
    MAD_TO_SIGMA,
    WARM_RESTART,
    dominant_period,
)
from trainguard.events import Event


class StallDetector(Detector):
    """Progress over the last `window` steps, from a line fitted to block means, is under
    `rel_tol` even at two standard errors; info, once per plateau, as many runs flatten."""

    name = "stall"
    _state = ("blocks", "means", "stalled")

    def __init__(self, config: StallConfig | None = None) -> None:
        self.config = config or StallConfig()
        self.blocks = Blocks(max(self.config.window // self.config.blocks, 1))
        self.means: deque[float] = deque(maxlen=self.config.blocks)
        self.stalled = False

    def update(self, point: MetricPoint) -> list[Event]:
        block = self.blocks.add(point.loss) if point.loss_finite else None
        if block is None:
            return []
        self.means.append(float(np.mean(block)))
        if len(self.means) < self.config.blocks:
            return []
        trend = self._trend(np.asarray([self.means], dtype=np.float64))
        improvement, se, progress, stalling = (x[0] for x in trend)
        if progress:
            self.stalled = False
        if self.stalled or not stalling:
            return []
        self.stalled = True
        tol = self.config.rel_tol
        message = (
            f"training stalled: the loss improved {improvement:+.2%} (+/- {2 * se:.2%}) over the "
            f"last {self.config.window} steps, under the {tol:.2%} expected"
        )
        metrics = {
            "improvement": float(improvement),
            "standard_error": float(se),
            "level": self.means[-1],
        }
        return [self.event(point, "info", message, metrics)]

    def _trend(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """For rows of block means: the relative improvement and its standard error, whether
        the progress is clear (it ends a plateau), and whether it is under `rel_tol` even at two
        standard errors (a plateau)."""
        improvement, se = relative_improvements(rows)
        tol = self.config.rel_tol
        return improvement, se, improvement - 2 * se > tol, improvement + 2 * se < tol

    def advance(self, series: MetricSeries, start: int) -> int:
        idx, losses = series.finite_losses(start)
        size, n = self.blocks.size, self.config.blocks
        done = _BlockStream(self.blocks.values, losses, size)
        if done.count == 0:
            self.blocks.values.extend(losses.tolist())
            return series.chunk_end(start)
        means = np.concatenate((np.asarray(self.means, dtype=np.float64), done.rows.mean(axis=1)))
        held = len(self.means)
        changes = np.zeros(done.count, dtype=bool)  # the blocks where `update` decides anything
        if len(means) >= n:
            rows = sliding_window_view(means, n)[max(held - n + 1, 0) :]
            _, _, progress, stalling = self._trend(rows)
            changes[done.count - len(rows) :] = progress if self.stalled else stalling
        first = first_true(changes)
        f = done.count if first is None else first
        self.means = deque(means[: held + f][-n:].tolist(), maxlen=n)
        self.blocks.values = done.partial_before(f)
        return stop_at(idx, None if first is None else done.ends[f], series, start)


class _BlockStream:
    """The blocks a stream completes when `new` values follow the `held` ones of a partial
    block: their values (`rows`), where each ends in `new` (`ends`), and what is left over."""

    def __init__(self, held: list[float], new: np.ndarray, size: int) -> None:
        self.values = np.concatenate((np.asarray(held, dtype=np.float64), new))
        self.size = size
        self.count = len(self.values) // size
        self.rows = self.values[: self.count * size].reshape(self.count, size)
        self.ends = np.arange(1, self.count + 1) * size - 1 - len(held)

    def partial_before(self, block: int) -> list[float]:
        """The partial block as it stands just before block `block` completes (or after the
        last complete block when `block` is `count`)."""
        if block >= self.count:
            return [float(x) for x in self.values[self.count * self.size :]]
        return [float(x) for x in self.values[block * self.size : (block + 1) * self.size - 1]]


def relative_improvements(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fall of a least-squares line over each row, relative to its start, and its standard
    error; positive when the loss goes down."""
    n = rows.shape[1]
    t = np.arange(n, dtype=np.float64) - (n - 1) / 2
    tt = float(np.dot(t, t))
    centred = rows - rows.mean(axis=1, keepdims=True)
    slope = centred @ t / tt
    residuals = centred - slope[:, None] * t
    se_slope = np.sqrt(np.sum(residuals * residuals, axis=1) / (n - 2) / tt)
    start = rows.mean(axis=1) - slope * (n - 1) / 2
    scale = np.where(start != 0, np.abs(start), 1.0)
    return -slope * (n - 1) / scale, se_slope * (n - 1) / scale


RISE_NOISE = 5.0  # a divergence's rise over the lowest block clears this many times the noise
# of a block median: with a noisy loss (a small batch, noisy targets) the lowest of 20 block
# medians lies far under their centre, and a rise of `min_rel_rise` over it is chance


# A small block's spread about its own median understates the noise of that median: the
# factor that makes it whole, by block size (measured on Gaussian noise, 200,000 blocks each;
# from 20 losses a block, the live default, it is within 3% of 1).
SMALL_BLOCK = {3: 1.69, 4: 1.29, 5: 1.27, 6: 1.14, 7: 1.11, 8: 1.09, 9: 1.08, 10: 1.06}


def _median_noise(medians: np.ndarray, spreads: np.ndarray, size: int) -> np.ndarray:
    """The noise of a block median, each row: from the losses' spread within the blocks (their
    median absolute deviation), which a rise across the blocks does not inflate; from the
    medians' successive differences where blocks hold too few losses for a spread."""
    if size >= 3:  # a spread not kept (NaN: a state saved before spreads were) is passed over
        if not np.isnan(spreads).any():  # every spread kept: a plain median is the same, faster
            spread = np.median(spreads, axis=1)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all NaN: no noise, no divergence
                spread = np.nanmedian(spreads, axis=1)
        whole = SMALL_BLOCK.get(size, 1.0 + 0.5 / size if size < 20 else 1.0)
        # a median's standard error is sqrt(pi/2) that of a mean of the same losses
        within: np.ndarray = whole * math.sqrt(math.pi / 2) * MAD_TO_SIGMA * spread
        return within / math.sqrt(size)
    diffs: np.ndarray = MAD_TO_SIGMA * np.median(np.abs(np.diff(medians, axis=1)), axis=1)
    return diffs / math.sqrt(2.0)


class DivergenceDetector(Detector):
    """A steady rise over at least half of `window` steps (Mann-Kendall on block medians, and
    `min_rel_rise` and `RISE_NOISE` noise over the lowest block), unless the LR jumped first as
    in a warm restart."""

    name = "divergence"
    _state = ("blocks", "medians", "spreads", "block_lrs", "active")

    def __init__(self, config: DivergenceConfig | None = None) -> None:
        self.config = config or DivergenceConfig()
        self.blocks = Blocks(max(self.config.window // self.config.blocks, 1))
        self.medians: deque[float] = deque(maxlen=self.config.blocks)
        # each block's median absolute deviation from its median: the noise within it
        self.spreads: deque[float] = deque(maxlen=self.config.blocks)
        self.block_lrs: deque[float] = deque(maxlen=4 * self.config.blocks)
        self.active = False

    def update(self, point: MetricPoint) -> list[Event]:
        block = self.blocks.add(point.loss) if point.loss_finite else None
        if block is None:
            return []
        centre, spread = _median_and_spread(block)
        self.medians.append(float(centre))
        self.spreads.append(float(spread))
        if point.lr is not None and math.isfinite(point.lr):
            self.block_lrs.append(point.lr)
        if len(self.medians) < self.config.blocks:
            return []
        values = np.asarray([self.medians], dtype=np.float64)
        judged = self._rising(values, np.asarray([self._spreads()]), len(block))
        z, rise, low, rising = (float(x[0]) for x in judged)
        lrs = np.asarray(self.block_lrs, dtype=np.float64)
        jumped = lr_jumped(lrs, np.array([len(lrs)]), self.block_lrs.maxlen or 1)[0]
        if not rising or jumped:  # a warmup's gradual rise is no restart
            self.active = False
            return []
        if self.active:
            return []
        self.active = True
        latest = self.medians[-1]
        message = (
            f"loss diverging: it rose steadily over the last {self.config.window} steps "
            f"(trend z={z:.1f}), {rise:.1%} above its lowest, now {fmt(latest)}"
        )
        metrics = {
            "trend_z": z,
            "rise": rise,
            "lowest": low,
            "latest": latest,
            "window": self.config.window,
        }
        return [self.event(point, "critical", message, metrics)]

    def _rising(
        self, medians: np.ndarray, spreads: np.ndarray, size: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For rows of `blocks` block medians and their spreads: the trend z, the rise over the
        lowest median, the lowest, and whether it is a steady rise (before the LR test)."""
        cfg = self.config
        z = mann_kendall_many(medians)
        low = medians.min(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            rise = np.where(low != 0, (medians[:, -1] - low) / np.abs(low), 0.0)
        early_low = np.argmin(medians, axis=1) < medians.shape[1] // 2
        clear = medians[:, -1] - low > RISE_NOISE * _median_noise(medians, spreads, size)
        rising = (z > cfg.z_threshold) & (rise >= cfg.min_rel_rise) & early_low & clear
        return z, rise, low, rising

    def _spreads(self) -> list[float]:
        """The spreads beside the medians, NaN for a median whose spread was never kept."""
        return [math.nan] * (len(self.medians) - len(self.spreads)) + list(self.spreads)

    def advance(self, series: MetricSeries, start: int) -> int:
        cfg = self.config
        idx, losses = series.finite_losses(start)
        done = _BlockStream(self.blocks.values, losses, self.blocks.size)
        if done.count == 0:
            self.blocks.values.extend(losses.tolist())
            return series.chunk_end(start)
        n, held = cfg.blocks, len(self.medians)
        centres, new_spreads = _median_and_spread(done.rows)
        medians = np.concatenate((np.asarray(self.medians, dtype=np.float64), centres))
        spreads = np.concatenate((np.asarray(self._spreads(), dtype=np.float64), new_spreads))
        new_lrs = (
            series.lr[idx[done.ends]] if series.lr is not None else np.full(done.count, np.nan)
        )
        lr_ok = np.isfinite(new_lrs)
        lrs = np.concatenate((np.asarray(self.block_lrs, dtype=np.float64), new_lrs[lr_ok]))
        lr_count = len(self.block_lrs) + np.cumsum(lr_ok)  # deque length after each block
        checked = held + np.arange(done.count) + 1 >= n
        changes = np.zeros(done.count, dtype=bool)  # the blocks where `update` decides anything
        if checked.any():
            rows = sliding_window_view(medians, n)[max(held - n + 1, 0) :]
            spread_rows = sliding_window_view(spreads, n)[max(held - n + 1, 0) :]
            rising = self._rising(rows, spread_rows, done.size)[3]
            rising &= ~lr_jumped(lrs, lr_count, self.block_lrs.maxlen or 1)[checked]
            changes[checked] = rising != self.active
        first = first_true(changes)
        f = done.count if first is None else first
        self.medians = deque(medians[: held + f][-n:].tolist(), maxlen=n)
        self.spreads = deque(spreads[: held + f][-n:].tolist(), maxlen=n)
        kept = int(lr_count[f - 1]) if f > 0 else len(self.block_lrs)
        self.block_lrs = deque(lrs[:kept].tolist(), maxlen=self.block_lrs.maxlen)
        self.blocks.values = done.partial_before(f)
        return stop_at(idx, None if first is None else done.ends[f], series, start)


def _median_and_spread(rows: Any) -> tuple[Any, Any]:
    """Each block's median, and its median absolute deviation from it (the noise within): of
    the rows of an array, or of one block (a list: the live path, in floats)."""
    if isinstance(rows, list):
        centre = _median_as_numpy(rows)
        return centre, _median_as_numpy([abs(x - centre) for x in rows])
    centres = np.median(rows, axis=1)
    spreads: np.ndarray = np.median(np.abs(rows - centres[:, None]), axis=1)
    return centres, spreads


def _median_as_numpy(values: list[float]) -> float:
    """`np.median` of plain floats: a sort, and numpy itself for a zero (its sign)."""
    out = median_of(values)
    return out if out != 0 else float(np.median(np.asarray(values, dtype=np.float64)))


def lr_jumped(lrs: np.ndarray, counts: np.ndarray, keep: int) -> np.ndarray:
    """For each count c: whether the LR jumped by `WARM_RESTART` from one value to the next (a
    warm restart) among the last `keep` of the first c values of `lrs`."""
    jumps = np.zeros(len(lrs), dtype=bool)
    jumps[1:] = lrs[1:] > WARM_RESTART * lrs[:-1]
    prefix = np.concatenate(([0], np.cumsum(jumps)))
    lo = np.maximum(counts - keep + 1, 1)
    out: np.ndarray = prefix[counts] - prefix[np.minimum(lo, counts)] > 0
    return out


MK_PAIRS_UP_TO = 64  # rows (the live path's one) whose pairs of values are taken all at once


@functools.cache
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of positions in `n` values, the earlier first (computed once a length)."""
    before, after = np.triu_indices(n, 1)
    return before, after


def mann_kendall_many(rows: np.ndarray) -> np.ndarray:
    """`mann_kendall_z` of each row, vectorised."""
    n = rows.shape[1]
    if len(rows) <= MK_PAIRS_UP_TO:  # few rows: one sign a pair, in one go
        before, after = _pairs(n)
        s = np.sign(rows[:, after] - rows[:, before]).sum(axis=1)
    else:  # many: a column at a time (the sums of signs are exact in any order)
        s = np.zeros(len(rows))
        for i in range(n - 1):
            s += np.sign(rows[:, i + 1 :] - rows[:, i : i + 1]).sum(axis=1)
    sd = math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    out: np.ndarray = np.where(s > 0, (s - 1) / sd, np.where(s < 0, (s + 1) / sd, 0.0))
    return out


class OscillationDetector(Detector):
    """Periodic loss swings growing in amplitude: a clear autocorrelation peak in the detrended
    loss, a later half swinging `growth` x wider than the earlier, swings of at least
    `min_rel_amplitude` of the loss level, and the swing already there in the earlier half (its
    own autocorrelation at the period): a periodic bump of the data that starts at some step is
    a change, not a growing oscillation; and still growing within the later half, whole cycles
    against whole cycles."""

    name = "oscillation"
    _state = ("window", "since_check", "cooldown")

    def __init__(self, config: OscillationConfig | None = None) -> None:
        self.config = config or OscillationConfig()
        self.window: deque[float] = deque(maxlen=self.config.window)
        self.since_check = 0
        self.cooldown = 0

    def update(self, point: MetricPoint) -> list[Event]:
        if not point.loss_finite:
            return []
        cfg = self.config
        checked = self._first_check() == 0
        self._tick([float(point.loss)], 0 if checked else None)
        if not checked:
            return []
        metrics = self._swing(np.asarray([self.window], dtype=np.float64))[0]
        if metrics is None:
            return []
        self.cooldown = cfg.window
        message = (
            f"loss oscillating with period {metrics['period']} steps and growing: swings "
            f"{metrics['growth']:.1f}x wider than {cfg.window // 2} steps earlier "
            f"(amplitude {fmt(metrics['amplitude'])})"
        )
        return [self.event(point, "warning", message, metrics)]

    def advance(self, series: MetricSeries, start: int) -> int:
        idx, losses = series.finite_losses(start)
        if len(losses) == 0:
            return series.chunk_end(start)
        held, w = len(self.window), self.config.window
        checks = self._checks(len(losses))
        first = None
        if len(checks):
            v = np.concatenate((np.asarray(self.window, dtype=np.float64), losses))
            found = self._swing(sliding_window_view(v, w)[checks + held + 1 - w], stop=True)
            first = next((int(c) for c, m in zip(checks, found, strict=True) if m), None)
        f = len(losses) if first is None else first
        done = checks[checks < f]
        self._tick(losses[:f].tolist(), int(done[-1]) if len(done) else None)
        return stop_at(idx, first, series, start)

    def _checks(self, m: int) -> np.ndarray:
        """Which of the next `m` finite losses (0 for the first) are checked for a swing, with
        none found before: every `check_every` steps once the window is full and no cooldown
        from the last swing is left."""
        return np.arange(self._first_check(), m, self.config.check_every)

    def _first_check(self) -> int:
        """The first of the next finite losses (0-based) with the cooldown out, the window full
        and `check_every` steps since the last check."""
        cfg = self.config
        cooled = self.cooldown - 1
        full = cfg.window - len(self.window) - 1
        due = cfg.check_every - self.since_check - 1
        return max(cooled, full, due, 0)

    def _tick(self, losses: list[float], last_check: int | None) -> None:
        """Take finite losses into the window and count them down to the next check (the last
        of them checked: `last_check`, or None)."""
        f = len(losses)
        if f == 0:
            return
        self.window.extend(losses[-self.config.window :])
        self.since_check = self.since_check + f if last_check is None else f - 1 - last_check
        self.cooldown = max(self.cooldown - f, 0)

    def _swing(self, windows: np.ndarray, stop: bool = False) -> list[dict[str, Any] | None]:
        """The figures of a growing periodic swing in each window of losses (None where there is
        none); with `stop`, the windows after the first swing are left unread (None)."""
        cfg = self.config
        n = windows.shape[1]
        residuals = quadratic_residuals(windows)
        half = n // 2
        early = np.sqrt(np.mean(residuals[:, :half] ** 2, axis=1))
        late = np.sqrt(np.mean(residuals[:, half:] ** 2, axis=1))
        amplitude = late * math.sqrt(2.0)
        # |median| is at least this much: the exact level is read only where this passes
        bound = np.maximum(np.maximum(windows.min(axis=1), -windows.max(axis=1)), 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            grows = (early > 0) & (late / early >= cfg.growth)
        found: list[dict[str, Any] | None] = [None] * len(windows)
        for j in np.flatnonzero(grows & (amplitude >= cfg.min_rel_amplitude * bound)).tolist():
            level = abs(float(np.median(windows[j])))
            if amplitude[j] < cfg.min_rel_amplitude * level:
                continue
            period, acf = dominant_period(residuals[j], cfg.min_period)
            if not period or acf < cfg.min_acf:
                continue
            if period > half // 2 or lag_correlation(residuals[j, :half], period) < cfg.min_acf:
                continue  # no swing yet in the earlier half: it did not grow, it began
            if not still_growing(residuals[j, half:], period):
                continue  # it grew once and stays: a change of level, not a growing swing
            found[j] = {
                "period": period,
                "autocorrelation": acf,
                "growth": float(late[j] / early[j]),
                "amplitude": float(amplitude[j]),
            }
            if stop:
                break
        return found


def lag_correlation(values: np.ndarray, lag: int) -> float:
    """The autocorrelation of a series at one lag, each product averaged over its own pairs."""
    r = values - values.mean()
    n = len(r)
    energy = float(np.dot(r, r)) / n
    if lag >= n or energy <= 0:
        return 0.0
    return float(np.dot(r[:-lag], r[lag:])) / (n - lag) / energy


LATE_GROWTH = 1.1  # the last whole cycles of the later half swing this x wider than its first


def still_growing(residuals: np.ndarray, period: int) -> bool:
    """Whether the last half of the whole cycles in a stretch swing `LATE_GROWTH` x wider than
    the first half (whole cycles, so a periodic bump counts the same in each)."""
    cycles = len(residuals) // period
    if cycles < 2:
        return False
    span = (cycles // 2) * period
    whole = residuals[len(residuals) - cycles * period :]
    first = float(np.sqrt(np.mean(whole[:span] ** 2)))
    last = float(np.sqrt(np.mean(whole[-span:] ** 2)))
    return last >= LATE_GROWTH * first
