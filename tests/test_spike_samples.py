"""The samples behind a loss spike: named in the event, and quarantined one by one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import trainguard as tg
from trainguard.demo import TinyGPT
from trainguard.diagnosis import blame_samples, lm_cross_entropy

from helpers import corpus, read_jsonl


def test_two_bad_samples_out_of_sixteen_are_both_named(tmp_path):
    data = corpus()
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False), run_dir=tmp_path)
    bad = (3, 11)
    for step, batch in enumerate(data.batches(16, 32, 150, seed=1)):
        y = batch.y.clone()
        logits = model(batch.x)
        if step == 120:
            for i in bad:  # these two samples' targets are garbage: the least likely tokens
                y[i] = logits[i].detach().argmin(-1)
        per_sample = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
        loss = per_sample.mean()
        loss.backward()
        text = [f"sample starting at {i}" for i in batch.ids]
        lazy = step == 120  # at the spike, a closure: computed only because the step spiked
        losses = (lambda x=batch.x, y=y: lm_cross_entropy(model(x), y)) if lazy else per_sample
        decision = guard.step(loss, batch_ids=batch.ids, per_sample_losses=losses, sample_text=text)
        opt.zero_grad(set_to_none=True)
        if step == 120:
            kinds = [e.kind for e in decision.events]
            assert "loss_spike" in kinds and "spike_samples" in kinds, kinds
            blamed = next(e for e in decision.events if e.kind == "spike_samples")
            named = sorted(s["index"] for s in blamed.metrics["samples"])
            assert named == list(bad)
            assert {s["id"] for s in blamed.metrics["samples"]} == {batch.ids[i] for i in bad}
            assert blamed.metrics["samples"][0]["preview"].startswith("sample starting at")
            bad_ids = {batch.ids[i] for i in bad}
    guard.close()
    (record,) = read_jsonl(tmp_path / "quarantine.jsonl")
    assert set(record["sample_ids"]) == bad_ids  # the two samples, not the whole batch's ids


def test_lm_cross_entropy_matches_the_mean_token_loss_and_ignores_padding():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(11, (3, 5))
    per_sample = lm_cross_entropy(logits, targets)
    assert per_sample.shape == (3,)
    assert float(per_sample.mean()) == pytest.approx(
        float(F.cross_entropy(logits.transpose(1, 2), targets))
    )
    padded = targets.clone()
    padded[0, 3:] = -100
    expected = F.cross_entropy(logits[0, :3], targets[0, :3])
    assert float(lm_cross_entropy(logits, padded)[0]) == pytest.approx(float(expected))


def test_blame_samples_robust_test_and_perplexity_option():
    losses = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 6.0]
    (worst,) = blame_samples(losses, ids=list("abcdefg"))
    assert worst.id == "g" and worst.index == 6 and worst.z > 5
    assert blame_samples([1.0] * 8) == []  # a flat batch blames no one
    mild = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 1.3]
    assert blame_samples(mild) == []
    flagged = blame_samples(mild, perplexity=math.exp(1.2))
    assert [s.index for s in flagged] == [6]
    assert blame_samples([1.0, math.nan, 1.1])[0].index == 1  # a NaN sample is the culprit
