"""Trend detectors over the loss: stall, divergence and growing oscillation."""

from __future__ import annotations

import itertools
import math
from collections import deque

import numpy as np

from trainguard.config import DivergenceConfig, OscillationConfig, StallConfig
from trainguard.detectors.base import Blocks, Detector, MetricPoint, fmt
from trainguard.detectors.stats import detrended, dominant_period, mann_kendall_z, median
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


class DivergenceDetector(Detector):
    """A steady rise over at least half of `window` steps (Mann-Kendall on block medians, and
    `min_rel_rise` over the lowest block), unless the LR jumped first as in a warm restart."""

    name = "divergence"
    _state = ("blocks", "medians", "block_lrs", "active")

    def __init__(self, config: DivergenceConfig | None = None) -> None:
        self.config = config or DivergenceConfig()
        self.blocks = Blocks(max(self.config.window // self.config.blocks, 1))
        self.medians: deque[float] = deque(maxlen=self.config.blocks)
        self.block_lrs: deque[float] = deque(maxlen=4 * self.config.blocks)
        self.active = False

    def update(self, point: MetricPoint) -> list[Event]:
        block = self.blocks.add(point.loss) if point.loss_finite else None
        if block is None:
            return []
        self.medians.append(median(block))
        if point.lr is not None and math.isfinite(point.lr):
            self.block_lrs.append(point.lr)
        if len(self.medians) < self.config.blocks:
            return []
        values = list(self.medians)
        z = mann_kendall_z(values)
        low = min(values)
        rise = (values[-1] - low) / abs(low) if low != 0 else 0.0
        early_low = values.index(low) < len(values) // 2
        rising = z > self.config.z_threshold and rise >= self.config.min_rel_rise and early_low
        if not rising or _lr_increased(list(self.block_lrs)):
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


def _lr_increased(lrs: list[float], factor: float = 1.5) -> bool:
    """Whether the LR jumped by `factor` from one block to the next (a warm restart); a gradual
    warmup does not count, so divergence under a rising warmup LR is still reported."""
    return any(b > factor * a for a, b in itertools.pairwise(lrs))


class OscillationDetector(Detector):
    """Periodic loss swings growing in amplitude: a clear autocorrelation peak in the detrended
    loss, a later half swinging `growth` x wider than the earlier, and swings of at least
    `min_rel_amplitude` of the loss level."""

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
        values = np.asarray(self.window, dtype=np.float64)
        residuals = detrended(values)
        period, acf = dominant_period(residuals, cfg.min_period)
        if not period or acf < cfg.min_acf:
            return []
        half = len(residuals) // 2
        early = float(np.sqrt(np.mean(residuals[:half] ** 2)))
        late = float(np.sqrt(np.mean(residuals[half:] ** 2)))
        level = abs(float(np.median(values)))
        amplitude = late * math.sqrt(2.0)
        if early <= 0 or late / early < cfg.growth or amplitude < cfg.min_rel_amplitude * level:
            return []
        self.cooldown = cfg.window
        message = (
            f"loss oscillating with period {period} steps and growing: swings {late / early:.1f}x "
            f"wider than {half} steps earlier (amplitude {fmt(amplitude)})"
        )
        metrics = {
            "period": period,
            "autocorrelation": acf,
            "growth": late / early,
            "amplitude": amplitude,
        }
        return [self.event(point, "warning", message, metrics)]
