"""A tiny transformer LM trained on the CPU with planted faults: what was detected, where, and
what happened after."""

from __future__ import annotations

import pytest
import torch

from trainguard.demo.scenarios import Fault, run_scenario

from helpers import read_jsonl

STEPS = 300


@pytest.fixture(scope="module")
def clean():
    return run_scenario(Fault(), steps=STEPS)


def test_clean_run_raises_no_incident(clean):
    assert clean.halted is None
    assert [e for e in clean.events if e.severity != "info"] == []
    assert clean.eval_loss < 0.4 * clean.losses[0]  # it learned


def test_toxic_batch_is_flagged_at_its_step_skipped_and_costs_nothing(clean, tmp_path):
    run = run_scenario(Fault(toxic=(150,)), steps=STEPS, run_dir=tmp_path)
    spikes = [e for e in run.events if e.kind == "loss_spike"]
    assert [e.step for e in spikes] == [150]
    assert run.decisions[150].action == "skip"
    (follow_up,) = [e for e in run.events if e.kind == "spike_classified"]
    assert follow_up.type == "data_toxicity" and follow_up.metrics["spike_step"] == 150
    assert sum(d.action == "skip" for d in run.decisions) == 1
    assert run.eval_loss == pytest.approx(clean.eval_loss, rel=0.02)
    logged = read_jsonl(tmp_path / "events.jsonl")
    assert [(e["step"], e["kind"], e["action"]) for e in logged if e["severity"] != "info"] == [
        (150, "loss_spike", "skip")
    ]
    spike = next(e for e in logged if e["kind"] == "loss_spike")
    assert spike["metrics"]["batch_ids"] == run.decisions[150].events[0].metrics["batch_ids"]


def test_lr_blowup_is_flagged_as_grad_spike_or_explosion():
    run = run_scenario(Fault(blowup=tuple(range(200, 205))), steps=STEPS)
    flagged = [
        e for e in run.events if e.kind in ("grad_spike", "grad_explosion") and 200 <= e.step <= 206
    ]
    assert flagged, [(e.step, e.kind) for e in run.events]
    assert run.decisions[flagged[0].step].action == "skip"
    spikes = [e for e in run.events if e.kind == "loss_spike"]
    assert spikes and 200 < spikes[0].step <= 206
    revised = [e for e in run.events if e.kind == "spike_classified"]
    assert revised[0].type == "gradient_explosion"  # it jumped and stayed high


def test_log_zero_in_a_module_is_nonfinite_skipped_and_weights_stay_finite(clean):
    run = run_scenario(Fault(log0_at=120), steps=STEPS)
    nonfinite = [e for e in run.events if e.kind == "nonfinite"]
    assert [e.step for e in nonfinite] == [120]
    assert run.decisions[120].action == "skip"
    assert "nan" in nonfinite[0].message.lower() or "inf" in nonfinite[0].message.lower()
    (origin,) = [e for e in run.events if e.kind == "nan_origin"]  # the step, replayed and traced
    assert origin.step == 120 and origin.metrics["module"] == "blocks.0.mlp"
    assert origin.metrics["direction"] == "forward" and origin.metrics["op"] == "aten.log.default"
    assert "log of zero" in origin.message
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert run.halted is None
    assert run.eval_loss == pytest.approx(clean.eval_loss, rel=0.02)
