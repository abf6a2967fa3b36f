"""Gradient detectors: spikes of the global norm, explosion, and vanishing layer groups."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainguard.config import GradExplosionConfig, GradSpikeConfig, VanishingConfig
from trainguard.detectors.base import Detector, MetricPoint, SpikeRun, StateParts, fmt
from trainguard.detectors.series import (
    MetricSeries,
    divide_where_positive,
    first_true,
    median_of,
    rolling_median,
    stop_at,
    windows_of,
)
from trainguard.detectors.stats import MAD_TO_SIGMA, median
from trainguard.events import Event, Severity


def _finite_grad(point: MetricPoint) -> float | None:
    g = point.grad_norm
    return g if g is not None and math.isfinite(g) and point.nonfinite_grads == 0 else None


def _grad_chunk(series: MetricSeries, start: int) -> tuple[np.ndarray, np.ndarray] | int:
    """The finite grad norms of the chunk at `start` for a bulk `advance`, or where to stop:
    `start` when layer-group norms need `update` step by step, the chunk's end when the
    series has no grad norm there."""
    if series.has_groups:
        return start
    if series.grad_norm is None:
        return series.chunk_end(start)
    idx, g = series.finite_grads(start)
    return (idx, g) if len(g) else series.chunk_end(start)


DEPARTURE = 3.0  # a group whose norm passes this x its own average has left its history


class GroupHistory(StateParts):
    """Each layer group's own grad-norm average, and when each one left it: so an incident can
    name the group that moved first."""

    def __init__(self, alpha: float = 0.05) -> None:
        self.alpha = alpha
        self.average: dict[str, float] = {}
        self.departed: dict[str, list[float]] = {}  # group -> [step, ratio at departure]

    def update(self, point: MetricPoint) -> None:
        for name, norm in (point.group_grad_norms or {}).items():
            if not math.isfinite(norm):
                continue
            avg = self.average.get(name)
            if avg is None or avg <= 0:
                self.average[name] = norm
                continue
            ratio = norm / avg
            if ratio > DEPARTURE:
                self.departed.setdefault(name, [point.step, ratio])
            else:
                self.departed.pop(name, None)
                self.average[name] = (1 - self.alpha) * avg + self.alpha * norm

    def first_mover(self) -> dict[str, Any] | None:
        """The group that left its history first (the larger jump on a tie), with its figures."""
        if not self.departed:
            return None
        name, (step, ratio) = min(self.departed.items(), key=lambda kv: (kv[1][0], -kv[1][1]))
        return {"group": name, "since_step": int(step), "ratio": ratio}


RESPONSE_POINTS = 6  # a gradient incident's own point and the next five: where the loss responds
RESPONSE_CONTEXT = 32  # finite losses before it that give the loss's noise
RESPONSE_LEVEL = 8  # the latest of them, whose median is the loss's level
RESPONSE_MIN = 8  # with fewer losses before it, the incident is not graded (its warning stands)
RESPONSE_Z = 4.0  # the incident's own loss this many noise deviations over the level responded;
# a later one twice as far; or the median of the later ones RESPONSE_HOLD_Z over it (it stayed)
RESPONSE_HOLD_Z = 2.0


class LossResponse(StateParts):
    """Whether the loss followed a gradient incident: the incident's own point and the next
    RESPONSE_POINTS - 1 set against the level and step-to-step noise of the losses before it. An
    outlier the loss did not follow, with the grad norm back, is graded info (`grad_response`);
    one it followed is confirmed; the live action on the incident stays what it was."""

    # The loss responds when the incident's own batch was over RESPONSE_Z noise deviations (one
    # bad batch, loss and gradient alike), when a later loss was twice as far (one draw of a
    # heavy-tailed per-batch loss reaches RESPONSE_Z, as a bf16 run's do), or when the later
    # losses stayed up (their median RESPONSE_HOLD_Z over the level); a NaN/Inf loss responds.

    def __init__(self) -> None:
        self.losses: deque[float] = deque(maxlen=RESPONSE_CONTEXT)
        self.watches: list[dict[str, Any]] = []

    def keep(self, losses: np.ndarray) -> None:
        """Add the losses of steps taken in bulk (no incident among them)."""
        finite = losses[np.isfinite(losses)]
        self.losses.extend(finite[-RESPONSE_CONTEXT:].tolist())

    def open(self, step: int, kind: str) -> None:
        """Watch the loss after an incident at `step` (not where too few losses came before)."""
        if len(self.losses) < RESPONSE_MIN:
            return
        before = np.fromiter(self.losses, np.float64, len(self.losses))
        steps = np.diff(before)
        noise = MAD_TO_SIGMA * float(np.median(np.abs(steps - np.median(steps)))) / math.sqrt(2)
        level = float(np.median(before[-RESPONSE_LEVEL:]))
        self.watches.append(
            {"step": step, "kind": kind, "level": level, "noise": noise, "later": [], "back": False}
        )

    def follow(self, detector: Detector, point: MetricPoint, grad_back: bool) -> list[Event]:
        """Each watch's next point (`grad_back`: the grad norm is back under its limits there);
        the grading of those that end, as info events; then the point's loss joins the level."""
        events: list[Event] = []
        loss = point.loss if math.isfinite(point.loss) else math.inf
        for w in list(self.watches):
            first = "own" not in w
            level, noise = w["level"], w["noise"]
            if first:
                w["own"] = loss
                responded = loss > level + RESPONSE_Z * noise
            else:
                w["later"].append(loss)
                w["back"] = w["back"] or grad_back
                responded = loss > level + 2 * RESPONSE_Z * noise
            if not responded and 1 + len(w["later"]) < RESPONSE_POINTS:
                continue
            if not responded:
                held = float(np.median(w["later"]))
                responded = held > level + RESPONSE_HOLD_Z * noise or not w["back"]
            self.watches.remove(w)
            events.append(self._graded(detector, point, w, responded))
        if math.isfinite(point.loss):
            self.losses.append(float(point.loss))
        return events

    @staticmethod
    def _graded(
        detector: Detector, point: MetricPoint, w: dict[str, Any], responded: bool
    ) -> Event:
        what = "gradient spike" if w["kind"] == "grad_spike" else "gradient norm's rise"
        seen = 1 + len(w["later"])
        peak = max([w["own"], *w["later"]])
        figures = (
            f"at most {fmt(peak)} over {seen} point(s), its level {fmt(w['level'])}, "
            f"noise {fmt(w['noise'])}"
        )
        if not responded:
            message = (
                f"the {what} at step {w['step']} was a benign outlier: the loss did not respond "
                f"({figures}) and the grad norm came back"
            )
        elif w["back"] or seen < RESPONSE_POINTS:
            message = f"the {what} at step {w['step']} is confirmed: the loss responded ({figures})"
        else:
            message = f"the {what} at step {w['step']} stands: the grad norm did not come back"
        metrics = {
            "spike_step": w["step"],
            "spike_kind": w["kind"],
            "loss_responded": responded,
            "loss_peak": peak,
            "loss_level": w["level"],
            "loss_noise": w["noise"],
            "points": seen,
        }
        return detector.event(point, "info", message, metrics, kind="grad_response")


