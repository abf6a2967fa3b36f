"""`EvalDeclineDetector`: an evaluation worsening over its recent best while the training loss
still falls: late forgetting (too high an LR, or a skewed annealing data mix)."""

from __future__ import annotations

import math
from collections import deque
from typing import ClassVar

import numpy as np

from trainguard.config import EvalDeclineConfig
from trainguard.detectors.base import Detector, EvalPoint, MetricPoint, fmt
from trainguard.detectors.series import MetricSeries, spread_sigmas
from trainguard.detectors.stats import MAD_TO_SIGMA, median
from trainguard.events import Event, EventKind

ADVICE = (
    "in pre-training run a cooldown on high-quality data, lower the LR, or check the annealing "
    "data mix (too much of one source); in a fine-tune stop early or keep the best checkpoint"
)
RECOVERED = 0.5  # an episode ends once the decline is under this share of the rule's bar
# the values after an evaluation's descent into its best: at least this many are kept, and the
# noise of fewer than FEW_SETTLED (too few for the spread about a quadratic) asks for FEW_REL
MIN_SETTLED = 4
FEW_SETTLED = 8
FEW_REL = 0.03


class EvalDeclineDetector(Detector):
    """Raises `eval_decline` (warning) when both of an evaluation's last 2 values are worse than
    the best mean of 2 consecutive values before them over its last `window` by more than
    `noise_sigmas` times its own noise (robust, from successive differences) and by at least
    `min_rel_decline` of the best, while the training loss still falls (its median over the
    training steps before the last two evaluations is lower than before the best two, and than
    before the two evaluations before the last two); once per episode and evaluation name. The
    noise is the larger of two robust estimates: from the second differences of the window
    (blind to trend and bends) and from the spread about a quadratic of the values before the
    last two (which does not shrink when nearby evaluations err together). The noise is also
    taken over the values after the evaluation's descent into its best (the leading values each
    worse than all after them up to the best: an untrained model's first evaluation, a fall that
    outpaces the noise), where a log of 10-20 evaluations has nothing else; from fewer than 8
    such values a decline must also reach 3% of the best. A decline over either bar counts. A
    non-finite evaluation is its own warning.

    A declining evaluation while the training loss rises too is not forgetting: the run is
    diverging, which `divergence` and `loss_spike` report from the training loss; this detector
    stays quiet then."""

    name: ClassVar[str] = str(EventKind.EVAL_DECLINE)
    _state: ClassVar[tuple[str, ...]] = ("history", "losses", "level", "declining", "nonfinite")

    def __init__(self, config: EvalDeclineConfig | None = None) -> None:
        self.config = config or EvalDeclineConfig()
        # per evaluation name, its latest `window` rows: [step, value, train loss level]
        self.history: dict[str, list[list[float]]] = {}
        # the finite training losses since the last evaluation, and their median then
        self.losses: deque[float] = deque(maxlen=self.config.train_window)
        self.level: float | None = None
        self.declining: list[str] = []  # names in a decline episode (warned once)
        self.nonfinite: list[str] = []  # names whose last evaluation was NaN or Inf

    def update(self, point: MetricPoint) -> list[Event]:
        if math.isfinite(point.loss):
            self.losses.append(point.loss)
        return []

    def advance(self, series: MetricSeries, start: int) -> int:
        """Training steps never raise: each chunk's latest finite losses are kept at once."""
        _, losses = series.finite_losses(start)
        self.losses.extend(losses[-self.config.train_window :].tolist())
        return series.chunk_end(start)

    def _train_level(self) -> float:
        """The training loss level at this evaluation: the median of the training losses since
        the one before (the last level where none came between)."""
        if self.losses:
            self.level = median(list(self.losses))
            self.losses.clear()
        return math.nan if self.level is None else self.level

    def evaluate(self, point: EvalPoint) -> list[Event]:
        name = point.name
        level = self._train_level()
        if not math.isfinite(point.value):
            if name in self.nonfinite:
                return []
            self.nonfinite.append(name)
            message = (
                f"evaluation {name} is {point.value} at step {point.step}: the model's outputs "
                "on the evaluation data are not finite (a diverged model, or an evaluation that "
                "divides by zero); check the model at this step before training on"
            )
            return [self._event(point, message, {"name": name, "value": point.value})]
        if name in self.nonfinite:
            self.nonfinite.remove(name)
        rows = self.history.setdefault(name, [])
        while rows and rows[-1][0] >= point.step:  # a timeline replayed after a rollback
            rows.pop()
        rows.append([point.step, point.value, level])
        del rows[: -self.config.window]
        return self._judge(point, rows)

    def _judge(self, point: EvalPoint, rows: list[list[float]]) -> list[Event]:
        cfg = self.config
        n = len(rows)
        if n < cfg.min_evals:
            return []
        sign = -1.0 if point.higher_is_better else 1.0  # a larger score is worse
        scores = [sign * r[1] for r in rows]
        pairs = [(scores[j] + scores[j + 1]) / 2 for j in range(n - 1)]
        # the better of the last two: one bad evaluation (a bad batch of it) is no decline
        current, earlier = min(scores[-2:]), pairs[:-2]  # the pairs apart from the last two
        b = min(range(len(earlier)), key=earlier.__getitem__)
        best = earlier[b]
        # the noise of the whole window, and of its values after the descent into the best (an
        # untrained model's first evaluation, a fall that outpaces the noise), whose few values
        # ask for a clear decline: a decline over either bar counts
        gap = current - best
        bars = [(noise_of(scores), cfg.min_rel_decline)]
        start = descent_end(scores, b + 1)
        if start > 0:
            few = n - start < FEW_SETTLED
            least = max(cfg.min_rel_decline, FEW_REL) if few else cfg.min_rel_decline
            bars.append((noise_of(scores[start:]), least))
        noise, least = min(bars, key=lambda nl: max(cfg.noise_sigmas * nl[0], nl[1] * abs(best)))
        bar = max(cfg.noise_sigmas * noise, least * abs(best))
        name = point.name
        if name in self.declining:
            if gap <= RECOVERED * bar:
                self.declining.remove(name)
            return []
        train_best = (rows[b][2] + rows[b + 1][2]) / 2
        train_before = (rows[-4][2] + rows[-3][2]) / 2  # the two evaluations before the last two
        train_now = (rows[-2][2] + rows[-1][2]) / 2
        declined = gap > cfg.noise_sigmas * noise and gap >= least * abs(best) and gap > 0
        falls = train_now < train_best and train_now <= train_before  # NaN levels: no loss
        if not declined or not falls:
            return []
        self.declining.append(name)
        value_best, value_now = sign * best, sign * current
        relative = gap / abs(best) if best else math.inf
        message = (
            f"{name} has declined to {fmt(value_now)} (the better of its last 2) from its "
            f"best {fmt(value_best)} at steps {int(rows[b][0])}-{int(rows[b + 1][0])} "
            f"({100 * relative:.1f}% worse, {gap / noise if noise else math.inf:.1f}x its noise) "
            f"while the training loss still falls ({fmt(train_best)} -> {fmt(train_now)}): "
            f"the model is forgetting or overfitting; {ADVICE}"
        )
        metrics = {
            "name": name,
            "value": point.value,
            "current": value_now,
            "best": value_best,
            "best_step": int(rows[b + 1][0]),
            "decline": relative,
            "noise": noise,
            "train_loss_best": train_best,
            "train_loss_now": train_now,
            "higher_is_better": point.higher_is_better,
        }
        return [self._event(point, message, metrics)]

    def _event(self, point: EvalPoint, message: str, metrics: dict[str, object]) -> Event:
        return Event(
            step=point.step,
            kind=EventKind.EVAL_DECLINE,
            severity="warning",
            message=message,
            metrics=dict(metrics),
        )


