"""Per-rank detectors of a distributed run: a rank out of line with the others, and stragglers."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainguard.config import RanksConfig, StragglerConfig
from trainguard.detectors.base import Detector, MetricPoint, RankMetric, RankTiming, fmt
from trainguard.detectors.series import MetricSeries
from trainguard.detectors.stats import MAD_TO_SIGMA, median
from trainguard.events import Event

METRICS = ("loss", "grad_norm")
WARMUP_BAR = 1e38  # in the warm-up only an infinite key (a ratio over `warmup_ratio`) is over it


class OwnRule:
    """What a rank's own history says, for the `reduce` exchange to judge this rank on the
    device: its usual log-ratio (centre), robust spread, the furthest it reached in the window,
    whether the learned rule applies yet, and the rule's two fixed bounds."""

    def __init__(
        self, centre: float, spread: float, reach: float, warm: bool, lowest: float, limit: float
    ) -> None:
        self.centre, self.spread, self.reach, self.warm = centre, spread, reach, warm
        self.lowest, self.limit = lowest, limit


class RankOutlierDetector(Detector):
    """Names the ranks whose loss or local grad norm (before the gradient reduction) is
    non-finite (critical), or far out of line with the other ranks in a way the run never showed
    (warning): each rank's log-ratio to the median of the others is judged against that rank's
    own normal centre and spread over the last `window` steps, and must exceed `z_threshold`
    robust deviations, `reach_margin` x the furthest any rank reached in that window, and
    `ratio_threshold` x its usual ratio; until `min_history` steps are seen, only a ratio over
    `warmup_ratio` counts. A step with a rank out of line is left out of the history."""

    name = "rank_outlier"
    needs_ranks = True
    _state = ("history", "own")

    def __init__(self, config: RanksConfig | None = None) -> None:
        self.config = config or RanksConfig()
        # per metric, per rank: log(value / median of the other ranks), oldest first
        self.history: dict[str, list[list[float]]] = {m: [] for m in METRICS}
        # the `reduce` exchange: per metric, this rank's log-ratio to the others' centre
        self.own: dict[str, list[float]] = {m: [] for m in METRICS}

    def update(self, point: MetricPoint) -> list[Event]:
        if point.rank_metrics is not None:
            return self._update_reduced(point, point.rank_metrics)
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

    # -- the `reduce` exchange: each rank judges itself; the reductions name the worst ----------
    def own_rule(self, metric: str) -> OwnRule:
        """This rank's learned line for `metric`, from its own history (the `reduce` exchange
        scores this rank with it before the step's MAX)."""
        cfg = self.config
        past = self.own.get(metric) or []
        lowest, limit = math.log(cfg.ratio_threshold), math.log(cfg.warmup_ratio)
        if len(past) < cfg.min_history:
            return OwnRule(0.0, 1.0, 0.0, False, lowest, limit)
        values = np.asarray(past)
        centre = float(np.median(values))
        spread = float(np.median(np.abs(values - centre))) * MAD_TO_SIGMA
        spread = max(spread, math.log1p(cfg.min_spread))
        reach = float(((values - centre) / spread).max())
        return OwnRule(centre, spread, reach, True, lowest, limit)

    def bar(self, metric: str, reach: float) -> float:
        """The robust z a rank must pass, given the furthest any rank reached (from the MAX)."""
        if len(self.own.get(metric) or []) < self.config.min_history:
            return WARMUP_BAR
        return max(self.config.z_threshold, self.config.reach_margin * reach)

    def _update_reduced(self, point: MetricPoint, figures: dict[str, RankMetric]) -> list[Event]:
        events: list[Event] = []
        for metric in METRICS:
            figure = figures.get(metric)
            if figure is None:
                continue
            if figure.nonfinite:
                named = sorted(figure.named)
                shown = ", ".join(f"rank {r} ({v})" for r, v, _ in named)
                if figure.more:
                    shown += f" and more ({figure.nonfinite} ranks in all)"
                events.append(
                    self._reduced_event(
                        point, "critical", f"non-finite {metric} on {shown}", metric, figure
                    )
                )
                continue
            if not figure.positive:
                continue
            warm = len(self.own.get(metric) or []) >= self.config.min_history
            if figure.named and figure.worst > self.bar(metric, figure.reach):
                reach = figure.reach if warm else 0.0
                named = sorted(figure.named)
                shown = ", ".join(
                    f"rank {r} ({fmt(v)} against {fmt(figure.others_centre(v))}, the others' "
                    f"geometric mean, {z:.1f} of its own robust deviations where the run "
                    f"reached {reach:.1f})"
                    for r, v, z in named
                )
                if figure.more:
                    shown += f" and more (the worst {len(named)} named)"
                event = self._reduced_event(
                    point, "warning", f"{metric} out of line on {shown}", metric, figure
                )
                event.metrics["z"] = [round(z, 3) for *_, z in named]
                event.metrics["reach"] = round(reach, 3)
                events.append(event)
            else:
                past = self.own.setdefault(metric, [])
                past.append(figure.own)
                if len(past) > self.config.window:
                    del past[0]
        return events

    def _reduced_event(
        self, point: MetricPoint, severity: Any, what: str, metric: str, figure: RankMetric
    ) -> Event:
        named = sorted(figure.named)
        ranks = [r for r, *_ in named]
        summary = {
            "ranks_total": figure.world,
            "nonfinite": figure.nonfinite,
            "high": figure.high,
            "high_rank": figure.high_rank,
            "low": figure.low,
            "low_rank": figure.low_rank,
            "more": figure.more,
        }
        event = self.event(
            point,
            severity,
            what + " (before the gradient reduction)",
            {"metric": metric, "ranks": ranks, "values": [v for _, v, _ in named], **summary},
        )
        event.rank = ranks[0] if ranks else figure.worst_rank
        return event

    def judge_replay(self, metric: str, values: list[float], rules: list[OwnRule]) -> list[int]:
        """The `reduce` exchange's replay verdict: the ranks whose replayed `values` are out of
        line against the others' centre by each rank's own learned rule (`rules`, one a rank)."""
        if any(not math.isfinite(v) for v in values):
            return [r for r, v in enumerate(values) if not math.isfinite(v)]
        if len(values) < 2 or any(v <= 0 for v in values):
            return []
        logs = [math.log(v) for v in values]
        total, world = sum(logs), len(values)
        reach = max(rule.reach for rule in rules)
        found = []
        for r, (log, rule) in enumerate(zip(logs, rules, strict=True)):
            d = log - (total - log) / (world - 1)
            if not rule.warm:
                if d > rule.limit:
                    found.append(r)
                continue
            excess = d - rule.centre
            bar = max(self.config.z_threshold, self.config.reach_margin * reach)
            if excess / rule.spread > bar and excess > rule.lowest:
                found.append(r)
        return found

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


