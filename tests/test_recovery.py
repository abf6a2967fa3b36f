"""Recovery on a tiny LM with planted faults: the incident, the action, and the outcome."""

from __future__ import annotations

import math

import pytest
import torch

import trainguard as tg
from trainguard.demo import TinyGPT
from trainguard.demo.scenarios import FAULTS, LR, Fault, planted, run_scenario, train
from trainguard.detectors.base import Detector
from trainguard.events import Event

from helpers import corpus, read_jsonl


def run(run_dir, fault: Fault, steps: int = 400):
    out = run_scenario(fault, run_dir=run_dir, steps=steps)
    path = run_dir / "events.jsonl"
    return out, read_jsonl(path) if path.exists() else []


def kinds(events, kind):
    return [e for e in events if e["kind"] == kind]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return run(tmp_path_factory.mktemp("clean"), FAULTS["clean"])


def test_clean_run_never_rolls_back(clean):
    out, events = clean
    assert kinds(events, "rollback") == []
    assert out.guard.ring.snapshots  # known-good states were kept
    assert out.guard.ring.snapshots[-1].step == 400


def test_toxic_batch_is_skipped_and_quarantined_without_rollback(clean, tmp_path):
    out, events = run(tmp_path, FAULTS["toxic batch"])
    assert [e["step"] for e in kinds(events, "loss_spike")] == [180]
    assert kinds(events, "rollback") == []
    quarantine = read_jsonl(tmp_path / "quarantine.jsonl")
    assert len(quarantine) == 1 and quarantine[0]["step"] == 180
    toxic_ids = quarantine[0]["batch_ids"]
    assert out.eval_loss == pytest.approx(clean[0].eval_loss, rel=0.02)

    # a restarted run in the same run_dir never sees that batch again
    guard = tg.Guard(config=tg.GuardConfig(console=False), run_dir=tmp_path)
    data = list(corpus().batches(16, 32, 200, seed=1))
    seen = [b.ids for b in guard.batches(data)]
    assert toxic_ids not in seen and len(seen) == 199


def test_lr_blowup_rolls_back_and_recovers(clean, tmp_path):
    """A sudden blow-up is undone with the LR kept; the burst going on after it cuts the LR."""
    out, events = run(tmp_path, FAULTS["LR x100 for 10 steps"])
    rollbacks = kinds(events, "rollback")
    assert rollbacks, [(e["step"], e["kind"]) for e in events]
    first = rollbacks[0]["metrics"]
    assert first["to_step"] <= 250 and first["lr_factor"] == 1.0  # before the first bad update
    assert "LR kept" in rollbacks[0]["message"]
    assert all(r["metrics"]["lr_factor"] < 1 for r in rollbacks[1:])
    assert out.halted is None
    assert out.eval_loss == pytest.approx(clean[0].eval_loss, rel=0.02)


def test_region_of_toxic_batches_rolls_back_with_a_wide_skip(clean, tmp_path):
    out, events = run(tmp_path, FAULTS["20 toxic batches"])
    rollbacks = kinds(events, "rollback")
    assert len(rollbacks) == 2, [(e["step"], e["kind"]) for e in events]
    # a sudden jump is first undone with the data kept: its batches are fed again
    assert rollbacks[0]["metrics"]["skipped_batches"] is None
    assert "fed again" in rollbacks[0]["message"]
    # they blow up again on the restored weights: the data, so the repeat skips the region
    skipped = rollbacks[1]["metrics"]["skipped_batches"]
    assert skipped[0] <= 350 and skipped[1] >= 370  # the whole region is never trained on
    assert rollbacks[1]["metrics"]["lr_factor"] < 1
    assert out.eval_loss == pytest.approx(clean[0].eval_loss, rel=0.02)


