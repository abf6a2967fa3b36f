"""A gradient incident graded by the loss's response (`grad_response`: a benign outlier is info
in a log, a warning where the loss follows it), and a run whose global gradient norm is zero
while its loss does not fall (`vanishing_gradients`, critical): planted streams and real logs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainguard.analysis import analyze, read_log
from trainguard.analysis.analyzer import graded_by_response
from trainguard.detectors import DetectorSuite
from trainguard.detectors.base import MetricPoint
from trainguard.detectors.gradients import GradSpikeDetector, VanishingGradientDetector
from trainguard.detectors.series import MetricSeries

LOGS = Path(__file__).resolve().parents[1] / "data" / "logs"


def _stream(respond: bool, seed: int = 0, n: int = 600) -> MetricSeries:
    """A noisy flat loss with a 30x grad-norm outlier at step 400; the loss jumps 3x and stays
    up for 20 steps after it where `respond`."""
    rng = np.random.default_rng(seed)
    loss = 3.0 + 0.02 * rng.standard_normal(n)
    grad = 1.0 + 0.05 * rng.standard_normal(n)
    grad[400] = 30.0
    if respond:
        loss[401:421] *= 3.0
    return MetricSeries(steps=np.arange(n), loss=loss, grad_norm=grad)


def _live(series: MetricSeries) -> list:
    suite = DetectorSuite()
    return [e for i in range(len(series)) for e in suite.update(series.point(i))]


def _key(events: list) -> list:
    return [(e.step, e.kind, e.severity, e.message) for e in events]


def test_a_grad_outlier_the_loss_does_not_follow_is_graded_benign_live_and_info_in_a_log():
    series = _stream(respond=False)
    live = _live(series)
    spikes = [e for e in live if e.kind == "grad_spike"]
    assert [(e.step, e.severity) for e in spikes] == [(400, "warning")]  # the guard still skips
    (graded,) = [e for e in live if e.kind == "grad_response"]
    assert graded.step == 405 and graded.severity == "info"
    assert graded.metrics["spike_step"] == 400 and graded.metrics["loss_responded"] is False
    assert _key(DetectorSuite().run(series)) == _key(live)  # bulk and step by step agree
    (shown,) = [e for e in graded_by_response(live) if e.kind.startswith("grad_")]
    assert shown.step == 400 and shown.severity == "info" and "benign outlier" in shown.message


def test_a_grad_outlier_the_loss_follows_stays_a_warning():
    series = _stream(respond=True)
    live = _live(series)
    (graded,) = [e for e in live if e.kind == "grad_response"]
    assert graded.metrics["loss_responded"] is True and "confirmed" in graded.message
    assert _key(DetectorSuite().run(series)) == _key(live)
    kept = [e for e in graded_by_response(live) if e.kind == "grad_spike"]
    assert [(e.step, e.severity) for e in kept] == [(400, "warning")]


def test_a_grad_norm_that_stays_high_is_not_graded_benign():
    series = _stream(respond=False)
    assert series.grad_norm is not None
    series.grad_norm[400:] = 30.0  # it never comes back
    live = _live(series)
    graded = [e for e in live if e.kind == "grad_response"]
    assert graded and all(e.metrics["loss_responded"] is True for e in graded)
    assert _key(DetectorSuite().run(series)) == _key(live)


def test_the_grading_survives_a_state_round_trip():
    series = _stream(respond=False)
    det = GradSpikeDetector()
    for i in range(402):
        det.update(series.point(i))
    restored = GradSpikeDetector()
    restored.load_state_dict(det.state_dict())
    rest = [e for i in range(402, 410) for e in restored.update(series.point(i))]
    assert [e.kind for e in rest] == ["grad_response"]


def test_real_benign_grad_outliers_raise_no_alarm_in_analyze():
    """The ms-swift FSDP2 run (bf16 grad-norm outliers up to 2,200x, the loss as its DeepSpeed
    twin's) and the resumed OLMo run (a 5.5x outlier at step 42): every gradient event info."""
    for name in ("swift-gemma4-fsdp2-full-epoch.log.gz", "olmo-1b-0724-continue.log"):
        result = analyze(read_log(LOGS / name))
        assert result.incidents == [], name
        graded = [e for e in result.events if e.kind in ("grad_spike", "grad_explosion")]
        assert graded and all("benign outlier" in e.message for e in graded), name


def test_a_zero_gradient_with_a_flat_loss_is_a_run_that_does_not_learn():
    rng = np.random.default_rng(1)
    det = VanishingGradientDetector()
    events = []
    for step in range(60):
        loss = 10.8 + 0.02 * rng.standard_normal()
        events += det.update(MetricPoint(step=step, loss=loss, grad_norm=0.0))
    (event,) = events
    assert (event.step, event.severity) == (19, "critical")
    assert "does not learn" in event.message


def test_a_zero_logged_norm_with_a_falling_loss_is_no_incident():
    det = VanishingGradientDetector()
    events = []
    for step in range(60):
        events += det.update(MetricPoint(step=step, loss=4.0 - 0.02 * step, grad_norm=0.0))
    (event,) = events
    assert event.severity == "info" and "not the gradient's" in event.message


def test_zero_gradient_bulk_and_step_by_step_agree():
    rng = np.random.default_rng(2)
    n = 3000
    grad = 1.0 + 0.05 * rng.standard_normal(n)
    grad[2000:2100] = 0.0  # a stretch of zero gradient, then learning again
    loss = 3.0 + 0.02 * rng.standard_normal(n)
    series = MetricSeries(steps=np.arange(n), loss=loss, grad_norm=grad)
    live = _live(series)
    assert [(e.step, e.severity) for e in live if e.kind == "vanishing_gradients"] == [
        (2019, "critical")
    ]
    assert _key(DetectorSuite().run(series)) == _key(live)


def test_the_real_run_with_a_zero_gradient_throughout_is_critical():
    """OLMo 20M, tied embeddings: grad norm 0.0 at every logged step, the loss at ~ln(50,280)."""
    result = analyze(read_log(LOGS / "olmo-20m-tied-emb-zero-grad.log"))
    found = [e for e in result.incidents if e.kind == "vanishing_gradients"]
    assert [(e.step, e.severity) for e in found] == [(200, "critical")]