EXCESS_BIN = 0.02  # width of the bins of a grad norm's excess over its level (g / level - 1)
EXCESS_BINS = 1000  # up to 20x the level; further in the top bin
TAIL_SAMPLES = 200  # excesses counted before the grad norm's own tail is first read
RECOUNT_EVERY = 100  # counts between re-reads of the tail
FORGET_AT = 20_000  # counts at which the old ones are halved, so the tail follows the run
TAIL_SHARE = 1e-3  # the tail is read at this share beyond (or 10 counts, when fewer are in)
TAIL_SPAN = 10.0  # and at ten times that share, further in
MAX_POWER = 0.5  # the reach grows at most as a tail this heavy would
LOG_FLOOR = 1e-300  # grad norms of 0 are read as this in log scale


class ResponseGradedDetector(Detector):
    """A gradient rule whose incidents are graded by the loss's response (`LossResponse`): each
    event opens a watch; bulk advances stop while one is open and feed the loss to its level."""

    response: LossResponse

    def update(self, point: MetricPoint) -> list[Event]:
        events = self._judge_point(point)
        if events:
            self.response.open(point.step, self.name)
        return events + self.response.follow(self, point, not self._incident_open())

    def advance(self, series: MetricSeries, start: int) -> int:
        if self.response.watches:
            return start  # the loss after an incident is followed step by step
        end = self._advance_grads(series, start)
        self.response.keep(series.loss[start:end])
        return end

    def _judge_point(self, point: MetricPoint) -> list[Event]:
        raise NotImplementedError

    def _advance_grads(self, series: MetricSeries, start: int) -> int:
        raise NotImplementedError

    def _incident_open(self) -> bool:
        """Whether the grad norm is still outside its limits (the incident goes on)."""
        raise NotImplementedError