def test_corrupted_weights_roll_back(clean, tmp_path):
    """A write to the weights is undone with the LR and the data kept: the run goes on as the
    clean one did."""
    out, events = run(tmp_path, FAULTS["corrupted weights"])
    (rollback,) = kinds(events, "rollback")
    assert rollback["metrics"]["lr_factor"] == 1.0
    assert rollback["metrics"]["skipped_batches"] is None and not kinds(events, "data_skipped")
    assert all(p.isfinite().all() for p in out.model.parameters())
    assert out.eval_loss == pytest.approx(clean[0].eval_loss, rel=0.02)


def test_persistent_fault_halts_after_escalation_with_a_diagnosis(tmp_path):
    out, events = run(tmp_path, FAULTS["persistent fault"], steps=600)
    assert out.halted is not None
    rollbacks = kinds(events, "rollback")
    assert 1 <= len(rollbacks) <= 5
    factors = [r["metrics"]["lr_scale"] for r in rollbacks]
    assert factors == sorted(factors, reverse=True)  # each rollback lowers the LR further
    assert [e["kind"] for e in events[-2:]] == ["halt", "run_closed"]
    assert out.halted.diagnosis in events[-2]["message"]


def test_without_the_guard_the_same_faults_do_lasting_damage(clean):
    for name in ("LR x100 for 10 steps", "corrupted weights"):
        unguarded = run_scenario(FAULTS[name], guarded=False)
        assert unguarded.eval_loss > 1.1 * clean[0].eval_loss, name
    # a late burst of bad data leaves the plain loop no time to outgrow it
    unguarded = run_scenario(FAULTS["20 toxic batches"], guarded=False)
    assert unguarded.eval_loss > 1.03 * clean[0].eval_loss


@pytest.fixture(scope="module")
def clean_lstm():
    return run_scenario(FAULTS["clean"], family="RecurrentLM")


def test_lost_optimizer_state_is_read_as_an_explosion_and_rolled_back(clean, tmp_path):
    out, events = run(tmp_path, FAULTS["optimizer state lost"])
    (revised,) = [e for e in kinds(events, "spike_classified") if e["step"] <= 250]
    assert revised["type"] == "gradient_explosion" and "stayed over 2x" in revised["message"]
    assert kinds(events, "rollback")[0]["metrics"]["to_step"] < 240  # before the bad update
    assert out.eval_loss == pytest.approx(clean[0].eval_loss, rel=0.02)


@pytest.mark.parametrize(
    "name", ["Inf gradients for 3 steps", "NaN batch", "decaying shard", "log(0) in a module"]
)
def test_the_lstm_family_recovers_too(clean_lstm, tmp_path, name):
    out = run_scenario(FAULTS[name], family="RecurrentLM", run_dir=tmp_path)
    assert out.halted is None
    assert all(p.isfinite().all() for p in out.model.parameters())
    assert out.eval_loss == pytest.approx(clean_lstm.eval_loss, rel=0.02)
    unguarded = run_scenario(FAULTS[name], family="RecurrentLM", guarded=False)
    if name == "decaying shard":  # too late in the run for the plain loop to outgrow
        assert unguarded.eval_loss > 1.03 * clean_lstm.eval_loss
    else:  # the plain loop never recovers from a NaN or Inf update
        assert math.isnan(unguarded.eval_loss)


def noisy_regression(run_dir, steps: int, planted_at: int | None = None):
    """An MLP fitting noisy linear targets with batch ids; at `planted_at` a false alarm: a
    ratio-only loss spike typed data toxicity, its follow-up confirming that type."""
    torch.manual_seed(0)
    x = torch.randn(4096, 8)
    y = x @ torch.randn(8, 1) + 0.5 * torch.randn(4096, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False), run_dir=run_dir)
    if planted_at is not None:
        weak = {"z_score": 1.3, "z_threshold": 10.0, "rule": "ratio"}
        guard.detectors.detectors.append(
            Planted(
                {
                    planted_at: ("loss_spike", "data_toxicity", weak),
                    planted_at + 5: (
                        "spike_classified",
                        "data_toxicity",
                        {"spike_step": planted_at},
                    ),
                }
            )
        )
    for step in range(steps):
        i = step % 256
        loss = torch.nn.functional.mse_loss(
            model(x[i * 16 : (i + 1) * 16]), y[i * 16 : (i + 1) * 16]
        )
        loss.backward()
        guard.step(loss, batch_ids=[step])
        opt.zero_grad()
    guard.close()
    return guard


