"""Per-rank detectors of a distributed run: a rank out of line with the others, and stragglers."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainguard.config import RanksConfig, StragglerConfig
from trainguard.detectors.base import Detector, MetricPoint, fmt
from trainguard.detectors.series import MetricSeries
from trainguard.detectors.stats import MAD_TO_SIGMA, median
from trainguard.events import Event

METRICS = ("loss", "grad_norm")


class RankOutlierDetector(Detector):
    """Names the ranks whose loss or local grad norm (before the gradient reduction) is
    non-finite (critical), or far out of line with the other ranks in a way the run never showed
    (warning): each rank's log-ratio to the median of the others is judged against that rank's
    own normal centre and spread over the last `window` steps, and must exceed `z_threshold`
    robust deviations, `reach_margin` x the furthest any rank reached in that window, and
    `ratio_threshold` x its usual ratio; until `min_history` steps are seen, only a ratio over
    `warmup_ratio` counts. A step with a rank out of line is left out of the history."""

    name = "rank_outlier"
    _state = ("history",)

    def __init__(self, config: RanksConfig | None = None) -> None:
        self.config = config or RanksConfig()
        # per metric, per rank: log(value / median of the other ranks), oldest first
        self.history: dict[str, list[list[float]]] = {m: [] for m in METRICS}

    def update(self, point: MetricPoint) -> list[Event]:
        events: list[Event] = []
        for metric, values in zip(METRICS, (point.rank_losses, point.rank_grad_norms), strict=True):
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
            ratios = _log_ratios(values)
            if ratios is None:
                continue
            found = self.judge(metric, values, ratios)
            if found:
                shown = ", ".join(
                    f"rank {r} ({fmt(values[r])} against a median {fmt(m)} of the others, "
                    f"{z:.1f} of its own robust deviations where the run reached {reach:.1f})"
                    for r, m, z, reach in found
                )
                ranks = [r for r, *_ in found]
                event = self._event(
                    point, "warning", f"{metric} out of line on {shown}", metric, ranks, values
                )
                event.metrics["z"] = [round(z, 3) for _, _, z, _ in found]
                event.metrics["reach"] = round(found[0][3], 3)
                events.append(event)
            else:
                self._remember(metric, ratios)
        return events

    def advance(self, series: MetricSeries, start: int) -> int:
        return len(series)  # a series holds no per-rank columns: nothing to see

    def judge(
        self, metric: str, values: list[float], ratios: list[float] | None = None
    ) -> list[tuple[int, float, float, float]]:
        """The ranks far out of line in `values` against this run's history, without learning
        from them: (rank, median of the others, robust z, the run's reach) each; a non-finite
        value is always out of line."""
        if ratios is None:
            if any(not math.isfinite(v) for v in values):
                return [
                    (r, math.nan, math.inf, 0.0)
                    for r, v in enumerate(values)
                    if not math.isfinite(v)
                ]
            ratios = _log_ratios(values)
            if ratios is None:
                return []
        cfg = self.config
        history = self.history.get(metric) or []
        found: list[tuple[int, float, float, float]] = []
        if len(history) != len(values) or len(history[0]) < cfg.min_history:
            limit = math.log(cfg.warmup_ratio)
            for r, d in enumerate(ratios):
                if d > limit:
                    found.append((r, _others_median(values, r), math.inf, 0.0))
            return found
        past = np.asarray(history)  # (ranks, steps)
        centre = np.median(past, axis=1)
        spread = np.median(np.abs(past - centre[:, None]), axis=1) * MAD_TO_SIGMA
        spread = np.maximum(spread, math.log1p(cfg.min_spread))
        reach = float(((past - centre[:, None]) / spread[:, None]).max())
        bar = max(cfg.z_threshold, cfg.reach_margin * reach)
        lowest = math.log(cfg.ratio_threshold)
        for r, d in enumerate(ratios):
            excess = d - float(centre[r])
            z = excess / float(spread[r])
            if z > bar and excess > lowest:
                found.append((r, _others_median(values, r), z, reach))
        return found

    def _remember(self, metric: str, ratios: list[float]) -> None:
        history = self.history.setdefault(metric, [])
        if len(history) != len(ratios):  # the first step, or the world size changed
            history[:] = [[] for _ in ratios]
        for rank, d in zip(history, ratios, strict=True):
            rank.append(d)
            if len(rank) > self.config.window:
                del rank[0]

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


def _others_median(values: list[float], rank: int) -> float:
    return median(values[:rank] + values[rank + 1 :])


def _log_ratios(values: list[float]) -> list[float] | None:
    """Each rank's log(value / median of the other ranks); None where any of them is not
    positive (a ratio says nothing there)."""
    out = []
    for r, v in enumerate(values):
        centre = _others_median(values, r)
        if v <= 0 or centre <= 0:
            return None
        out.append(math.log(v / centre))
    return out


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
