"""Spike types from evidence (issue 37): bad data that keeps the loss up on the next batches while
the grad norm stays flat is data toxicity, a rise brewing before the jump is architecture, and
the type never changes what the policy does with the evidence."""

from __future__ import annotations

import numpy as np

from trainguard import GuardConfig
from trainguard.detectors import DetectorSuite
from trainguard.detectors.series import MetricSeries
from trainguard.events import Event
from trainguard.monitor import Monitor

STEPS = 1200
ONSET = 900


def curve(form: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A noisy falling loss and a flat grad norm with, at ONSET, a shard that degrades into noise
    (the loss climbs to 2x over 20 steps and is back after 30) or an architecture-type fault
    (a 25% rise over 300 steps, then a jump that stays)."""
    rng = np.random.default_rng(seed)
    t = np.arange(STEPS, dtype=np.float64)
    level = 2.0 + 3.0 * np.exp(-t / 200)
    loss = level * (1 + 0.01 * rng.standard_normal(STEPS))
    grad = 0.5 * np.exp(0.1 * rng.standard_normal(STEPS))
    if form == "shard":
        k = np.arange(30)
        loss[ONSET : ONSET + 30] += level[ONSET] * np.minimum((k + 1) / 20, 1.0)
    else:
        k = np.arange(300)
        rise = 0.25 * level[ONSET] * k / 300
        loss[ONSET - 300 : ONSET] += rise
        loss[ONSET : ONSET + 40] += rise[-1] + level[ONSET]
    return loss, grad


def final_type(events: list[Event]) -> tuple[Event, Event]:
    spike = next(e for e in events if e.kind == "loss_spike")
    follow = next(
        e
        for e in events
        if e.kind == "spike_classified" and e.metrics.get("spike_step") == spike.step
    )
    return spike, follow


def test_a_shard_that_degrades_into_noise_is_bad_data_not_architecture():
    loss, grad = curve("shard")
    events = DetectorSuite().run(MetricSeries(np.arange(STEPS), loss, grad))
    spike, follow = final_type(events)
    assert ONSET <= spike.step < ONSET + 20
    assert spike.revised_type(events) == "data_toxicity" and follow.metrics["lasting"] is True
    assert "bad data" in follow.message


def test_a_rise_brewing_before_the_jump_stays_architecture():
    loss, grad = curve("architecture")
    events = DetectorSuite().run(MetricSeries(np.arange(STEPS), loss, grad))
    spike, follow = final_type(events)
    assert spike.revised_type(events) == "architecture" and "lasting" not in follow.metrics


def test_bad_data_that_lasts_gets_the_action_a_lasting_fault_gets():
    """The policy's answer to the follow-up is the architecture-type one (an LR cut where no
    rollback target exists, as in an observe-only Monitor), and no batch is quarantined."""

    def decisions(form: str) -> list[tuple[str, bool, int | None]]:
        loss, grad = curve(form)
        out = []
        with Monitor(GuardConfig(console=False)) as monitor:
            for step in range(STEPS):
                d = monitor.observe(step, loss=float(loss[step]), grad_norm=float(grad[step]))
                if any(e.kind == "spike_classified" for e in d.events):
                    out.append((d.action, d.lr_factor is not None, d.quarantine_step))
        return out

    shard, architecture = decisions("shard"), decisions("architecture")
    assert shard == architecture == [("step", True, None)]
