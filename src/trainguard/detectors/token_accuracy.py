"""`TokenAccuracyDetector`: token accuracy (the share of tokens whose argmax is the target)
falling below the healthy range the run itself has shown."""

from __future__ import annotations

import math
from collections import deque
from typing import ClassVar

import numpy as np

from trainguard.config import TokenAccuracyConfig
from trainguard.detectors.base import Detector, MetricPoint, fmt
from trainguard.detectors.series import MetricSeries
from trainguard.detectors.stats import MAD_TO_SIGMA, median
from trainguard.events import Event, EventKind


class TokenAccuracyDetector(Detector):
    """Raises `token_accuracy` (info) at a value under the run's healthy range: the median of
    its last `window` healthy values less `mad_sigmas` robust deviations (MAD x 1.4826), and at
    least `min_drop` under the median; after `warmup` values, once per episode. An episode ends
    at a value back in range; after `warmup` values in a row under it, they are the new range
    (the level has moved), without another event."""

    name: ClassVar[str] = str(EventKind.TOKEN_ACCURACY)
    _state: ClassVar[tuple[str, ...]] = ("values", "seen", "low", "below")

    def __init__(self, config: TokenAccuracyConfig | None = None) -> None:
        self.config = config or TokenAccuracyConfig()
        self.values: deque[float] = deque(maxlen=self.config.window)  # healthy values
        self.seen = 0
        self.low = False  # in an episode under the range
        self.below: list[float] = []  # the values of this episode, to rebaseline on

    def _floor(self) -> tuple[float, float, float]:
        """The range's floor, the median and the robust deviation; NaN floor while warming."""
        if self.seen < self.config.warmup or len(self.values) < self.config.warmup // 2:
            return math.nan, math.nan, math.nan
        values = list(self.values)
        centre = median(values)
        spread = MAD_TO_SIGMA * median([abs(v - centre) for v in values])
        drop = max(self.config.mad_sigmas * spread, self.config.min_drop)
        return centre - drop, centre, spread

    def _take(self, value: float) -> tuple[bool, float, float, float]:
        """Take one finite value; whether it starts an episode, with the range it was judged by."""
        floor, centre, spread = self._floor()
        self.seen += 1
        if not value < floor:  # a NaN floor: still warming
            self.low = False
            self.below = []
            self.values.append(value)
            return False, floor, centre, spread
        starts = not self.low
        self.low = True
        self.below.append(value)
        if len(self.below) >= self.config.warmup:  # the level has moved: the new range
            self.values.clear()
            self.values.extend(self.below)
            self.below, self.low = [], False
        return starts, floor, centre, spread

    def _would_start(self, value: float) -> bool:
        return not self.low and value < self._floor()[0]

    def update(self, point: MetricPoint) -> list[Event]:
        value = point.token_accuracy
        if value is None or not math.isfinite(value):
            return []
        starts, floor, centre, spread = self._take(float(value))
        if not starts:
            return []
        message = (
            f"token accuracy {fmt(value)} is under its healthy range (at least {fmt(floor)}: "
            f"the median {fmt(centre)} of its last {len(self.values)} values less "
            f"{self.config.mad_sigmas:g} robust deviations or {self.config.min_drop:g}); look at "
            "this step's data and the loss beside it"
        )
        metrics = {
            "token_accuracy": value,
            "floor": floor,
            "median": centre,
            "deviation": spread,
        }
        return [self.event(point, "info", message, metrics)]

    def advance(self, series: MetricSeries, start: int) -> int:
        """Steps without token accuracy are passed over at once; those with it are taken one by
        one (they are sampled steps, a few), up to the first that starts an episode."""
        end = series.chunk_end(start)
        column = series.token_accuracy
        if column is None:
            return end
        idx = np.flatnonzero(np.isfinite(column[start:end])) + start
        for i in idx.tolist():
            value = float(column[i])
            if self._would_start(value):
                return int(i)
            self._take(value)
        return end