def curve_noise(values: list[float]) -> float:
    """The noise of one value of a curve, robust to its trend and its bends: from its second
    differences (each holds 6 values' worth of noise variance and nothing of a straight trend),
    less their median, winsorised at 6 MADs, as an RMS; so the steep start of a run or a jump
    into a decline does not pass for noise, while the noise's heavy tails count."""
    second = [c - 2 * b + a for a, b, c in zip(values, values[1:], values[2:], strict=False)]
    if len(second) < 2:
        return 0.0
    centre = median(second)
    limit = 6.0 * MAD_TO_SIGMA * median([abs(d - centre) for d in second])
    clipped = [min(max(d - centre, -limit), limit) for d in second]
    return math.sqrt(sum(d * d for d in clipped) / len(clipped) / 6.0)


def noise_of(scores: list[float]) -> float:
    """The noise of an evaluation's values: the larger of its second differences' and its spread
    about a quadratic before the last two."""
    return max(curve_noise(scores), float(spread_sigmas(np.array([scores[:-2]]))[0]))


def descent_end(scores: list[float], best_end: int) -> int:
    """Where the evaluation's descent into its best ends: the leading values each worse than
    every value after it up to `best_end` (the learning the evaluation saw, whose fall outpaces
    its noise) are passed over, keeping `MIN_SETTLED` values at least."""
    i = 0
    while (
        i < best_end
        and len(scores) - i > MIN_SETTLED
        and scores[i] > max(scores[i + 1 : best_end + 1])
    ):
        i += 1
    return i
