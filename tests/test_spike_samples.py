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


def lm_batch(seed: int) -> list[float]:
    """64 sequence losses of a healthy LM batch: around 2.0 with a spread of 0.15."""
    g = torch.Generator().manual_seed(seed)
    return (2.0 + 0.15 * torch.randn(64, generator=g)).tolist()


def fitted_batch(seed: int) -> list[float]:
    """64 cross-entropies of a fitted classifier: median 1e-4, heavy-tailed (log-normal)."""
    g = torch.Generator().manual_seed(seed)
    return (1e-4 * torch.exp(1.5 * torch.randn(64, generator=g))).tolist()


PLANTED = (4, 20, 50)


@pytest.mark.parametrize("make", [lm_batch, fitted_batch])
def test_blame_names_exactly_the_planted_samples_that_carry_the_spike(make):
    for seed in range(5):
        losses = make(seed)
        clean_mean = sum(losses) / len(losses)
        for i, value in zip(PLANTED, (9.0, 6.5, 12.0), strict=True):
            losses[i] = value
        blamed = blame_samples(losses, baseline=clean_mean)
        assert sorted(s.index for s in blamed) == list(PLANTED), (make.__name__, seed)
        assert sorted(s.index for s in blame_samples(losses)) == list(PLANTED)  # floors alone


@pytest.mark.parametrize("make", [lm_batch, fitted_batch])
def test_blame_of_a_clean_batch_names_no_one(make):
    for seed in range(20):
        losses = make(seed)
        mean = sum(losses) / len(losses)
        assert blame_samples(losses, baseline=0.9 * mean) == [], (make.__name__, seed)
        assert blame_samples(losses) == [], (make.__name__, seed)


def test_a_small_loss_is_not_toxic_however_tight_the_batch():
    losses = [1e-5] * 60 + [2e-5, 3e-5, 0.01, 0.3]
    assert blame_samples(losses) == []  # z is in the millions, but 0.3 nats is no poison
    assert [s.index for s in blame_samples(losses, min_excess=0.1)] == [63]


def test_a_spike_spread_over_the_batch_blames_no_sample():
    """An LR burst lifts every sample; the batch's own outliers do not explain that."""
    losses = [x + 1.0 for x in lm_batch(3)]
    losses[7] = 4.6  # an outlier in the batch (z ~ 10), but 2.6 of a 66 excess
    assert [s.index for s in blame_samples(losses)] == [7]
    assert blame_samples(losses, baseline=2.0) == []


def test_a_fitted_classifier_spike_blames_the_three_mislabelled_samples(tmp_path):
    torch.manual_seed(0)
    centres = torch.randn(10, 20) * 4
    labels = torch.randint(10, (4096,))
    inputs = centres[labels] + torch.randn(4096, 20)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False), run_dir=tmp_path)
    g = torch.Generator().manual_seed(1)
    named: list[list[int]] = []
    for step in range(320):
        index = torch.randint(4096, (64,), generator=g)
        x, y = inputs[index], labels[index].clone()
        if step == 300:  # the classifier fits its data by now (median loss ~1e-4)
            y[list(PLANTED)] = (y[list(PLANTED)] + 1) % 10
        per_sample = F.cross_entropy(model(x), y, reduction="none")
        per_sample.mean().backward()
        ids = list(range(64 * step, 64 * step + 64))
        decision = guard.step(
            per_sample.mean(),
            batch_ids=index.tolist(),
            sample_ids=ids,
            per_sample_losses=per_sample,
        )
        opt.zero_grad(set_to_none=True)
        for e in decision.events:
            if e.kind == "spike_samples":
                named.append(sorted(s["index"] for s in e.metrics["samples"]))
    guard.close()
    assert named == [list(PLANTED)]
    planted_ids = {64 * 300 + i for i in PLANTED}
    for record in read_jsonl(tmp_path / "quarantine.jsonl"):
        assert set(record["sample_ids"]) == planted_ids  # never a clean sample