_OWN_START = {
    "world": 0.0,
    "sum": 0.0,
    "wait": 0.0,
    "all": 0.0,
    "count": 0.0,
    "slow_runs": 0.0,
    "fast_runs": 0.0,
    "reported": 0.0,
}


class StragglerDetector(Detector):
    """A rank whose mean step time (data wait plus compute before the first gradient reduction)
    over a window of `every` steps is `factor` x the median of the other ranks', `windows`
    windows in a row; reported once, until as many normal windows in a row clear it."""

    name = "straggler"
    needs_ranks = True
    _state = ("sums", "waits", "count", "slow_runs", "fast_runs", "reported", "own")

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self.sums: list[float] = []
        self.waits: list[float] = []
        self.count = 0
        self.slow_runs: list[int] = []
        self.fast_runs: list[int] = []  # normal windows in a row, which clear a report
        self.reported: list[bool] = []
        # the `reduce` exchange: this rank's window (its sums, the ranks' mean's sum, its runs)
        self.own: dict[str, float] = dict(_OWN_START)

    def advance(self, series: MetricSeries, start: int) -> int:
        return len(series)

    def own_window(self) -> dict[str, float]:
        """This rank's window so far (the `reduce` exchange judges it on the device at the
        window's last step): its summed step times and data waits, the sum of the ranks' mean
        step time, the steps counted, its slow windows in a row and whether it was reported."""
        return self.own

    def _update_reduced(self, point: MetricPoint, timing: RankTiming) -> list[Event]:
        own = self.own
        if timing.world != own["world"]:  # the first step, or the world size changed
            self.own = own = {**_OWN_START, "world": float(timing.world)}
        if not (math.isfinite(timing.mean) and math.isfinite(timing.own)):
            return []
        own["sum"] += timing.own
        own["wait"] += timing.own_wait if math.isfinite(timing.own_wait) else 0.0
        own["all"] += timing.mean
        own["count"] += 1
        if own["count"] < self.config.every:
            return []
        count, everyone = own["count"], own["all"]
        own["sum"] = own["wait"] = own["all"] = own["count"] = 0.0
        if timing.own_slow:  # decided on the device, from the same sums
            own["slow_runs"] += 1
            own["fast_runs"] = 0.0
        else:
            own["slow_runs"] = 0.0
            own["fast_runs"] += 1
            if own["fast_runs"] >= self.config.windows:
                own["reported"] = 0.0
        if own["slow_runs"] >= self.config.windows:
            own["reported"] = 1.0
        events = []
        world = timing.world
        for r, mean, wait, windows in timing.named:
            centre = (everyone / count * world - mean) / (world - 1)  # the others' mean
            share = wait / mean if mean > 0 else 0.0
            event = self.event(
                point,
                "warning",
                f"rank {r} is a straggler: {fmt(mean * 1000)} ms a step against a mean of "
                f"{fmt(centre * 1000)} ms on the others ({mean / centre:.1f}x) for "
                f"{windows} windows of {self.config.every} steps; {share:.0%} of "
                "it waiting for data",
                {
                    "ranks": [r],
                    "step_time_s": mean,
                    "others_step_time_s": centre,
                    "data_wait_s": wait,
                    "windows": windows,
                    "ranks_total": world,
                },
            )
            event.rank = r
            events.append(event)
        return events

    def update(self, point: MetricPoint) -> list[Event]:
        if point.rank_timing is not None:
            return self._update_reduced(point, point.rank_timing)
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
