"""`LossSpikeDetector`: a loss far above its recent level, typed by cause, revised on follow-up."""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, fields
from statistics import NormalDist
from typing import Any

import numpy as np

from trainguard.config import LossSpikeConfig
from trainguard.detectors.base import Detector, MetricPoint, SpikeRun, fmt
from trainguard.detectors.series import (
    MetricSeries,
    divide_where_positive,
    maximum,
    mean_of,
    median_of,
    noise_sigmas,
    rolling_median,
    spread_sigmas,
    square_root,
    stop_at,
    trailing_means,
    warm_ema,
    warm_ema_one,
    windows_of,
)
from trainguard.detectors.stats import (
    detrended,
    dominant_period,
    mann_kendall_z,
    mean,
    median,
    student_t_reach,
)
from trainguard.events import Event, Severity, SpikeType

TREND_Z = 4.0  # Mann-Kendall z of the pre-spike losses that reads as a steady rise
TREND_SPAN = 96  # pre-spike steps whose trend is tested
BUILD_UP = 16  # a rise confined to this many steps before the spike is an instability brewing
SWING_JUMP = 2.0  # a lasting rise this many times a swing's height is a jump, not its top
FLAT_DATA = (
    " on new batches with no rise before it while the gradient norm stayed flat: a stretch of "
    "bad data (a shard degrading into noise), not the weights"
)
FLAT_ROSE = " after rising before it while the gradient norm stayed flat"
SHORT_SWING = 48  # latest steps a swing that grew late is looked for in, to type a spike
SWING_EXPLAINS = 50.0  # a swing before a spike types it optimizer only up to this many times
# its height: a loss 300x up (a x1000 write to the weights) is not the swing grown too far
PERIOD_ACF = 0.35  # autocorrelation at the dominant period that reads as oscillation
GRAD_HIGH = 2.0  # grad norm over this x its baseline mean counts as elevated
Z_BIN = 0.25  # width of the |z| histogram bins that measure how heavy the noise tails are
Z_BINS = 100
LOW_BINS = 2 * Z_BINS  # the signed histogram of the first steps' noise, -25 to 25
TAIL_FIT_SAMPLES = 100  # |z| values counted before the tails are first read
TAIL_MIN_SAMPLES = 2000  # |z| values counted before they are read as a power law from both sides
TAIL_BEYOND = 10  # the tails are read at the quantile with this many values beyond it, or beyond
MAX_TAIL = 3.0  # the widest the persistence threshold gets
TAIL_SPAN = 10.0  # the lower quantile lies this many times further in than the upper one
MAX_TAIL_POWER = 0.5  # the reach grows at most as a tail this heavy (Student-t, nu = 2) would
MAX_REACH = 40.0  # noise standard deviations: the furthest the reach goes (Student-t nu=3: 35)
NOISE_EVERY = 16  # steps between re-estimates of the recent noise (it moves slowly)
LEVEL_SPAN = 4  # the long level is the median of this many times `level_window` losses
SPREAD_CAP = 2.0  # the spread about a fitted quadratic raises the noise up to this x the other
SPREAD_MIN = 1.25  # once it is this x the first differences' (correlated noise, not chance)
SPREAD_SPAN = 32  # the latest losses whose spread bounds the window's: a quadratic fits them
SPREAD_NEAR = 1.5  # even early in training, where over the whole window the loss's curvature
# would read as noise; the window's spread counts up to this x theirs
# and the baseline is not swinging periodically: a swing is signal, judged apart (`_swing`)


Values = Any  # a chunk's figures as arrays (`_measure`), or one step's as floats (`_measure_one`)


@dataclass
class _Measures:
    """`LossSpikeDetector._measure` of a chunk of losses: one value a step (`noise_var` has one
    more: the value before each step, and after the last); or `_measure_one` of one loss, floats
    (`noise_var` the value before it)."""

    losses: Values
    base_mean: Values
    short: Values
    drift: Values
    level: Values
    noise_var: Values
    sigma: Values
    jump: Values
    z: Values
    z_noise: Values
    below: Values
    ratio: Values

    def at(self, k: int) -> _Measures:
        """The measures of step `k` alone."""
        values = [getattr(self, f.name)[k : k + 1] for f in fields(self)]
        return _Measures(*values)


