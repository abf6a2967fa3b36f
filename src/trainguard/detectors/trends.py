"""Trend detectors over the loss: stall, divergence and growing oscillation."""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trainguard.config import DivergenceConfig, OscillationConfig, StallConfig
from trainguard.detectors.base import Blocks, Detector, MetricPoint, fmt
from trainguard.detectors.series import MetricSeries, first_true, stop_at
from trainguard.detectors.stats import (
    MAD_TO_SIGMA,
    WARM_RESTART,
    detrended,
    dominant_period,
    lr_increased,
    mann_kendall_z,
    median,
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
        self.means.append(sum(block) / len(block))
        if len(self.means) < self.config.blocks:
            return []
        improvement, se = relative_improvement(list(self.means))
        tol = self.config.rel_tol
        if improvement - 2 * se > tol:
            self.stalled = False
        if self.stalled or improvement + 2 * se >= tol:
            return []
        self.stalled = True
        message = (
            f"training stalled: the loss improved {improvement:+.2%} (+/- {2 * se:.2%}) over the "
            f"last {self.config.window} steps, under the {tol:.2%} expected"
        )
        metrics = {"improvement": improvement, "standard_error": se, "level": self.means[-1]}
        return [self.event(point, "info", message, metrics)]

    def advance(self, series: MetricSeries, start: int) -> int:
        idx, losses = series.finite_losses(start)
        size, n = self.blocks.size, self.config.blocks
        done = _BlockStream(self.blocks.values, losses, size)
        if done.count == 0:
            self.blocks.values.extend(losses.tolist())
            return series.chunk_end(start)
        means = np.concatenate((np.asarray(self.means, dtype=np.float64), done.rows.mean(axis=1)))
        held = len(self.means)
        improvement = np.full(done.count, np.nan)
        se = np.full(done.count, np.nan)
        if len(means) >= n:
            rows = sliding_window_view(means, n)[max(held - n + 1, 0) :]
            imp, err = relative_improvements(rows)
            improvement[done.count - len(rows) :] = imp
            se[done.count - len(rows) :] = err
        tol = self.config.rel_tol
        fire = improvement + 2 * se < tol
        progress = improvement - 2 * se > tol
        reset = first_true(progress) if self.stalled else 0
        from_block = done.count if reset is None else reset
        hit = first_true(fire[from_block:])
        f = done.count if hit is None else from_block + hit
        self.stalled = self.stalled and (reset is None or reset >= f)
        self.means = deque(means[: held + f][-n:].tolist(), maxlen=n)
        self.blocks.values = done.partial_before(f)
        return stop_at(idx, None if hit is None else done.ends[f], series, start)


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
    """`relative_improvement` of each row, vectorised."""
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


def relative_improvement(means: list[float]) -> tuple[float, float]:
    """Fall of a least-squares line over the series, relative to its start, and its standard
    error; positive when the loss goes down."""
    y = np.asarray(means, dtype=np.float64)
    n = len(y)
    t = np.arange(n, dtype=np.float64) - (n - 1) / 2
    slope = float(np.dot(t, y - y.mean()) / np.dot(t, t))
    residuals = y - y.mean() - slope * t
    se_slope = math.sqrt(float(np.dot(residuals, residuals)) / (n - 2) / float(np.dot(t, t)))
    start = y.mean() - slope * (n - 1) / 2
    scale = abs(start) if start != 0 else 1.0
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
        centre = median(block)
        self.medians.append(centre)
        self.spreads.append(median([abs(v - centre) for v in block]))
        if point.lr is not None and math.isfinite(point.lr):
            self.block_lrs.append(point.lr)
        if len(self.medians) < self.config.blocks:
            return []
        values = list(self.medians)
        z = mann_kendall_z(values)
        low = min(values)
        rise = (values[-1] - low) / abs(low) if low != 0 else 0.0
        early_low = values.index(low) < len(values) // 2
        noise = _median_noise(np.asarray([values]), np.asarray([self._spreads()]), len(block))
        clear = values[-1] - low > RISE_NOISE * float(noise[0])
        rising = (
            z > self.config.z_threshold and rise >= self.config.min_rel_rise and early_low and clear
        )
        if not rising or lr_increased(self.block_lrs):  # a warmup's gradual rise is no restart
            self.active = False
            return []
        if self.active:
            return []
        self.active = True
        message = (
            f"loss diverging: it rose steadily over the last {self.config.window} steps "
            f"(trend z={z:.1f}), {rise:.1%} above its lowest, now {fmt(values[-1])}"
        )
        metrics = {
            "trend_z": z,
            "rise": rise,
            "lowest": low,
            "latest": values[-1],
            "window": self.config.window,
        }
        return [self.event(point, "critical", message, metrics)]

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
        centres = np.median(done.rows, axis=1)
        medians = np.concatenate((np.asarray(self.medians, dtype=np.float64), centres))
        spreads = np.concatenate(
            (
                np.asarray(self._spreads(), dtype=np.float64),
                np.median(np.abs(done.rows - centres[:, None]), axis=1),
            )
        )
        new_lrs = (
            series.lr[idx[done.ends]] if series.lr is not None else np.full(done.count, np.nan)
        )
        lr_ok = np.isfinite(new_lrs)
        lrs = np.concatenate((np.asarray(self.block_lrs, dtype=np.float64), new_lrs[lr_ok]))
        lr_count = len(self.block_lrs) + np.cumsum(lr_ok)  # deque length after each block
        jumps = np.zeros(len(lrs), dtype=bool)
        jumps[1:] = lrs[1:] > WARM_RESTART * lrs[:-1]
        prefix = np.concatenate(([0], np.cumsum(jumps)))
        lo = np.maximum(lr_count - (self.block_lrs.maxlen or 1) + 1, 1)
        lr_jump = prefix[lr_count] - prefix[np.minimum(lo, lr_count)] > 0
        checked = held + np.arange(done.count) + 1 >= n
        cond = np.zeros(done.count, dtype=bool)
        if checked.any():
            rows = sliding_window_view(medians, n)[max(held - n + 1, 0) :]
            z = mann_kendall_many(rows)
            low = rows.min(axis=1)
            with np.errstate(divide="ignore", invalid="ignore"):
                rise = np.where(low != 0, (rows[:, -1] - low) / np.abs(low), 0.0)
            early_low = np.argmin(rows, axis=1) < n // 2
            spread_rows = sliding_window_view(spreads, n)[max(held - n + 1, 0) :]
            noise = _median_noise(rows, spread_rows, done.size)
            clear = rows[:, -1] - low > RISE_NOISE * noise
            rising = (z > cfg.z_threshold) & (rise >= cfg.min_rel_rise) & early_low & clear
            cond[done.count - len(rows) :] = rising
        cond &= ~lr_jump
        active = np.empty(done.count, dtype=bool)  # the flag before each block
        active[0] = self.active
        for_checked = np.where(checked, cond, False)
        active[1:] = np.where(checked[:-1], for_checked[:-1], self.active)
        first = first_true(checked & cond & ~active)
        f = done.count if first is None else first
        if first is None:
            self.active = bool(cond[-1]) if checked[-1] else self.active
        else:
            self.active = bool(active[f])
        self.medians = deque(medians[: held + f][-n:].tolist(), maxlen=n)
        self.spreads = deque(spreads[: held + f][-n:].tolist(), maxlen=n)
        kept = int(lr_count[f - 1]) if f > 0 else len(self.block_lrs)
        self.block_lrs = deque(lrs[:kept].tolist(), maxlen=self.block_lrs.maxlen)
        self.blocks.values = done.partial_before(f)
        return stop_at(idx, None if first is None else done.ends[f], series, start)


def mann_kendall_many(rows: np.ndarray) -> np.ndarray:
    """`mann_kendall_z` of each row, vectorised."""
    n = rows.shape[1]
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
        self.window.append(point.loss)
        self.since_check += 1
        if self.cooldown > 0:
            self.cooldown -= 1
        if len(self.window) < cfg.window or self.since_check < cfg.check_every or self.cooldown:
            return []
        self.since_check = 0
        metrics = self._swing(np.asarray(self.window, dtype=np.float64))
        if metrics is None:
            return []
        self.cooldown = cfg.window
        message = (
            f"loss oscillating with period {metrics['period']} steps and growing: swings "
            f"{metrics['growth']:.1f}x wider than {cfg.window // 2} steps earlier "
            f"(amplitude {fmt(metrics['amplitude'])})"
        )
        return [self.event(point, "warning", message, metrics)]

    def _swing(self, values: np.ndarray) -> dict[str, Any] | None:
        """The figures of a growing periodic swing in a window of losses, or None."""
        cfg = self.config
        residuals = detrended(values)
        period, acf = dominant_period(residuals, cfg.min_period)
        if not period or acf < cfg.min_acf:
            return None
        half = len(residuals) // 2
        early = float(np.sqrt(np.mean(residuals[:half] ** 2)))
        late = float(np.sqrt(np.mean(residuals[half:] ** 2)))
        level = abs(float(np.median(values)))
        amplitude = late * math.sqrt(2.0)
        if early <= 0 or late / early < cfg.growth or amplitude < cfg.min_rel_amplitude * level:
            return None
        if period > half // 2 or lag_correlation(residuals[:half], period) < cfg.min_acf:
            return None  # no swing yet in the earlier half: it did not grow, it began
        if not still_growing(residuals[half:], period):
            return None  # it grew once and stays: a change of level, not a growing swing
        return {
            "period": period,
            "autocorrelation": acf,
            "growth": late / early,
            "amplitude": amplitude,
        }

    def advance(self, series: MetricSeries, start: int) -> int:
        cfg = self.config
        idx, losses = series.finite_losses(start)
        m, w = len(losses), cfg.window
        if m == 0:
            return series.chunk_end(start)
        held = len(self.window)
        v = np.concatenate((np.asarray(self.window, dtype=np.float64), losses))
        k = np.arange(m)
        cooldown = np.maximum(self.cooldown - (k + 1), 0)  # after each step's countdown
        eligible = (np.minimum(held + k + 1, w) >= w) & (cooldown == 0)
        since = self.since_check + k + 1  # before any check in this chunk
        candidates = np.flatnonzero(eligible & (since >= cfg.check_every))
        checks = np.empty(0, dtype=np.int64)
        if len(candidates):
            c0 = int(candidates[0])  # later checks follow every `check_every` steps
            checks = np.arange(c0, m, cfg.check_every)
        first = None
        if len(checks):
            windows = sliding_window_view(v, w)[checks + held + 1 - w]
            for j in np.flatnonzero(_may_swing(windows, cfg)):
                if self._swing(windows[j]) is not None:
                    first = int(checks[j])
                    break
        f = m if first is None else first
        if f > 0:
            self.window = deque(v[: held + f][-w:].tolist(), maxlen=w)
            done = checks[checks < f]
            self.since_check = int(f - 1 - done[-1]) if len(done) else self.since_check + f
            self.cooldown = int(max(self.cooldown - f, 0))
        return stop_at(idx, first, series, start)


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


def _may_swing(windows: np.ndarray, cfg: OscillationConfig) -> np.ndarray:
    """Which windows pass the amplitude and growth tests of `_swing` (with a margin for rounding),
    vectorised: only those need its exact autocorrelation test."""
    n = windows.shape[1]
    t = np.linspace(-1.0, 1.0, n)
    basis = np.vstack((np.ones(n), t, t * t)).T
    residuals = windows - (windows @ np.linalg.pinv(basis).T) @ basis.T
    half = n // 2
    early = np.sqrt(np.mean(residuals[:, :half] ** 2, axis=1))
    late = np.sqrt(np.mean(residuals[:, half:] ** 2, axis=1))
    # |median| is at least this much, which is all a necessary test needs
    level = np.maximum(np.maximum(windows.min(axis=1), -windows.max(axis=1)), 0.0)
    margin = 0.99
    with np.errstate(divide="ignore", invalid="ignore"):
        grows = (early > 0) & (late / early >= margin * cfg.growth)
    out: np.ndarray = grows & (late * math.sqrt(2.0) >= margin * cfg.min_rel_amplitude * level)
    return out
