"""Precursor warnings scaled to the model (issue 37): log Z judged against ln(vocabulary), an
attention collapse weighed by its effect on the loss and grad norm, preemptive actions only on
warnings that foretell divergence, max-logit clipping summarised; `grad_explosion` that needs a
real rise where grad norms are tiny."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import trainguard as tg
from trainguard.config import PreemptConfig
from trainguard.detectors.base import MetricPoint
from trainguard.detectors.gradients import GradExplosionDetector
from trainguard.detectors.precursors import PrecursorWarningDetector
from trainguard.detectors.series import MetricSeries
from trainguard.detectors.suite import DetectorSuite
from trainguard.events import Event
from trainguard.policy import StepPolicy


def _explosions(grads: np.ndarray) -> list[int]:
    """The steps `grad_explosion` fires on, live and in bulk (they must agree)."""
    detector = GradExplosionDetector()
    live = [
        e.step
        for i, g in enumerate(grads)
        for e in detector.update(MetricPoint(step=i, loss=1.0, grad_norm=float(g)))
        if e.kind == "grad_explosion"  # not its grading by the loss's response
    ]
    n = len(grads)
    series = MetricSeries(np.arange(n), np.ones(n), grads.astype(np.float64), None)
    config = tg.GuardConfig.from_dict({})
    suite = DetectorSuite(config)
    bulk = [e.step for e in suite.run(series) if e.kind == "grad_explosion"]
    assert bulk == live
    return live


def test_tiny_noisy_grad_norms_are_no_explosion() -> None:
    # an overfitting fine-tune: grad norms near 0.001 whose heavy tail swings them tenfold and
    # more step to step (growth from a dip by 10x over 5 rises: 4 times here before issue 37)
    rng = np.random.default_rng(7)
    grads = 0.001 * (np.abs(rng.standard_cauchy(6000)) + 0.1)
    assert _explosions(grads) == []


def test_a_real_rise_from_tiny_grad_norms_is_an_explosion() -> None:
    rng = np.random.default_rng(0)
    grads = 0.001 * np.exp(0.9 * rng.standard_normal(3000))
    grads[2000:2006] = 0.001 * np.geomspace(1.0, 3000.0, 6)  # 0.001 -> 3 in 5 steps
    grads[2006:] = 3.0
    assert _explosions(grads) == [2005]


def test_steady_norms_that_grow_tenfold_still_explode() -> None:
    rng = np.random.default_rng(1)
    grads = 1.0 + 0.02 * rng.standard_normal(500)
    grads[300:306] = np.geomspace(1.0, 12.0, 6)
    grads[306:] = 12.0
    assert _explosions(grads) == [305]


EVERY = 5  # steps between sampled steps


def _stream(
    values: list[float],
    signal: str,
    losses: list[float] | None = None,
    vocab: int | None = 256,
    layer: str = "output",
) -> list[Event]:
    """The precursor events a fresh detector gives over one sample every `EVERY` steps (the
    loss at each sample from `losses`, else a gently falling one; grad norm 1)."""
    detector = PrecursorWarningDetector()
    events: list[Event] = []
    for i, value in enumerate(values):
        precursors = {signal: {layer: value}}
        if vocab is not None:
            precursors["vocab_size"] = {"output": float(vocab)}
        loss = losses[i] if losses is not None else 3.0 - 0.002 * i
        point = MetricPoint(step=i * EVERY, loss=loss, grad_norm=1.0, precursors=precursors)
        events += detector.update(point)
    return events


def _learning_log_z(n: int = 200) -> list[float]:
    """A 256-token model's log Z as it learns: ln 256 at the start, rising to 11.5 (the logits
    sharpen), with sampling noise."""
    rng = np.random.default_rng(3)
    t = np.arange(n) * EVERY
    return list(math.log(256) + 6.0 * (1 - np.exp(-t / 150)) + 0.05 * rng.standard_normal(n))


def test_a_small_vocabulary_model_whose_log_z_rises_as_it_learns_is_not_warned() -> None:
    values = _learning_log_z()
    assert _stream(values, "log_z") == []
    assert _stream(values, "log_z", vocab=None) == []  # an older probe: its first sample


def test_log_z_drifting_far_from_ln_vocabulary_is_warned_with_its_reference() -> None:
    rng = np.random.default_rng(4)
    values = [math.log(256) + 0.12 * i + 0.05 * rng.standard_normal() for i in range(200)]
    events = _stream(values, "log_z")
    assert events and events[0].severity == "warning"
    first = events[0]
    assert first.metrics["ln_vocabulary"] == pytest.approx(math.log(256))
    assert first.metrics["critical"] == pytest.approx(math.log(256) + 30.0)
    assert "ln(vocabulary) 5.545 + 30" in first.message
    # the same drift from a 50k vocabulary's ln 10.8 starts 5.3 nats higher: warned no later
    big = [v - math.log(256) + math.log(50257) for v in values]
    assert _stream(big, "log_z", vocab=50257)[0].step == first.step


def _collapse(n: int = 120) -> list[float]:
    """A layer's max attention logit growing past its critical level (100) to about 300."""
    return [10.0 * 1.03**i if 10.0 * 1.03**i < 300 else 300.0 for i in range(n)]


def test_an_attention_collapse_the_loss_learns_through_is_info() -> None:
    events = _stream(_collapse(), "max_logit", layer="1")
    assert events and {e.severity for e in events} == {"info"}
    assert "noted, no action" in events[0].message