class GradSpikeDetector(ResponseGradedDetector):
    """Global gradient norm over `ratio_threshold` x the median of recent non-spike norms, over
    what the run's own grad-norm outliers reach once in `reach_steps` steps, and `min_log_z`
    robust deviations of log norm over it; or over `abs_limit`. One event per incident; a norm
    that stays high for a quarter of the window is taken as the new level."""

    # The reach is read as the loss rule reads its noise's: a power law through two upper
    # quantiles of the excesses g / level - 1 of past non-spike steps (at a 1e-3 share beyond, or
    # 10 counts while fewer than 10,000 are in, and ten times further in), extrapolated to a share
    # 1 / reach_steps. So a run whose grad norm routinely jumps 6x is not flagged at 6x, while an
    # LR burst, 20x and more, is.

    name = "grad_spike"
    gate_figure = "grad_norm"
    _state = ("window", "run", "groups", "excess_hist", "excess_total", "reach", "response")

    def __init__(self, config: GradSpikeConfig | None = None) -> None:
        self.config = config or GradSpikeConfig()
        self.window: deque[float] = deque(maxlen=self.config.window)
        self.run = SpikeRun(max(self.config.window // 4, 2))
        self.groups = GroupHistory()
        self.excess_hist = np.zeros(EXCESS_BINS)
        self.excess_total = 0.0
        self.reach = 0.0  # the excess the run's own outliers reach; 0 until it is read
        self.response = LossResponse()

    def _incident_open(self) -> bool:
        return self.run.active

    def _judge_point(self, point: MetricPoint) -> list[Event]:
        """The spike rule on one step: its event, if it starts one."""
        g = _finite_grad(point)
        if g is None:
            return []
        self.groups.update(point)
        cfg = self.config
        level_of, ratio_of, limit_of, over_ratio_of, over_abs = self._judge_one(g)
        if not (over_ratio_of or over_abs):
            self.run.end()
            self.window.append(float(g))
            if math.isfinite(ratio_of):
                self._count_bins([_excess_bin_one(ratio_of - 1.0)])
            return []
        level, ratio, limit = (_known(x) for x in (level_of, ratio_of, limit_of))
        if self.run.active:
            new_level = self.run.extend(g)
            if new_level is not None:
                self.window.clear()
                self.window.extend(new_level)
                if not over_abs:  # an absolute limit stays one incident while it is exceeded
                    self.run.end()
            return []
        self.run.start(g)
        if over_ratio_of:
            message = (
                f"gradient norm {fmt(g)} is {fmt(ratio)}x its recent median {fmt(level)}, "
                f"over the {fmt(limit)}x its own outliers reach"
            )
        else:
            message = f"gradient norm {fmt(g)} is over the absolute limit {fmt(cfg.abs_limit)}"
        metrics: dict[str, Any] = {
            "grad_norm": g,
            "baseline_median": level,
            "ratio": ratio,
            "ratio_limit": limit,
            "abs_limit": cfg.abs_limit,
        }
        first = self.groups.first_mover()
        if first is not None:
            metrics["first_group"] = first
            message += (
                f"; {first['group']} moved first ({fmt(first['ratio'])}x its own level, "
                f"from step {first['since_step']})"
            )
        return [self.event(point, "warning", message, metrics)]

    def gate_bound(self) -> float:
        """The smallest grad norm over which the next step raises a spike: the limit `_passes`
        puts on its ratio to the level (both from the window alone), or the absolute limit; inf
        while a spike lasts."""
        if self.run.active:
            return math.inf
        cfg = self.config
        bounds = [math.inf if cfg.abs_limit is None else cfg.abs_limit]
        held, level_of, _ = self._levels(np.zeros(1))  # the level does not depend on it
        level = float(level_of[0])
        if level > 0:  # NaN in the warm-up
            rows = windows_of(held[:-1], len(self.window))
            bounds.append(float(self._limits(np.log(np.maximum(rows, LOG_FLOOR)))[0]) * level)
        return min(bounds)

    def _advance_grads(self, series: MetricSeries, start: int) -> int:
        """`advance` of the spike rule: up to the next step that may raise a spike."""
        chunk = _grad_chunk(series, start)
        if isinstance(chunk, int):
            return chunk
        idx, g = chunk
        cfg = self.config
        total = self.excess_total
        if len(self.window) < cfg.window or cfg.window < cfg.warmup or total != int(total):
            return start  # the window fills (or an odd count) step by step
        held, _, ratio = self._levels(g)
        # only a step over the configured ratio or the absolute limit may pass its limits
        limit = math.inf if cfg.abs_limit is None else cfg.abs_limit
        lo = 0
        for k in np.flatnonzero(self._needs_limit(ratio) | (g > limit)).tolist():
            self._accept(g[lo:k], ratio[lo:k])  # the reach in force at k, as step by step
            _, over_ratio, over_abs = self._passes(held, ratio, g, k, k + 1)
            if over_ratio[0] or over_abs[0]:
                return int(idx[k])
            lo = k
        self._accept(g[lo:], ratio[lo:])
        return series.chunk_end(start)

    def _levels(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The window's values followed by the new grad norms `g`, the level each new one is
        judged against (the median of the window before it; NaN until armed), and its ratio to
        it (NaN where the level is not positive). More than one new value needs a full window."""
        width = len(self.window)
        held = np.concatenate((np.asarray(self.window, dtype=np.float64), g))
        if width < max(self.config.warmup, 1):
            level = np.full(len(g), np.nan)
        else:
            level = rolling_median(held[:-1], width)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(level > 0, g / level, np.nan)
        return held, level, ratio

    def _judge_one(self, g: float) -> tuple[float, float, float, bool, bool]:
        """`_levels` and `_passes` of one new grad norm, in floats (the live path): its level,
        ratio and limit, and whether it passes that and the absolute limit."""
        width = len(self.window)
        level = math.nan
        if width >= max(self.config.warmup, 1):
            level = float(median_of(list(self.window)))
        ratio = divide_where_positive(g, level, math.nan)
        limit = math.nan
        if self._needs_limit(ratio):
            row = np.fromiter(self.window, np.float64, width)[None, :]
            limit = float(self._limits(np.log(np.maximum(row, LOG_FLOOR)))[0])
        return level, ratio, limit, bool(ratio > limit), bool(self._over_abs(g))

    def _needs_limit(self, ratio: Any) -> Any:
        """Which ratios are over the configured one: only those may pass the limit, computed
        there alone (arrays, or a float)."""
        return ratio > self.config.ratio_threshold

    def _over_abs(self, g: Any) -> Any:
        """Which grad norms pass `abs_limit` (none when unset); arrays, or a float."""
        if self.config.abs_limit is None:
            return np.zeros(len(g), dtype=bool) if isinstance(g, np.ndarray) else False
        return g > self.config.abs_limit

    def _passes(
        self, held: np.ndarray, ratio: np.ndarray, g: np.ndarray, lo: int, hi: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For the new steps `lo:hi` of `_levels`: the limit on each ratio (NaN under the
        configured ratio, where none is needed), and whether each passes it and the absolute
        limit, with the reach as it stands."""
        width = len(held) - len(g)
        ratios = ratio[lo:hi]
        limit = np.full(hi - lo, np.nan)
        high = np.flatnonzero(self._needs_limit(ratios))
        if len(high):
            rows = windows_of(held[:-1], width)[lo + high]
            limit[high] = self._limits(np.log(np.maximum(rows, LOG_FLOOR)))
        return limit, ratios > limit, self._over_abs(g[lo:hi])

    def _accept(self, g: np.ndarray, ratio: np.ndarray) -> None:
        """Add non-spike grad norms (and their ratios to their levels) to the window and the
        tail counts, in order."""
        if not len(g):
            return
        self.run.end()
        self.window.extend(g[-(self.window.maxlen or len(g)) :].tolist())
        self._count_bins(_excess_bin(ratio[np.isfinite(ratio)] - 1.0))

    def _limits(self, log_rows: np.ndarray) -> np.ndarray:
        """The ratio over the level a grad norm must pass, for windows of log grad norms: the
        configured ratio, the run's own reach, and `min_log_z` robust deviations in log scale."""
        centre = np.median(log_rows, axis=1, keepdims=True)
        spread = MAD_TO_SIGMA * np.median(np.abs(log_rows - centre), axis=1)
        with np.errstate(over="ignore"):
            noise = np.exp(self.config.min_log_z * spread)
        out: np.ndarray = np.maximum(max(self.config.ratio_threshold, 1.0 + self.reach), noise)
        return out

    def _count_bins(self, bins: Sequence[int] | np.ndarray) -> None:
        """Count non-spike steps' excesses over their level (their bins), in order: the old
        counts halve at FORGET_AT and the tail is re-read at every RECOUNT_EVERY-th count past
        TAIL_SAMPLES."""
        done = 0
        while done < len(bins):
            counted = int(self.excess_total)
            take = min(len(bins) - done, max(FORGET_AT - counted, 1))  # up to the next halving
            # the last count in these at which the tail is re-read: the reach it leaves holds
            recount = (counted + take) // RECOUNT_EVERY * RECOUNT_EVERY - counted
            if recount > 0 and counted + recount >= TAIL_SAMPLES:
                self._add(bins[done : done + recount])
                self.reach = self._reach()
                self._add(bins[done + recount : done + take])
            else:
                self._add(bins[done : done + take])
            done += take

    def _add(self, bins: Sequence[int] | np.ndarray) -> None:
        """Add counts to the histogram; at FORGET_AT counts the old ones halve."""
        if len(bins) == 1:  # one count, the live case: no histogram of zeros to add
            self.excess_hist[bins[0]] += 1.0
        elif len(bins):
            self.excess_hist += np.bincount(bins, minlength=EXCESS_BINS)
        self.excess_total += len(bins)
        if self.excess_total >= FORGET_AT:
            self.excess_hist /= 2
            self.excess_total /= 2

    def _reach(self) -> float:
        """The excess the run's own outliers reach once in `reach_steps` steps: a power law
        through two upper quantiles of the counted excesses."""
        hist, total = self.excess_hist, self.excess_total
        upper = max(TAIL_SHARE, 10.0 / total)
        lower = min(TAIL_SPAN * upper, 0.5)
        q_hi = _upper_quantile(hist, total, upper)
        q_lo = _upper_quantile(hist, total, lower)
        if q_lo <= 0 or q_hi <= q_lo:
            return q_hi
        power = min(math.log(q_hi / q_lo) / math.log(lower / upper), MAX_POWER)
        return float(q_hi * (upper * self.config.reach_steps) ** power)


def _known(value: float) -> float | None:
    """A figure for an event, None where it is NaN (not known)."""
    return None if math.isnan(value) else float(value)


def _excess_bin(excess: np.ndarray) -> np.ndarray:
    """The histogram bins of grad-norm excesses, one or many alike (a fall bins at 0)."""
    with np.errstate(over="ignore", invalid="ignore"):
        bins: np.ndarray = np.clip(np.floor(excess / EXCESS_BIN), 0, EXCESS_BINS - 1)
    return bins.astype(np.int64)


def _excess_bin_one(excess: float) -> int:
    """`_excess_bin` of one excess, in plain floats where it lies well inside float range."""
    if -1e6 < excess < 1e6:
        return min(max(math.floor(excess / EXCESS_BIN), 0), EXCESS_BINS - 1)
    return int(_excess_bin(np.asarray(excess)))


def _upper_quantile(hist: np.ndarray, total: float, beyond: float) -> float:
    """The value with a share `beyond` of the histogram's counts above it, interpolated in its
    bin (the open top bin reads as its lower edge)."""
    target = beyond * total
    from_top = np.cumsum(hist[::-1])
    k = int(np.searchsorted(from_top, target, side="right"))
    if k >= len(hist):
        return 0.0
    b = len(hist) - 1 - k
    if b == len(hist) - 1:
        return b * EXCESS_BIN
    above = float(from_top[k - 1]) if k > 0 else 0.0
    share = (target - above) / float(hist[b]) if hist[b] > 0 else 0.0
    return float((b + 1 - share) * EXCESS_BIN)


LEVEL_NORMS = 32  # grad norms before a growth whose median is the level it grew from
LEVEL_KNOWN = 8  # the level and its noise are read once this many norms precede the growth
RISE_NOISE = 5.0  # the growth must pass this many robust deviations of the log norms


def rise_over_level(prior: list[float], last: float, factor: float) -> bool:
    """Whether `last` rose from the grad norms before the growth (`prior`) for real: `factor` x
    over their median, and more than `RISE_NOISE` robust deviations of their logs over it (with
    norms near 0.001 that swing several-fold step to step, a run of rises from a dip is noise).
    True where fewer than `LEVEL_KNOWN` norms precede it (nothing to read yet)."""
    kept = [v for v in prior if v > 0 and math.isfinite(v)]
    if len(kept) < LEVEL_KNOWN:
        return True
    logs = np.log(np.asarray(kept, dtype=np.float64))
    centre = float(np.median(logs))
    spread = MAD_TO_SIGMA * float(np.median(np.abs(logs - centre)))
    rise = math.log(last) - centre if last > 0 else -math.inf
    return rise >= math.log(factor) and rise >= RISE_NOISE * spread


class GradExplosionDetector(ResponseGradedDetector):
    """A gradient norm that rose on each of `growth_steps` consecutive steps by `growth_factor` in
    all, from its start and from the level of the norms before it (over their noise:
    `rise_over_level`), or that passed `abs_limit`; one event until the growth breaks."""

    name = "grad_explosion"
    _state = ("history", "active", "groups", "response")

    def __init__(self, config: GradExplosionConfig | None = None) -> None:
        self.config = config or GradExplosionConfig()
        self.history: deque[float] = deque(maxlen=self.config.growth_steps + 1 + LEVEL_NORMS)
        self.active = False
        self.groups = GroupHistory()
        self.response = LossResponse()

    def _incident_open(self) -> bool:
        return self.active

    def _judge_point(self, point: MetricPoint) -> list[Event]:
        """The growth rule on one step: its event, if it starts one."""
        g = _finite_grad(point)
        if g is None:
            return []
        self.groups.update(point)
        cfg = self.config
        n = cfg.growth_steps + 1
        held = list(self.history)
        row = [*held[-(n - 1) :], g] if n > 1 else [g]
        growing = len(row) == n and bool(
            self._grows(all(b - a > 0 for a, b in itertools.pairwise(row)), row[0], row[-1])
        )
        if growing:  # rare: the level before the growth read only then
            prior = held[: len(held) - (n - 1)][-LEVEL_NORMS:]
            growing = rise_over_level(prior, g, cfg.growth_factor)
        over = bool(self._over_abs(g))
        was_active = self.active
        self.history.append(float(g))
        self.active = growing or over
        if not (growing or over) or was_active:
            return []
        h = list(self.history)[-n:]  # the growth (or the latest norms)
        if growing:
            message = (
                f"gradient norm grew {fmt(h[-1] / h[0])}x over {cfg.growth_steps} consecutive "
                f"steps, from {fmt(h[0])} to {fmt(g)}"
            )
            severity: Severity = "warning"
        else:
            message = f"gradient norm {fmt(g)} is over the absolute limit {fmt(cfg.abs_limit)}"
            severity = "critical"
        metrics: dict[str, Any] = {"grad_norm": g, "history": h, "abs_limit": cfg.abs_limit}
        first = self.groups.first_mover()
        if first is not None:
            metrics["first_group"] = first
            message += f"; {first['group']} moved first, from step {first['since_step']}"
        return [self.event(point, severity, message, metrics)]

    def _advance_grads(self, series: MetricSeries, start: int) -> int:
        """`advance` of the growth rule: up to the next step that may raise an event."""
        chunk = _grad_chunk(series, start)
        if isinstance(chunk, int):
            return chunk
        idx, g = chunk
        growing, over = self._tests(g)
        fires = growing | over
        active_before = np.concatenate(([self.active], fires[:-1]))
        first = first_true(fires & ~active_before)
        f = len(g) if first is None else first
        self._accept(g[:f], fires[:f])
        return stop_at(idx, first, series, start)

    def _tests(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each new grad norm in `g`, after the history as it stands: whether it ends
        `growth_steps` rises by `growth_factor` in all, and whether it passes `abs_limit`."""
        cfg = self.config
        n = cfg.growth_steps + 1
        kept = list(self.history)  # the rows that end at g, and the norms before them
        held = len(kept)
        v = np.concatenate((np.asarray(kept, dtype=np.float64), g))
        growing = np.zeros(len(g), dtype=bool)
        if len(v) >= n:
            rows = windows_of(v, n)  # row r ends at v[r + n - 1]
            rising = np.all(np.diff(rows, axis=1) > 0, axis=1)
            ok = self._grows(rising, rows[:, 0], rows[:, -1])
            ends = np.arange(n - 1, len(v)) - held  # the new value each row ends at
            keep = ends >= 0
            for r in np.flatnonzero(ok & keep):  # rare: the level before each growth
                prior = v[max(0, r - LEVEL_NORMS) : r].tolist()
                ok[r] = rise_over_level(prior, float(v[r + n - 1]), self.config.growth_factor)
            growing[ends[keep]] = ok[keep]
        return growing, self._over_abs(g)

    def _grows(self, rising: Any, first: Any, last: Any) -> Any:
        """The growth rule on runs of `growth_steps` + 1 norms (arrays of them, or one): a rise
        at every step, from a positive norm, by `growth_factor` in all."""
        factor = divide_where_positive(last, first, math.nan)
        return rising & (first > 0) & (factor >= self.config.growth_factor)

    def _over_abs(self, g: Any) -> Any:
        """Which grad norms pass `abs_limit` (none when unset); arrays, or a float."""
        if self.config.abs_limit is None:
            return np.zeros(len(g), dtype=bool) if isinstance(g, np.ndarray) else False
        return g > self.config.abs_limit

    def _accept(self, g: np.ndarray, fires: np.ndarray) -> None:
        """Add grad norms to the history; the incident is on while the last one fires."""
        if len(g):
            self.history.extend(g[-(self.history.maxlen or len(g)) :].tolist())
            self.active = bool(fires[-1])


STILL_LOSSES = 5  # losses at each end of a stretch of zero gradient whose medians are compared
STILL_FALL = 0.01  # a loss that fell less than this share over that stretch has not learned


class VanishingGradientDetector(Detector):
    """A layer group whose gradient norm stayed below `ratio` x its early level (the median of its
    first `reference_steps` norms), or under `abs_floor`, for `patience` steps; names the groups.
    Where the loss vanished with them (a model that fits its data), it is only info. The global
    norm under `abs_floor` for `patience` steps while the loss did not fall is a run that does
    not learn (critical); with a falling loss the logged norm is not the gradient's (info)."""

    name = "vanishing_gradients"
    _state = (
        "early",
        "reference",
        "below",
        "reported",
        "early_losses",
        "loss_reference",
        "loss",
        "still",
        "still_since",
        "still_first",
        "still_last",
        "still_reported",
    )

    def __init__(self, config: VanishingConfig | None = None) -> None:
        self.config = config or VanishingConfig()
        self.early: dict[str, list[float]] = {}
        self.reference: dict[str, float] = {}
        self.below: dict[str, int] = {}
        self.reported: dict[str, bool] = {}
        self.early_losses: list[float] = []  # the first losses, whose median is the loss's level
        self.loss_reference: float | None = None
        self.loss: float | None = None  # the latest finite loss
        self.still = 0  # consecutive steps whose global grad norm is under `abs_floor`
        self.still_since = 0  # the first of them
        self.still_first: list[float] = []  # the first losses of that stretch
        self.still_last: deque[float] = deque(maxlen=STILL_LOSSES)  # and its latest
        self.still_reported = False

    def update(self, point: MetricPoint) -> list[Event]:
        self._follow_loss([point.loss] if math.isfinite(point.loss) else [])
        groups = point.group_grad_norms
        if not groups:  # the groups' rule names the groups where they are measured
            g = _finite_grad(point)
            return [] if g is None else self._follow_global(point, g)
        if not point.grads_finite:
            return []
        return self._judge_groups(point, groups)

    def _follow_global(self, point: MetricPoint, g: float) -> list[Event]:
        """The global grad norm's stretch under `abs_floor` (where no layer groups are measured):
        an event once it lasts `patience` steps, critical where the loss did not fall over it."""
        cfg = self.config
        if g >= cfg.abs_floor:
            self.still, self.still_reported = 0, False
            self.still_first.clear()
            self.still_last.clear()
            return []
        if self.still == 0:
            self.still_since = point.step
        self.still += 1
        if math.isfinite(point.loss):
            if len(self.still_first) < STILL_LOSSES:
                self.still_first.append(float(point.loss))
            self.still_last.append(float(point.loss))
        if self.still < cfg.patience or self.still_reported or not self.still_first:
            return []
        self.still_reported = True
        first, last = median(self.still_first), median(list(self.still_last))
        fell = (first - last) / abs(first) if first else 0.0
        metrics = {"grad_norm": g, "steps": self.still, "loss_first": first, "loss_last": last}
        said = (
            f"the global gradient norm has been {fmt(g)} since step {self.still_since} "
            f"({self.still} logged steps)"
        )
        ref = self.loss_reference if self.loss_reference is not None else first
        if abs(last) <= cfg.ratio * abs(ref):
            message = f"{said}; the loss vanished with it ({fmt(last)}): the model fits its data"
            return [self.event(point, "info", message, metrics)]
        if fell < STILL_FALL:
            message = (
                f"the run does not learn: {said} and the loss has not fallen ({fmt(first)} -> "
                f"{fmt(last)}): nothing reaches the weights (a detached loss, frozen or "
                "disconnected parameters)"
            )
            return [self.event(point, "critical", message, metrics)]
        message = (
            f"{said} while the loss fell {fell:.1%} ({fmt(first)} -> {fmt(last)}): the logged "
            "norm is not the gradient's"
        )
        return [self.event(point, "info", message, metrics)]

    def _judge_groups(self, point: MetricPoint, groups: dict[str, float]) -> list[Event]:
        """The layer groups' rule on one step."""
        cfg = self.config
        newly: list[str] = []
        details: dict[str, Any] = {}
        for name, norm in groups.items():
            ref = self.reference.get(name)
            if ref is None:
                samples = self.early.setdefault(name, [])
                samples.append(norm)
                if len(samples) >= cfg.reference_steps:
                    self.reference[name] = median(samples)
                    del self.early[name]
            threshold = max(cfg.ratio * ref, cfg.abs_floor) if ref is not None else cfg.abs_floor
            if norm < threshold:
                self.below[name] = self.below.get(name, 0) + 1
                if self.below[name] >= cfg.patience and not self.reported.get(name):
                    self.reported[name] = True
                    newly.append(name)
                    details[name] = {"grad_norm": norm, "early_level": ref}
            else:
                self.below[name] = 0
                self.reported[name] = False
        if not newly:
            return []
        shown = ", ".join(newly[:10]) + (f" and {len(newly) - 10} more" if len(newly) > 10 else "")
        message = (
            f"vanishing gradients in {len(newly)} layer group(s) for {cfg.patience}+ steps: {shown}"
        )
        ref, loss = self.loss_reference, self.loss
        if ref is not None and loss is not None and abs(loss) <= cfg.ratio * abs(ref):
            message += (
                f"; the loss vanished with them ({fmt(loss)}, from {fmt(ref)} early on): the model "
                "fits its data, which is no fault"
            )
            return [self.event(point, "info", message, {"groups": newly, "figures": details})]
        return [self.event(point, "warning", message, {"groups": newly, "figures": details})]

    def _follow_loss(self, finite: Sequence[float] | np.ndarray) -> None:
        """Of the next finite losses: the latest, and the median of the first `reference_steps`
        ones."""
        if not len(finite):
            return
        self.loss = float(finite[-1])
        if self.loss_reference is None:
            need = self.config.reference_steps - len(self.early_losses)
            self.early_losses.extend(float(x) for x in finite[:need])
            if len(self.early_losses) >= self.config.reference_steps:
                self.loss_reference = median(self.early_losses)
                self.early_losses = []

    def advance(self, series: MetricSeries, start: int) -> int:
        if series.has_groups or self.still:
            return start
        end = len(series)
        if series.grad_norm is not None:  # up to the next global norm under the floor
            idx, g = series.finite_grads(start)
            low = np.flatnonzero(g < self.config.abs_floor)
            end = series.chunk_end(start) if not len(low) else int(idx[low[0]])
        losses = series.loss[start:end]
        self._follow_loss(losses[np.isfinite(losses)])  # no groups: nothing can vanish
        return end