class Planted(Detector):
    """A stub detector raising planted events once each: (kind, type, metrics) by step."""

    name = "planted"

    def __init__(self, planted: dict[int, tuple[str, str, dict]]) -> None:
        self.planted = planted

    def update(self, point):
        if point.step not in self.planted:
            return []
        kind, type_, metrics = self.planted.pop(point.step)
        return [Event(point.step, kind, "warning", f"planted {kind}", dict(metrics), type=type_)]


def test_noisy_regression_with_batch_ids_quarantines_nothing_for_good(tmp_path):
    guard = noisy_regression(tmp_path, 500, planted_at=300)
    assert guard.action_counts["skip"] >= 1  # the planted false alarm was skipped
    assert not (tmp_path / "quarantine.jsonl").exists()
    assert guard.quarantine.records == [] and not guard.quarantine.suspects


@pytest.fixture(scope="module")
def short_clean():
    """A 300-step run over exactly 300 batches, clean: the guard leaves it alone."""
    return short_run(Fault())


def short_run(fault: Fault, steps: int = 300):
    data = corpus()
    batches = planted(list(data.batches(16, 32, steps, seed=1)), fault, data)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False))
    decisions = [s.decision for s in train(model, opt, batches, steps, fault, guard=guard)]
    guard.close()
    with torch.no_grad():
        held = [float(model.loss(model(b.x), b.y)) for b in data.batches(32, 32, 8, seed=999)]
    return guard, [e for d in decisions for e in d.events], sum(held) / len(held)


def test_a_short_clean_run_is_left_alone(short_clean):
    guard, found, _ = short_clean
    assert guard.global_step == 300
    assert guard.action_counts == {"step": 300, "skip": 0, "rollback": 0, "halt": 0}
    assert guard.quarantine.records == [] and guard.recovery.config.snapshot_every == 15
    assert not [e for e in found if e.kind in ("rollback", "data_skipped", "quarantine")]


def test_a_short_run_rolls_back_an_lr_burst_and_keeps_its_data(short_clean):
    """A 5-step burst is undone once, the data fed again: nothing is skipped."""
    guard, found, held = short_run(Fault("LR x100 at 120", blowup=tuple(range(120, 125))))
    (rollback,) = [e for e in found if e.kind == "rollback"]
    assert rollback.metrics["to_step"] <= 120 and rollback.metrics["skipped_batches"] is None
    assert not [e for e in found if e.kind == "data_skipped"]
    assert guard.global_step == 300
    assert held == pytest.approx(short_clean[2], rel=0.03)


def test_a_short_run_skips_a_small_share_of_its_data_when_the_burst_goes_on(short_clean):
    """A burst still going on after the first rollback is rolled back again, with the LR cut
    and a skip sized to the 180 batches left: at most 4% (a repeat's widened share)."""
    guard, found, held = short_run(Fault("LR x100 at 120", blowup=tuple(range(120, 130))))
    rollbacks = [e for e in found if e.kind == "rollback"]
    assert len(rollbacks) == 2 and rollbacks[0].metrics["to_step"] <= 120
    assert rollbacks[1].metrics["lr_factor"] < 1
    skipped = [e for e in found if e.kind == "data_skipped"]
    count = sum(e.metrics["count"] for e in skipped)
    assert skipped and count <= 1 + 0.04 * 180
    assert guard.global_step == 300 - count  # the data, 300 batches, ran out only by the skip
    assert held == pytest.approx(short_clean[2], rel=0.03)