def test_the_same_collapse_with_the_loss_climbing_is_a_warning() -> None:
    n = 120
    values = _collapse(n)
    # the loss falls, then climbs 20% from sample 80 on while the logit stays past critical
    losses = [
        3.0 - 0.005 * i if i < 80 else 2.6 * (1 + 0.2 * min(1.0, (i - 80) / 10)) for i in range(n)
    ]
    events = _stream(values, "max_logit", losses=losses, layer="1")
    severities = [e.severity for e in events]
    assert "info" in severities and "warning" in severities
    warned = next(e for e in events if e.severity == "warning")
    assert warned.step > 80 * EVERY and warned.metrics["loss_over_lowest"] > 0.1


def test_a_collapse_far_past_critical_is_a_warning_before_the_loss_moves() -> None:
    values = [10.0 * 1.1**i for i in range(80)]  # to 10x critical and on
    events = _stream(values, "max_logit", layer="1")
    warned = [e for e in events if e.severity == "warning"]
    assert warned and warned[0].metrics["value"] >= 1000.0


def _past_then(after: list[float], rescaled_at: int | None = None) -> list[tuple[int, str]]:
    """(step, severity) of the precursor events on a layer-1 max logit that rises 25% a sample
    from 10 to past 1000 (warned), holds there, then takes the values `after`; the guard's own
    rescale, where given, lands just before sample `rescaled_at` of `after`."""
    rise = [10.0 * 1.25**i for i in range(22)] + [1500.0, 1700.0]
    detector = PrecursorWarningDetector()
    events: list[Event] = []
    for i, value in enumerate(rise + after):
        step = i * EVERY
        if rescaled_at is not None and i == len(rise) + rescaled_at:
            events += detector.update(
                MetricPoint(step=step - 1, loss=3.0, grad_norm=1.0, weights_rewritten=True)
            )
        precursors = {"max_logit": {"1": value}}
        point = MetricPoint(step=step, loss=3.0 - 0.002 * i, grad_norm=1.0, precursors=precursors)
        events += detector.update(point)
    return [(e.step, e.severity) for e in events]


def test_a_one_sample_dip_of_a_collapsed_layer_does_not_warn_once_more() -> None:
    """A collapsed layer's sampled max logit dipping under critical / margin for one sample
    between values of 1000s: the collapse goes on, so no second 'past critical' warning."""
    held = _past_then([1800.0] * 3)
    assert [s for s in held if s[1] == "warning"] == [(21 * EVERY, "warning")]
    assert _past_then([-50.0] + [1800.0] * 3) == held


def test_a_lasting_drop_or_the_guards_rescale_rearms_the_warning() -> None:
    """Under critical / margin for `confirm` (3) samples in a row, or for one sample just after
    the guard's own QK rescale: past critical again is warned of once more."""
    first = (21 * EVERY, "warning")
    lasting = _past_then([-50.0, -40.0, -60.0] + [1800.0] * 3)
    assert lasting == [(13 * EVERY, "info"), first, (27 * EVERY, "warning")]
    assert _past_then([-50.0, -40.0] + [1800.0] * 3)[-1] == first  # two samples: a dip
    rescaled = _past_then([12.0] + [1800.0] * 3, rescaled_at=0)
    assert rescaled == [(13 * EVERY, "info"), first, (25 * EVERY, "warning")]
    # the rescale's flag, kept over the steps without a sample, is spent on the next sample
    assert _past_then([1600.0, 12.0] + [1800.0] * 3, rescaled_at=0)[-1] == first


def test_a_layer_that_stays_past_critical_is_one_episode() -> None:
    """A collapsed layer's max logit held in the 1000s for over a `window` of samples that fail
    the trend rules (no trend in the noise), then growing again: one episode, one warning (an
    episode ends only once the signal has left the critical region)."""
    rng = np.random.default_rng(3)
    hold = [1800.0 * (1 + 0.3 * float(x)) for x in rng.uniform(-1, 1, 16)]
    regrow = [1800.0 * 1.15**i for i in range(1, 13)]
    assert _past_then(hold + regrow) == [(13 * EVERY, "info"), (21 * EVERY, "warning")]


def test_a_layer_that_leaves_for_a_window_and_comes_back_opens_a_new_episode() -> None:
    """Under critical / margin for `window` (12) samples in a row, then rising towards critical
    again: a new episode, noted anew; a shorter absence is the same episode."""
    back = [30.0 * 1.06**i for i in range(20)]  # rising within the margin, never past critical
    kept = [(13 * EVERY, "info"), (21 * EVERY, "warning")]
    assert _past_then([5.0] * 11 + back) == kept
    left = _past_then([5.0] * 12 + back)
    assert left[:2] == kept and left[2:] == [((24 + 12 + 6) * EVERY, "info")]


def test_preemptive_actions_only_on_warnings_of_the_signals_of_divergence() -> None:
    policy = StepPolicy(preempt=PreemptConfig(actions=["lr_cut", "qk_rescale"]))
    point = MetricPoint(500, 2.0, precursors={"max_logit": {"0": 300.0}})
    info = Event(
        step=500,
        kind="precursor",
        severity="info",
        message="",
        metrics={"layer": "0", "signal": "max_logit", "value": 300.0},
    )
    assert policy.decide(point, [info]).preempt == []
    eps = replace(info, severity="warning", metrics={"layer": "g", "signal": "adam_eps_ratio"})
    assert policy.decide(point, [eps]).preempt == []  # a cut would damp eps-bound updates more
    warned = replace(info, severity="warning")
    assert [c.action for c in policy.decide(point, [warned]).preempt] == ["lr_cut", "qk_rescale"]
