"""Per-rank detectors of a distributed run: a rank out of line with the others, and stragglers."""

from __future__ import annotations

import math
from typing import Any

from trainguard.config import RanksConfig, StragglerConfig
from trainguard.detectors.base import Detector, MetricPoint, fmt
from trainguard.detectors.series import MetricSeries
from trainguard.detectors.stats import MAD_TO_SIGMA, median
from trainguard.events import Event

MIN_RANKS_FOR_Z = 3


class RankOutlierDetector(Detector):
    """Names the ranks whose loss or local grad norm (before the gradient reduction) is
    non-finite (critical) or over `ratio_threshold` x the median of the other ranks, and, with
    3 or more ranks, over `z_threshold` robust deviations from them (warning)."""

    name = "rank_outlier"
    _state = ()

    def __init__(self, config: RanksConfig | None = None) -> None:
        self.config = config or RanksConfig()

    def update(self, point: MetricPoint) -> list[Event]:
        events: list[Event] = []
        for metric, values in (("loss", point.rank_losses), ("grad_norm", point.rank_grad_norms)):
            if not values or len(values) < 2:
                continue
            bad = [r for r, v in enumerate(values) if not math.isfinite(v)]
            if bad:
                shown = ", ".join(f"rank {r} ({values[r]})" for r in bad)
                events.append(
                    self._event(
                        point, "critical", f"non-finite {metric} on {shown}", metric, bad, values
                    )
                )
                continue
            high = self._outliers(values)
            if high:
                shown = ", ".join(
                    f"rank {r} ({fmt(values[r])} against a median {fmt(m)} of the others)"
                    for r, m in high
                )
                ranks = [r for r, _ in high]
                events.append(
                    self._event(
                        point, "warning", f"{metric} out of line on {shown}", metric, ranks, values
                    )
                )
        return events

    def advance(self, series: MetricSeries, start: int) -> int:
        return len(series)  # a series holds no per-rank columns: nothing to see

    def _outliers(self, values: list[float]) -> list[tuple[int, float]]:
        cfg = self.config
        found: list[tuple[int, float]] = []
        for r, v in enumerate(values):
            others = values[:r] + values[r + 1 :]
            centre = median(others)
            if centre <= 0 or v <= cfg.ratio_threshold * centre:
                continue
            if len(values) >= MIN_RANKS_FOR_Z:
                mad = median([abs(x - centre) for x in others]) * MAD_TO_SIGMA
                if mad > 0 and (v - centre) / mad <= cfg.z_threshold:
                    continue
            found.append((r, centre))
        return found

    def _event(
        self,
        point: MetricPoint,
        severity: Any,
        what: str,
        metric: str,
        ranks: list[int],
        values: list[float],
    ) -> Event:
        event = self.event(
            point,
            severity,
            what + " (before the gradient reduction)",
            {"metric": metric, "ranks": ranks, "per_rank": values},
        )
        event.rank = ranks[0]
        return event


class StragglerDetector(Detector):
    """A rank whose mean step time (data wait plus compute before the first gradient reduction)
    over a window of `every` steps is `factor` x the median of the other ranks', `windows`
    windows in a row; reported once, until as many normal windows in a row clear it."""

    name = "straggler"
    _state = ("sums", "waits", "count", "slow_runs", "fast_runs", "reported")

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self.sums: list[float] = []
        self.waits: list[float] = []
        self.count = 0
        self.slow_runs: list[int] = []
        self.fast_runs: list[int] = []  # normal windows in a row, which clear a report
        self.reported: list[bool] = []

    def advance(self, series: MetricSeries, start: int) -> int:
        return len(series)

    def update(self, point: MetricPoint) -> list[Event]:
        times, waits = point.rank_step_times, point.rank_data_waits
        if not times or len(times) < 2 or not all(math.isfinite(t) for t in times):
            return []
        n = len(times)
        if len(self.sums) != n:  # the first step, or the world size changed on a restart
            self.sums, self.waits = [0.0] * n, [0.0] * n
            self.count, self.slow_runs, self.fast_runs = 0, [0] * n, [0] * n
            self.reported = [False] * n
        for r in range(n):
            self.sums[r] += times[r]
            self.waits[r] += waits[r] if waits and math.isfinite(waits[r]) else 0.0
        self.count += 1
        if self.count < self.config.every:
            return []
        means = [s / self.count for s in self.sums]
        wait_means = [w / self.count for w in self.waits]
        self.sums, self.waits, self.count = [0.0] * n, [0.0] * n, 0
        events = []
        for r, m in enumerate(means):
            centre = median(means[:r] + means[r + 1 :])  # the other ranks: with 2, the other one
            if centre > 0 and m > self.config.factor * centre:
                self.slow_runs[r] += 1
                self.fast_runs[r] = 0
            else:  # one quick window (a busy neighbour, a lucky batch) does not clear a report
                self.slow_runs[r] = 0
                self.fast_runs[r] += 1
                if self.fast_runs[r] >= self.config.windows:
                    self.reported[r] = False
            if self.slow_runs[r] >= self.config.windows and not self.reported[r]:
                self.reported[r] = True
                share = wait_means[r] / m if m > 0 else 0.0
                event = self.event(
                    point,
                    "warning",
                    f"rank {r} is a straggler: {fmt(m * 1000)} ms a step against a median of "
                    f"{fmt(centre * 1000)} ms on the others ({m / centre:.1f}x) for "
                    f"{self.slow_runs[r]} windows of {self.config.every} steps; {share:.0%} of "
                    "it waiting for data",
                    {
                        "ranks": [r],
                        "step_time_s": m,
                        "median_step_time_s": centre,
                        "data_wait_s": wait_means[r],
                        "per_rank_step_time_s": means,
                        "windows": self.slow_runs[r],
                    },
                )
                event.rank = r
                events.append(event)
        return events
