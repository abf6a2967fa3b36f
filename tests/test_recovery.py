"""Recovery on a tiny LM with planted faults: the incident, the action, and the outcome."""

from __future__ import annotations

import functools

import pytest
import torch

import trainguard as tg
from trainguard.demo import TinyGPT

from helpers import LR, corpus, eval_loss, read_jsonl

STEPS = 400


def run(
    run_dir,
    *,
    toxic: range = range(0),
    blowup: range = range(0),
    corrupt_at: int | None = None,
    persistent_from: int | None = None,
    config: tg.GuardConfig | None = None,
    steps: int = STEPS,
):
    """Train until the guard has made `steps` optimizer steps (rollbacks replay some). Faults are
    planted by data position (`toxic`) or by loop iteration, i.e. wall-clock time (the rest)."""
    data = corpus()
    batches = list(data.batches(16, 32, steps + 4000, seed=1))
    for position in toxic:
        batches[position] = data.make_toxic(batches[position], seed=position)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    original_step = opt.step
    cfg = config or tg.GuardConfig(console=False)
    guard = tg.Guard(model, opt, config=cfg, run_dir=run_dir)
    decisions: list[tg.Decision] = []
    halted = None
    iteration = 0
    try:
        for batch in guard.batches(batches):
            if guard.global_step >= steps:
                break
            if iteration in blowup:  # this iteration's update lands at 100x the LR
                opt.step = functools.partial(_scaled_step, opt, original_step, 100.0)
            else:
                opt.step = original_step
            if iteration == corrupt_at:
                with torch.no_grad():  # a bad write: the LM head's weights 1000x too large
                    model.head.weight.mul_(1e3)
            logits = model(batch.x, batch.input_scale)
            if persistent_from is not None and iteration >= persistent_from:
                noise = 0.05 * (iteration - persistent_from)  # a fault that grows and persists
                logits = logits + noise * torch.randn_like(logits)
            loss = model.loss(logits, batch.y)
            loss.backward()
            decisions.append(guard.step(loss, batch_ids=batch.ids))
            opt.zero_grad(set_to_none=True)
            iteration += 1
    except tg.TrainingHalted as exc:
        halted = exc
    guard.close()
    opt.step = original_step
    evals = list(data.batches(32, 32, 8, seed=999))
    events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    return {
        "eval": eval_loss(model, evals),
        "events": events,
        "decisions": decisions,
        "halted": halted,
        "guard": guard,
        "model": model,
    }


def _scaled_step(opt, original, factor, *args, **kwargs):
    for group in opt.param_groups:
        group["lr"] *= factor
    try:
        return original(*args, **kwargs)
    finally:
        for group in opt.param_groups:
            group["lr"] /= factor


def kinds(events, kind):
    return [e for e in events if e["kind"] == kind]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return run(tmp_path_factory.mktemp("clean"))


def test_clean_run_never_rolls_back(clean):
    assert kinds(clean["events"], "rollback") == []
    assert clean["guard"].ring.snapshots  # known-good states were kept
    assert clean["guard"].ring.snapshots[-1].step == 400


def test_toxic_batch_is_skipped_and_quarantined_without_rollback(clean, tmp_path):
    out = run(tmp_path, toxic=range(180, 181))
    assert [e["step"] for e in kinds(out["events"], "loss_spike")] == [180]
    assert kinds(out["events"], "rollback") == []
    quarantine = read_jsonl(tmp_path / "quarantine.jsonl")
    assert len(quarantine) == 1 and quarantine[0]["step"] == 180
    toxic_ids = quarantine[0]["batch_ids"]
    assert out["eval"] == pytest.approx(clean["eval"], rel=0.02)

    # a restarted run in the same run_dir never sees that batch again
    guard = tg.Guard(config=tg.GuardConfig(console=False), run_dir=tmp_path)
    data = list(corpus().batches(16, 32, 200, seed=1))
    seen = [b.ids for b in guard.batches(data)]
    assert toxic_ids not in seen and len(seen) == 199


def test_lr_blowup_rolls_back_with_an_lr_cut_and_recovers(clean, tmp_path):
    out = run(tmp_path, blowup=range(250, 260))
    rollbacks = kinds(out["events"], "rollback")
    assert rollbacks, [(e["step"], e["kind"]) for e in out["events"]]
    first = rollbacks[0]["metrics"]
    assert first["to_step"] <= 250 - 10 and first["lr_factor"] == 0.5
    assert out["halted"] is None
    assert out["eval"] == pytest.approx(clean["eval"], rel=0.02)


def test_region_of_toxic_batches_rolls_back_with_a_wide_skip(clean, tmp_path):
    out = run(tmp_path, toxic=range(200, 220))
    rollbacks = kinds(out["events"], "rollback")
    assert rollbacks
    skipped = rollbacks[0]["metrics"]["skipped_batches"]
    assert skipped[0] <= 200 and skipped[1] >= 220  # the whole region is never trained on
    assert out["eval"] == pytest.approx(clean["eval"], rel=0.02)


def test_corrupted_weights_roll_back(clean, tmp_path):
    out = run(tmp_path, corrupt_at=260)
    assert kinds(out["events"], "rollback")
    assert all(torch.isfinite(p).all() for p in out["model"].parameters())
    assert out["eval"] == pytest.approx(clean["eval"], rel=0.02)


def test_persistent_fault_halts_after_escalation_with_a_diagnosis(tmp_path):
    out = run(tmp_path, persistent_from=200, steps=600)
    halted = out["halted"]
    assert halted is not None
    rollbacks = kinds(out["events"], "rollback")
    assert 1 <= len(rollbacks) <= 5
    factors = [r["metrics"]["lr_scale"] for r in rollbacks]
    assert factors == sorted(factors, reverse=True)  # each rollback lowers the LR further
    assert out["events"][-1]["kind"] == "halt" and halted.diagnosis in out["events"][-1]["message"]