class _TailCounts:
    """`LossSpikeDetector._count_z` over many |z| bins at once: the histogram, count and tail
    factor after any number of them, without replaying them one by one."""

    def __init__(self, detector: LossSpikeDetector, bins: np.ndarray, low_bins: np.ndarray) -> None:
        self.detector = detector
        self.bins = bins
        self.low_bins = low_bins
        self.hist0 = np.asarray(detector.z_hist, dtype=np.float64)
        self.low0 = np.asarray(detector.low_hist, dtype=np.float64)
        self.excursions0 = np.asarray(detector.excursion_hist, dtype=np.float64)
        self.halve_at = 20 * detector.config.noise_horizon
        t0 = detector.z_total
        self.totals: np.ndarray | None = None
        if t0 != int(t0) or t0 >= self.halve_at:
            return  # not a state `_count_z` reaches: leave it to `update`
        q = np.arange(1, len(bins) + 1)
        first_halving = self.halve_at - int(t0)
        half = self.halve_at // 2
        after = q >= first_halving
        # the running count after each value, and the halvings up to it
        self.totals = np.where(after, half + (q - first_halving) % half, int(t0) + q)
        self.halvings = np.where(after, 1 + (q - first_halving) // half, 0)
        recount = (self.totals >= TAIL_FIT_SAMPLES) & (self.totals % 100 == 0)
        self.recounts = np.flatnonzero(recount) + 1  # counts after which the tail is recomputed
        # a value joins the signed histogram while fewer than TAIL_MIN_SAMPLES are counted
        self.low_counted = np.concatenate(([t0], self.totals[:-1])) < TAIL_MIN_SAMPLES
        self.cache: dict[int, tuple[float, float]] = {}

    def total_after(self, c: int) -> float:
        assert self.totals is not None
        return float(self.totals[c - 1]) if c > 0 else self.detector.z_total

    def hist_after(self, c: int) -> np.ndarray:
        if c == 0:
            return self.hist0.copy()
        h = self.halvings[:c]
        prior = np.concatenate(([0], h[:-1]))
        weights = np.exp2(prior - h[-1])  # each halving from a value's own count on halves it
        counted = np.bincount(self.bins[:c], weights=weights, minlength=Z_BINS)
        out: np.ndarray = counted + self.hist0 * 2.0 ** -float(h[-1])
        return out

    def excursions_after(self, c: int) -> np.ndarray:
        """The undone excursions' histogram once `c` values are counted: halved with the rest
        (none joins it in bulk, where no step is elevated)."""
        if c == 0:
            return self.excursions0.copy()
        out: np.ndarray = self.excursions0 * 2.0 ** -float(self.halvings[c - 1])
        return out

    def low_after(self, c: int) -> np.ndarray:
        """The signed histogram once `c` values are counted (it stops at TAIL_MIN_SAMPLES)."""
        counted = np.bincount(self.low_bins[:c][self.low_counted[:c]], minlength=LOW_BINS)
        out: np.ndarray = self.low0 + counted
        return out

    def tail_after(self, c: int) -> tuple[float, float]:
        """The tail factor and the noise's reach in force once `c` values are counted."""
        k = int(np.searchsorted(self.recounts, c, side="right"))
        if k == 0:
            return self.detector.tail, self.detector.reach
        r = int(self.recounts[k - 1])
        if r not in self.cache:
            self.cache[r] = self.detector._tail_of(
                self.hist_after(r), self.total_after(r), self.low_after(r), self.excursions_after(r)
            )
        return self.cache[r]


class LossSpikeDetector(Detector):
    """Flags a loss more than `z_threshold` noise standard deviations (and `min_rel_jump`) over
    its recent non-spike level, or over `ratio_threshold` x the recent mean (README: how the
    level, noise and spike type are estimated)."""

    # The level is the median of the latest `level_window` baseline losses; the noise is the larger
    # of a recent winsorised estimate from first differences and a long-run mean (an EMA over
    # `noise_horizon` once that many are in), both less the drift, so that neither the fast early
    # fall nor the larger noise of the first steps is read as noise later. The z threshold is also
    # at least the noise's reach: how far |z| goes once in `noise_reach_steps`, extrapolated from
    # two upper quantiles of past |z| (`tail_quantile` and ten times further in) as a power-law
    # tail. Until TAIL_MIN_SAMPLES are counted, the reach is instead that of a Student-t fitted to
    # the lower tail of the noise (below its median, where spikes and bumps never land, taken from
    # where the drift has moved the level: a fast fall is not a tail), read from TAIL_FIT_SAMPLES
    # on (0 before). A jump that stays over `persist_z`, widened by how far the upper quantile lies
    # beyond a Gaussian's (1 until TAIL_MIN_SAMPLES), for `persist_steps` steps is a spike too;
    # those steps join the baseline only if the loss comes back before that. In a run whose
    # baseline has doubled its recent mean (noise as large as the level, as mixed-length batches
    # give), the ratio rule needs the reach as well, and the jumps that came back before they
    # could persist are the noise's own tail beyond the body: from TAIL_MIN_SAMPLES on, the reach
    # is at least what they reach, carried out from their rate at the body's power. A spike
    # lasts until the loss falls back under half `persist_z`; one lasting a quarter of the window
    # becomes the new level. `spike_classified` revises the type after `classify_window` steps,
    # or after `confirm_steps` (see LossSpikeConfig) when a spike typed data toxicity stays far
    # up on the batches after it.

    name = "loss_spike"
    gate_figure = "loss"
    _state = (
        "window",
        "grads",
        "run",
        "watch",
        "noise_var",
        "last",
        "z_hist",
        "z_total",
        "tail",
        "reach",
        "short",
        "drift",
        "noise_count",
        "noise_age",
        "pending",
        "low_hist",
        "doublings",
        "excursion_hist",
    )

    def __init__(self, config: LossSpikeConfig | None = None) -> None:
        self.config = config or LossSpikeConfig()
        # steps far up that confirm an explosion early; the Guard sizes it when left to the run
        self.confirm_steps = self.config.confirm_steps or 0
        self.window: deque[float] = deque(maxlen=self.config.window)
        self.grads: deque[float] = deque(maxlen=self.config.window)
        self.run = SpikeRun(max(self.config.window // 4, self.config.classify_window + 1))
        self.watch: dict[str, Any] | None = None
        self.noise_var: float | None = None
        self.last: float | None = None
        self.z_hist: list[float] = [0.0] * Z_BINS
        self.z_total = 0.0
        self.tail = 1.0
        self.reach = 0.0  # until the tails are read: the z threshold alone
        self.short = 0.0
        self.drift = 0.0  # the median step-to-step change: the trend, kept out of the noise
        self.noise_count = 0  # values in the long-run noise: its running mean until the horizon
        self.noise_age = 0
        self.pending: list[list[Any]] = []  # [step, loss, grad_norm, z, below] of elevated steps
        self.low_hist: list[float] = [0.0] * LOW_BINS  # signed `below` of the first steps
        # baseline steps over `ratio_threshold` x the recent mean while under the persistence
        # threshold: the run's own noise doubles its mean, so a doubling alone is no evidence
        self.doublings = 0
        # in such a run, the z of each excursion over the level that came back before it could
        # persist: the tail beyond the body that the run produces itself (`_excursion_reach`)
        self.excursion_hist: list[float] = [0.0] * Z_BINS

    def update(self, point: MetricPoint) -> list[Event]:
        if not point.loss_finite:
            return []
        events: list[Event] = []
        if self.watch is not None:
            revised = self._follow(point)
            if revised is not None:
                events.append(revised)
        cfg = self.config
        loss = point.loss
        if len(self.window) < cfg.warmup:
            self._accept(loss, point.grad_norm, None)
            return events
        m = self._measure_one(loss)
        if self.noise_var is None:
            self.noise_var = float(m.noise_var)
        self.short, self.drift = float(m.short), float(m.drift)
        self.noise_age += 1
        base_mean, level, sigma, jump, z, z_noise, below, ratio = (
            float(x)
            for x in (m.base_mean, m.level, m.sigma, m.jump, m.z, m.z_noise, m.below, m.ratio)
        )
        z_rule_of, ratio_rule_of, elevated_of, threshold = self._rules(
            m, self.tail, self.reach, self.doublings
        )
        z_rule, ratio_rule, elevated = bool(z_rule_of), bool(ratio_rule_of), bool(elevated_of)
        if self.run.active:
            if z_rule or ratio_rule or z > 0.5 * cfg.persist_z * self.tail:  # not back yet
                new_level = self.run.extend(loss)
                if new_level is not None:
                    self.window.clear()
                    self.window.extend(new_level)
                    self.noise_age = 0
                    self.last = loss
                    self.run.end()
                return events
            self.run.end()
        if not (z_rule or ratio_rule):
            if not elevated:
                self._release_pending()  # it was noise after all
                self.doublings += bool(ratio > cfg.ratio_threshold)
                self._accept(loss, point.grad_norm, z_noise, below)
                return events
            self.pending.append([point.step, loss, point.grad_norm, z_noise, below])
            if len(self.pending) < cfg.persist_steps:
                return events
            swing = self._swing(list(self.window))
            if swing is not None and jump < SWING_JUMP * swing[2]:  # a swing's top, not a jump
                self._release_pending()
                return events
        values = [p[1] for p in self.pending] + ([loss] if z_rule or ratio_rule else [])
        since = int(self.pending[0][0]) if self.pending else point.step
        spike_grads = [p[2] for p in self.pending] + [point.grad_norm]
        self.pending.clear()
        self.run.start(values[0])
        for value in values[1:]:
            self.run.extend(value)
        if self.watch is not None:
            events.append(self._finish(point))
        held = len(values)
        grad_mean = median(list(self.grads)) if self.grads else None
        known = [g for g in spike_grads if g is not None and math.isfinite(g)]
        # the run's own grad norm: no explosion without a rise of it where it is known
        grad_rose = None if not known or not grad_mean else max(known) > GRAD_HIGH * grad_mean
        spike_type, confidence, why = self._classify(point, held, grad_rose, jump)
        self.watch = {
            "step": point.step,
            "type": spike_type,
            "confidence": confidence,
            "level": level,
            "peak": loss,
            "grad_mean": grad_mean,
            "seen": 0,
            "back_at": None,
            "back_steps": 0,
            "high_grad_steps": 0,
            "grad_rose": grad_rose,
            "rose_before": rose_before(list(self.window)),
            "far_over": threshold * sigma,  # a jump still this far up is no noise
            "far_steps": 0,
        }
        rule = "z-score" if z_rule else "ratio" if ratio_rule else "persistent"
        metrics = {
            "loss": loss,
            "level": level,
            "baseline_mean": base_mean,
            "noise_std": sigma,
            "z_score": z,
            "z_threshold": threshold,
            "ratio_min_z": cfg.ratio_min_z,
            "ratio": ratio,
            "rule": rule,
            "since_step": since,
            "grad_norm": point.grad_norm,
        }
        jumped = "jumped" if held == 1 else f"has stayed for {held} steps"
        message = (
            f"loss {fmt(loss)} {jumped} over its level {fmt(level)} "
            f"(z={fmt(z)}, {fmt(ratio)}x the recent mean); likely {spike_type.replace('_', ' ')}: "
            f"{why}"
        )
        severity: Severity = "critical" if ratio_rule and z_rule else "warning"
        events.append(
            self.event(point, severity, message, metrics, type=spike_type, confidence=confidence)
        )
        return events

    def gate_bound(self) -> float:
        """The smallest loss over which the next step raises a spike (`_rules`' thresholds with
        the level, noise and mean the state gives, which the new loss does not move); inf in the
        warm-up and while a spike lasts, where none is raised."""
        cfg = self.config
        if len(self.window) < cfg.warmup or self.run.active:
            return math.inf
        m = self._measure(np.zeros(1))  # the thresholds do not depend on the loss judged
        level, sigma, base_mean = float(m.level[0]), float(m.sigma[0]), float(m.base_mean[0])
        big = level + cfg.min_rel_jump * abs(level)
        threshold = max(cfg.z_threshold, self.reach)
        bounds = [max(big, level + threshold * sigma)]
        if base_mean > 0:
            ratio_z = max(cfg.ratio_min_z, self.reach) if self.doublings else cfg.ratio_min_z
            bounds.append(max(cfg.ratio_threshold * base_mean, level + ratio_z * sigma))
        if len(self.pending) + 1 >= cfg.persist_steps:  # the step that makes a jump persist
            persist = max(big, level + cfg.persist_z * self.tail * sigma)
            swing = self._swing(list(self.window))
            bounds.append(persist if swing is None else max(persist, level + SWING_JUMP * swing[2]))
        return min(bounds)

    def advance(self, series: MetricSeries, start: int) -> int:
        full = len(self.window) == self.window.maxlen
        if self.watch is not None or self.run.active or self.pending or not full:
            return start
        if self.noise_var is None or self.last is None:
            return start
        idx, losses = series.finite_losses(start)
        m = len(losses)
        if m == 0:
            return series.chunk_end(start)
        got = self._measure(losses)
        counted = np.isfinite(got.z_noise)
        bins = np.minimum(np.abs(got.z_noise[counted]) / Z_BIN, Z_BINS - 1).astype(np.int64)
        before = np.concatenate(([0], np.cumsum(counted)))[:-1]  # counts before each step
        tails = _TailCounts(self, bins, _low_bin(got.below[counted]))
        if tails.totals is None:
            return start
        cfg = self.config
        # the baseline doublings before each step: every step before the first decision is one
        doubled = got.ratio > cfg.ratio_threshold
        doublings = self.doublings + np.concatenate(([0], np.cumsum(doubled)))[:-1]
        # a spike, or the first step of a lasting one (each threshold only widens from these,
        # with the reach in force at the step, so steps under `lowest` need no look)
        lowest = min(cfg.z_threshold, cfg.persist_z, cfg.ratio_min_z)
        first = None
        for k in np.flatnonzero(got.z > lowest).tolist():
            tail, reach = tails.tail_after(int(before[k]))
            z_rule, ratio_rule, elevated, _ = self._rules(got.at(k), tail, reach, int(doublings[k]))
            if z_rule[0] or ratio_rule[0] or elevated[0]:
                first = k
                break
        f = m if first is None else first
        if f == 0:
            return int(idx[0])
        w = cfg.window
        kept = np.concatenate((np.asarray(self.window, dtype=np.float64), losses[:f]))
        self.window = deque(kept[-w:].tolist(), maxlen=w)
        self.noise_var = float(got.noise_var[f])
        self.last = float(losses[f - 1])
        self.short = float(got.short[f - 1])
        self.drift = float(got.drift[f - 1])
        self.noise_count += f
        self.noise_age += f
        self.doublings = int(doublings[f - 1] + doubled[f - 1])
        counts = int(before[f - 1] + counted[f - 1])
        self.tail, self.reach = tails.tail_after(counts)
        self.z_hist = tails.hist_after(counts).tolist()
        self.low_hist = tails.low_after(counts).tolist()
        self.excursion_hist = tails.excursions_after(counts).tolist()
        self.z_total = tails.total_after(counts)
        if series.grad_norm is not None:
            g = series.grad_norm[idx[:f]]
            self.grads.extend(g[np.isfinite(g)][-w:].tolist())
        return stop_at(idx, first, series, start)

    def _measure(self, losses: np.ndarray) -> _Measures:
        """What each new loss is judged on, after the window as it stands and as if each one
        before it in `losses` joined the baseline (more than one needs a full window): the
        recent mean, the noise (re-estimated every NOISE_EVERY steps) and drift, the near and
        the judged level, and the loss's z and ratio over them."""
        cfg = self.config
        m, held = len(losses), len(self.window)
        v = np.concatenate((np.asarray(self.window, dtype=np.float64), losses))
        base_mean = trailing_means(v, held, held)
        refresh = np.arange(-self.noise_age % NOISE_EVERY, m, NOISE_EVERY)  # ages at 0 mod it
        if not len(refresh):
            short, drift = np.full(m, self.short), np.full(m, self.drift)
        else:
            fresh, fresh_drift = self._noise_of(windows_of(v[:-1], held)[refresh])
            which = np.searchsorted(refresh, np.arange(m), side="right") - 1
            short = np.where(which >= 0, fresh[np.maximum(which, 0)], self.short)
            drift = np.where(which >= 0, fresh_drift[np.maximum(which, 0)], self.drift)
        near_width = min(cfg.level_window, held)
        near = rolling_median(v[held - near_width : -1], near_width)
        span = min(self._long_window, held)
        long = None
        if span > cfg.level_window:
            long = rolling_median(v[held - span : -1], span)
        last = math.nan if self.last is None else self.last
        diffs = self._diffs(losses, np.concatenate(([last], losses[:-1])), drift)
        start = short[0] * short[0] if self.noise_var is None else self.noise_var
        noise_var = warm_ema(diffs, start, self.noise_count, cfg.noise_horizon)
        return self._judged(losses, base_mean, short, drift, near, long, noise_var, noise_var[:-1])

    def _measure_one(self, loss: float) -> _Measures:
        """`_measure` of one new loss, in floats: the same figures, without numpy's fixed cost
        of one-element arrays (the live path)."""
        cfg = self.config
        window = self.window
        held = len(window)
        if self.noise_age % NOISE_EVERY == 0:  # `_measure`'s refresh at age 0 mod NOISE_EVERY
            rows = np.fromiter(window, np.float64, held)[None, :]
            base_mean = mean_of(rows[0])
            fresh, fresh_drift = self._noise_of(rows)
            short, drift = float(fresh[0]), float(fresh_drift[0])
        else:
            base_mean = mean_of(np.fromiter(window, np.float64, held))
            short, drift = self.short, self.drift
        near_width, span = min(cfg.level_window, held), min(self._long_window, held)
        recent = list(itertools.islice(window, held - max(near_width, span), held))
        near = median_of(recent[-near_width:])
        long = median_of(recent[-span:]) if span > cfg.level_window else None
        start = short * short if self.noise_var is None else self.noise_var
        return self._judged(loss, base_mean, short, drift, near, long, start, start)

    @staticmethod
    def _diffs(losses: Values, before: Values, drift: Values) -> Values:
        """Half the squared step-to-step change less the drift: what the long-run noise
        averages."""
        diffs = losses - before - drift
        return 0.5 * diffs * diffs

    def _judged(
        self,
        losses: Values,
        base_mean: Values,
        short: Values,
        drift: Values,
        near: Values,
        long: Values | None,
        noise_var: Values,
        noise_before: Values,
    ) -> _Measures:
        """The figures a loss is judged on from the window's: the level, noise, z and ratio, on
        arrays (a chunk) or floats (one step) alike."""
        level = near
        if long is not None:  # a short dip does not drag the level a spike is judged on
            level = maximum(near, long + drift * self._long_shift)
        sigma = maximum(short, square_root(noise_before))
        jump = losses - level
        # the noise's own deviations, from the near level, for its tails: the z of a baseline
        # step, and how far below where the drift has taken the level by now it is
        dev = losses - near
        z, z_noise = _over_noise(jump, sigma), _over_noise(dev, sigma)
        below = divide_where_positive(dev - self._lag * drift, sigma, 0.0)
        ratio = divide_where_positive(losses, base_mean, math.nan)
        return _Measures(
            losses, base_mean, short, drift, level, noise_var, sigma, jump, z, z_noise, below, ratio
        )

    def _noise_of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The short-run noise and drift of windows of baseline losses (rows): from first
        differences, raised up to SPREAD_CAP x by the spread about a quadratic where both spans
        agree the noise is correlated and the window is not swinging."""
        fresh, fresh_drift = noise_sigmas(rows)
        spread, near_spread = _bounded_spread(rows)
        raised = np.minimum(spread, near_spread) > SPREAD_MIN * fresh  # both spans agree
        for j in np.flatnonzero(raised).tolist():
            if self._swing(rows[j].tolist()) is None:  # a swing's spread is no noise
                fresh[j] = min(float(spread[j]), SPREAD_CAP * float(fresh[j]))
        return fresh, fresh_drift

    def _rules(
        self, m: _Measures, tail: float, reach: float, doublings: int
    ) -> tuple[Values, Values, Values, float]:
        """Which steps pass the z-score rule, the ratio rule, and the persistence threshold (a
        spike once it holds `persist_steps`), with the tail factor, reach and count of baseline
        doublings in force (once the noise has doubled the mean, the ratio rule needs the loss
        past the noise's reach too); and the z threshold. Arrays for `_measure`'s chunk, bools
        for `_measure_one`'s step."""
        cfg = self.config
        threshold = max(cfg.z_threshold, reach)
        big = m.jump > cfg.min_rel_jump * abs(m.level)
        z_rule = (m.z > threshold) & big
        ratio_rule = (
            (m.base_mean > 0)
            & (m.losses > cfg.ratio_threshold * m.base_mean)
            & (m.z > (max(cfg.ratio_min_z, reach) if doublings else cfg.ratio_min_z))
        )
        elevated = (m.z > cfg.persist_z * tail) & big
        return z_rule, ratio_rule, elevated, threshold

    @property
    def _long_window(self) -> int:
        """Latest baseline losses whose median, moved on by the drift, is the long level."""
        return min(LEVEL_SPAN * self.config.level_window, self.config.window)

    @property
    def _long_shift(self) -> float:
        """Steps the long level lags the short one by: the drift moves it on by that many."""
        return (self._long_window - self.config.level_window) / 2

    @property
    def _lag(self) -> float:
        """Steps the level (a median of the latest `level_window` losses) lags the loss by."""
        return (self.config.level_window + 1) / 2

    def _tail_of(
        self, hist: np.ndarray, total: float, low: np.ndarray, excursions: np.ndarray
    ) -> tuple[float, float]:
        """The persistence widening and the noise's reach (see the class comment) from the |z|
        histogram, or early from the signed one; the quantiles move in from `tail_quantile`
        while few values are counted. From TAIL_MIN_SAMPLES on, the reach is at least what the
        run's own undone excursions reach at the body's power (`_excursion_reach`)."""
        budget = 2.0 / self.config.noise_reach_steps  # |z| counts both tails
        if total < TAIL_MIN_SAMPLES:
            return 1.0, min(self._lower_reach(low, budget), MAX_REACH)
        upper = max(1.0 - self.config.tail_quantile, TAIL_BEYOND / total)
        q_hi = _quantile(hist, total, upper)
        q_lo = _quantile(hist, total, min(TAIL_SPAN * upper, 0.5))
        gauss = NormalDist().inv_cdf(1.0 - upper / 2)
        tail = min(max(1.0, q_hi / gauss), MAX_TAIL)
        if q_lo <= 0 or q_hi <= q_lo:
            return tail, min(q_hi, MAX_REACH)
        power = min(math.log(q_hi / q_lo) / math.log(TAIL_SPAN), MAX_TAIL_POWER)
        reach = max(
            q_hi * (upper / budget) ** power, _excursion_reach(excursions, total, budget, power)
        )
        return tail, min(reach, MAX_REACH)

    def _lower_reach(self, low: np.ndarray, budget: float) -> float:
        """The reach of a Student-t fitted to the lower tail of the first steps' noise (under
        its median, where no spike or bump lands), mirrored above."""
        half = float(low.sum()) / 2
        if half <= 0:
            return 0.0
        upper = max(1.0 - self.config.tail_quantile, TAIL_BEYOND / half)
        lower = min(TAIL_SPAN * upper, 0.5)
        centre = _signed_quantile(low, 0.5)
        q_hi = centre - _signed_quantile(low, upper / 2)
        q_lo = centre - _signed_quantile(low, lower / 2)
        if q_lo <= 0 or q_hi <= q_lo:
            return q_hi
        return student_t_reach(q_hi, upper, q_lo, lower, budget)

    def _release_pending(self) -> None:
        """The elevated steps held back were noise: they join the baseline in order, and, in a
        run whose noise doubles its mean, their highest z joins the run's undone excursions."""
        if self.pending and self.doublings:
            top = max(float(p[3]) for p in self.pending)
            if math.isfinite(top):
                self.excursion_hist[int(min(top / Z_BIN, Z_BINS - 1))] += 1.0
        for _, value, grad, z_value, below in self.pending:
            self._accept(value, grad, z_value, below)
        self.pending.clear()

    def _accept(
        self, loss: float, grad_norm: float | None, z: float | None, below: float | None = None
    ) -> None:
        """Add a non-spike step to the baseline and to the long-run noise and tail estimates."""
        if self.last is not None and self.noise_var is not None:
            self.noise_var = warm_ema_one(
                self._diffs(loss, self.last, self.drift),
                self.noise_var,
                self.noise_count,
                self.config.noise_horizon,
            )
            self.noise_count += 1
        self.last = loss
        self.window.append(loss)
        if grad_norm is not None and math.isfinite(grad_norm):
            self.grads.append(grad_norm)
        if z is not None and math.isfinite(z):
            if below is not None and self.z_total < TAIL_MIN_SAMPLES:
                self.low_hist[_low_bin_one(below)] += 1.0
            self._count_z(abs(z))

    def _count_z(self, z: float) -> None:
        self.z_hist[int(min(z / Z_BIN, Z_BINS - 1))] += 1.0  # z / Z_BIN may overflow to inf
        self.z_total += 1.0
        if self.z_total >= 20 * self.config.noise_horizon:  # forget slowly: halve old counts
            self.z_hist = [c / 2 for c in self.z_hist]
            self.excursion_hist = [c / 2 for c in self.excursion_hist]
            self.z_total /= 2
        if self.z_total >= TAIL_FIT_SAMPLES and int(self.z_total) % 100 == 0:
            self.tail, self.reach = self._tail_of(
                np.asarray(self.z_hist),
                self.z_total,
                np.asarray(self.low_hist),
                np.asarray(self.excursion_hist),
            )

    def _classify(
        self,
        point: MetricPoint,
        held: int = 1,
        grad_rose: bool | None = None,
        jump: float = 0.0,
    ) -> tuple[SpikeType, float, str]:
        """First guess of the cause from what came before the spike and how long it has held;
        never a gradient explosion when the grad norm is known (`grad_rose` not None) and flat;
        an optimizer spike only where the swing before it is within `SWING_EXPLAINS` of its
        `jump` over the level."""
        recent = list(self.window)
        pre = recent[-TREND_SPAN:]
        trend = mann_kendall_z(pre)
        if trend > TREND_Z and mann_kendall_z(pre[: len(pre) // 2]) > TREND_Z / 2:
            return (
                "architecture",
                0.6,
                f"the loss was rising steadily before it (trend z={trend:.1f})",
            )
        # swings that grew late show over the latest steps alone
        swing = self._swing(recent) or self._swing(recent[-SHORT_SWING:])
        if swing is not None and jump <= SWING_EXPLAINS * swing[2]:
            period, acf, _ = swing
            return (
                "optimizer",
                0.6,
                f"the loss was swinging with period {period} steps (autocorrelation {acf:.2f})",
            )
        build_up = pre[-BUILD_UP:]
        flat = grad_rose is False
        if len(build_up) == BUILD_UP and mann_kendall_z(build_up) > TREND_Z and not flat:
            why = f"the loss was building up over the last {BUILD_UP} steps"
            return "gradient_explosion", 0.55, why
        grads = list(self.grads)
        if len(grads) >= 8 and point.grad_norm is not None:
            base = mean(grads[:-3])
            last = grads[-3:]
            rising = all(b > a for a, b in itertools.pairwise(last)) and point.grad_norm > last[-1]
            if base > 0 and rising and last[-1] > GRAD_HIGH * base:
                return "gradient_explosion", 0.6, "the gradient norm was growing into the spike"
        if held > 1 and flat and rose_before(recent):
            why = (
                f"the loss has stayed high for {held} steps after rising before it while the "
                "gradient norm stayed flat"
            )
            return "architecture", 0.5, why
        if held > 1 and flat:  # new batches keep it up, the weights' gradients do not move
            why = (
                f"the loss has stayed high for {held} steps on new batches with no rise before "
                "it while the gradient norm stayed flat, as a stretch of bad data gives"
            )
            return "data_toxicity", 0.5, why
        if held > 1:
            return "gradient_explosion", 0.6, f"the loss has stayed high for {held} steps"
        return "data_toxicity", 0.5, "a sudden jump with no build-up, as one bad batch gives"

    @staticmethod
    def _flat_type(w: dict[str, Any]) -> tuple[SpikeType, float]:
        """A jump that stayed up while the grad norm stayed flat: architecture after a rise
        before it, else a stretch of bad data."""
        return ("architecture", 0.6) if w.get("rose_before") else ("data_toxicity", 0.6)

    @staticmethod
    def _swing(recent: list[float]) -> tuple[int, float, float] | None:
        """The period, autocorrelation and height of a periodic swing in the baseline, if any."""
        residuals = detrended(recent[-96:]) if len(recent) >= 32 else None
        # swings far below the level are rounding, not an oscillation
        if residuals is None or residuals.std() <= 1e-6 * abs(mean(recent)):
            return None
        period, acf = dominant_period(residuals, 4)
        return (period, acf, float(residuals.max())) if period and acf >= PERIOD_ACF else None

    def _follow(self, point: MetricPoint) -> Event | None:
        w = self.watch
        assert w is not None
        w["seen"] += 1
        if point.loss <= w["level"] + 0.25 * (w["peak"] - w["level"]):
            w["back_steps"] += 1
            if w["back_at"] is None:
                w["back_at"] = w["seen"]
        gross = point.loss > self.config.ratio_threshold * w["level"]
        if gross:
            w["gross_steps"] = w.get("gross_steps", 0) + 1
        if gross and point.loss - w["level"] > w.get("far_over", math.inf):
            w["far_steps"] = w.get("far_steps", 0) + 1
        g, gm = point.grad_norm, w["grad_mean"]
        if g is not None and gm and g > GRAD_HIGH * gm:
            w["high_grad_steps"] += 1
        if w["seen"] >= self.config.classify_window or self._confirmed_early(w):
            return self._finish(point)
        return None

    def _confirmed_early(self, w: dict[str, Any]) -> bool:
        """A spike typed data toxicity whose next `confirm_steps` losses all stayed far over its
        level: other batches, so the weights, not one bad batch."""
        steps = self.confirm_steps
        return bool(
            steps
            and w["type"] == "data_toxicity"
            and w["seen"] == steps
            and w.get("far_steps", 0) == steps
        )

    def _finish(self, point: MetricPoint) -> Event:
        """The revised type of the spike under watch, from how the loss behaved after it."""
        w = self.watch
        assert w is not None
        self.watch = None
        seen, back_at, back = w["seen"], w["back_at"], w["back_steps"]
        old: SpikeType = w["type"]
        new: SpikeType = old
        confidence = float(w["confidence"])
        # the grad norm known and flat through the spike and its follow-up: not an explosion
        flat = w.get("grad_rose") is False and w["high_grad_steps"] == 0
        lasting = False  # a lasting rise typed data: the policy rolls back as for a lasting one
        if back_at is not None and back_at <= 2 and back >= seen - 1 and w["high_grad_steps"] <= 1:
            new, confidence = "data_toxicity", 0.9
            why = f"the loss was back at its level {back_at} step(s) later"
        elif seen > 1 and w.get("gross_steps", 0) >= seen - 1 and old == "data_toxicity":
            new, confidence = self._flat_type(w) if flat else ("gradient_explosion", 0.8)
            lasting = flat and new == "data_toxicity"
            said = (FLAT_DATA if lasting else FLAT_ROSE) if flat else ""
            why = (
                f"the loss stayed over {self.config.ratio_threshold:g}x its level for "
                f"{w['gross_steps']} steps{said}"
            )
        elif seen > 0 and back == 0:
            if old in ("architecture", "optimizer"):
                confidence = max(confidence, 0.75)
                why = f"the loss stayed high for {seen} steps after a build-up"
            elif flat:
                new, confidence = self._flat_type(w)
                lasting = new == "data_toxicity"
                why = f"the loss stayed high for {seen} steps{FLAT_DATA if lasting else FLAT_ROSE}"
            else:
                new, confidence = "gradient_explosion", 0.85
                why = f"the loss stayed high for {seen} steps"
                if w["high_grad_steps"]:
                    why += f" with the gradient norm elevated on {w['high_grad_steps']}"
        else:
            confidence = 0.6
            why = f"the loss came back partly ({back} of {seen} steps near its level)"
        verb = "confirmed" if new == old else f"revised from {old.replace('_', ' ')}"
        return self.event(
            point,
            "info",
            f"loss spike at step {w['step']} {verb} as {new.replace('_', ' ')}: {why}",
            {
                "spike_step": w["step"],
                "previous_type": old,
                "recovered_after": back_at,
                "steps_watched": seen,
                "high_grad_steps": w["high_grad_steps"],
                **({"lasting": True} if lasting else {}),
            },
            kind="spike_classified",
            type=new,
            confidence=confidence,
        )


def _over_noise(deviation: Values, sigma: Values) -> Values:
    """Deviations in noise deviations; with no noise, infinite above and 0 otherwise (arrays, or
    floats)."""
    if not isinstance(sigma, np.ndarray):
        if sigma > 0:  # the common case, in floats
            return deviation / sigma
        return float(_over_noise(np.array([deviation]), np.array([sigma]))[0])
    positive = sigma > 0
    if positive.all():  # a noise everywhere: the plain quotient
        quotient: np.ndarray = deviation / sigma
        return quotient
    with np.errstate(divide="ignore", invalid="ignore"):
        out: np.ndarray = np.where(
            positive, deviation / sigma, np.where(deviation > 0, np.inf, 0.0)
        )
    return out


def _bounded_spread(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's spread about a fitted quadratic, at most SPREAD_NEAR x that of its latest
    SPREAD_SPAN values (the curvature of a fast early descent is not noise), and theirs."""
    whole = spread_sigmas(rows)
    near = spread_sigmas(rows[:, -SPREAD_SPAN:])
    out: np.ndarray = np.where(near > 0, np.minimum(whole, SPREAD_NEAR * near), whole)
    return out, near


def _excursion_reach(excursions: np.ndarray, total: float, budget: float, power: float) -> float:
    """What a run's undone excursions (a |z| histogram) say its noise reaches once in
    `1 / budget` values: each one's z (its bin's lower edge), carried out from the share of the
    `total` values at or beyond it to the budget at the body's tail `power`; 0 with none."""
    filled = np.flatnonzero(excursions > 0)
    if not len(filled) or total <= 0:
        return 0.0
    from_top = np.cumsum(excursions[::-1])[::-1]  # the excursions at or beyond each bin
    shares = from_top[filled] / total
    return float(np.max(filled * Z_BIN * (shares / budget) ** power))


def _low_bin(values: np.ndarray) -> np.ndarray:
    """The bins of signed values in the histogram of `low_hist` (Z_BIN wide, -25 to 25), for
    one step or many: the per-step and bulk paths bin alike."""
    with np.errstate(over="ignore"):  # a value near the float limit bins at the end
        bins: np.ndarray = np.clip(np.floor(values / Z_BIN) + Z_BINS, 0, LOW_BINS - 1)
    return bins.astype(np.int64)


def _low_bin_one(value: float) -> int:
    """`_low_bin` of one value, in plain floats where it lies well inside float range."""
    if -1e6 < value < 1e6:
        return min(max(math.floor(value / Z_BIN) + Z_BINS, 0), LOW_BINS - 1)
    return int(_low_bin(np.asarray(value)))


def _signed_quantile(hist: np.ndarray, share: float) -> float:
    """The signed value with a `share` of the histogram's counts below it."""
    cum = np.cumsum(hist)
    target = share * cum[-1]
    b = int(np.searchsorted(cum, target, side="left"))
    below = float(cum[b - 1]) if b > 0 else 0.0
    inside = (target - below) / float(hist[b]) if hist[b] > 0 else 0.0
    return float((b - Z_BINS + inside) * Z_BIN)


def _quantile(hist: np.ndarray, total: float, beyond: float) -> float:
    """The |z| with a share `beyond` of the histogram's counts above it, interpolated in its bin
    (the open top bin reads as its lower edge)."""
    target = beyond * total
    from_top = np.cumsum(hist[::-1])
    k = int(np.searchsorted(from_top, target, side="right"))  # bins from the top fully beyond
    if k >= Z_BINS:
        return 0.0
    b = Z_BINS - 1 - k  # the bin the quantile falls in
    if b == Z_BINS - 1:
        return b * Z_BIN
    above = float(from_top[k - 1]) if k > 0 else 0.0
    share = (target - above) / float(hist[b]) if hist[b] > 0 else 0.0
    return float((b + 1 - share) * Z_BIN)


def rose_before(recent: list[float]) -> bool:
    """Whether the loss rose steadily before the latest `BUILD_UP` steps (over the
    `TREND_SPAN` before the spike): an instability brewing for long, not a stretch of bad data
    that starts at once."""
    return mann_kendall_z(recent[-TREND_SPAN:-BUILD_UP]) > TREND_Z
