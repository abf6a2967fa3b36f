"""GradientStats: correct figures, computed on the device, one device-to-host transfer per step."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.demo import MarkovCorpus, TinyGPT
from trainguard.signals import GradientStats

SRC = str(Path(tg.__file__).parent)
TRANSFER_METHODS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__float__",
    "__int__",
    "__bool__",
    "__index__",
)


@contextmanager
def count_transfers() -> Iterator[dict[str, int]]:
    """Patch every Tensor method that moves data to the host; count calls made from trainguard's
    own code ('ours') and from anywhere ('all')."""
    counts = {"ours": 0, "all": 0}
    originals = {name: getattr(torch.Tensor, name) for name in TRANSFER_METHODS}

    def wrap(name: str):
        original = originals[name]

        def counted(self, *args, **kwargs):
            counts["all"] += 1
            if sys._getframe(1).f_code.co_filename.startswith(SRC):
                counts["ours"] += 1
            return original(self, *args, **kwargs)

        return counted

    for name in TRANSFER_METHODS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _model_and_batches(steps: int):
    torch.manual_seed(0)
    model = TinyGPT()
    data = MarkovCorpus(length=20_000)
    return model, list(data.batches(8, 32, steps))


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_one_device_to_host_transfer_per_step(optimizer_name):
    model, batches = _model_and_batches(25)
    if optimizer_name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    guard = tg.Guard(model, opt, sched, config=tg.GuardConfig(console=False, stats_every=5))
    per_step = []
    decisions = []
    for batch in batches:
        loss = model.loss(model(batch.x), batch.y)
        loss.backward()
        with count_transfers() as counts:
            decisions.append(guard.step(loss, batch_ids=batch.ids))
        opt.zero_grad(set_to_none=True)
        per_step.append(dict(counts))
    assert all(c["ours"] == 1 for c in per_step), per_step
    if optimizer_name == "sgd":  # SGD and LambdaLR make none of their own: the whole step has one
        assert all(c["all"] == 1 for c in per_step), per_step
    sampled = [d.step for d in decisions if "update_ratio" in d.metrics]
    assert sampled == [1, 6, 11, 16, 21]  # measured at steps 0, 5, ...; arrive one step later


def test_the_counter_does_count():
    with count_transfers() as counts:
        torch.ones(3).sum().item()
        float(torch.ones(()))
    assert counts["all"] == 2 and counts["ours"] == 0


def test_figures_match_a_per_parameter_reference():
    model, batches = _model_and_batches(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = GradientStats(model, opt, tg.config.DEFAULT_GROUP_PATTERNS, stats_every=1)
    loss = model.loss(model(batches[0].x), batches[0].y)
    loss.backward()
    signals = stats.resolve(stats.measure(loss, opt))
    named = dict(model.named_parameters())
    reference = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in named.values()))
    assert signals.grad_norm == pytest.approx(reference, rel=1e-5)
    assert signals.loss == pytest.approx(loss.item())
    assert set(signals.group_grad_norms) == {
        "tok_emb",
        "pos_emb",
        "blocks.0",
        "blocks.1",
        "ln_f",
        "head",
    }
    block1 = math.sqrt(
        sum(float(p.grad.norm()) ** 2 for n, p in named.items() if n.startswith("blocks.1."))
    )
    assert signals.group_grad_norms["blocks.1"] == pytest.approx(block1, rel=1e-5)
    assert signals.nonfinite_grads == 0 and signals.lrs == [0.1]

    before = [p.detach().clone() for p in named.values()]
    stats.before_optimizer_step(0)
    opt.step()
    stats.after_optimizer_step(0)
    opt.zero_grad()
    loss = model.loss(model(batches[0].x), batches[0].y)
    loss.backward()
    signals = stats.resolve(stats.measure(loss, opt))
    update = math.sqrt(
        sum(
            float((p.detach() - b).norm()) ** 2 for p, b in zip(named.values(), before, strict=True)
        )
    )
    param = math.sqrt(sum(float(p.detach().norm()) ** 2 for p in named.values()))
    assert signals.update_step == 0
    assert signals.update_ratio == pytest.approx(update / param, rel=1e-4)
    assert set(signals.group_update_ratios) == set(signals.group_grad_norms)


def test_nonfinite_gradients_are_named():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = GradientStats(model, opt, tg.config.DEFAULT_GROUP_PATTERNS)
    model(torch.ones(2, 4)).sum().backward()
    model[2].weight.grad[0, 1] = math.nan
    model[0].bias.grad[2] = math.inf
    signals = stats.resolve(stats.measure(torch.tensor(1.0), opt))
    assert signals.nonfinite_grads == 2
    assert sorted(signals.nonfinite_params) == ["0.bias", "2.weight"]
    assert not math.isfinite(signals.grad_norm)


def test_parameters_without_gradients_are_left_out():
    model = nn.ModuleDict({"used": nn.Linear(3, 3), "unused": nn.Linear(3, 3)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = GradientStats(model, opt, tg.config.DEFAULT_GROUP_PATTERNS)
    model["used"](torch.ones(1, 3)).sum().backward()
    signals = stats.resolve(stats.measure(torch.tensor(1.0), opt))
    expected = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in model["used"].parameters()))
    assert signals.grad_norm == pytest.approx(expected, rel=1e-6)
    assert signals.group_grad_norms["unused"] == 0.0


def test_fp16_gradients_are_measured_in_fp32_without_overflow():
    p = nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    stats = GradientStats(None, opt, tg.config.DEFAULT_GROUP_PATTERNS)
    p.grad = torch.full((1000,), 60000.0, dtype=torch.float16)  # norm ~1.9e6 > fp16 max
    signals = stats.resolve(stats.measure(1.0, opt))
    assert signals.nonfinite_grads == 0
    assert signals.grad_norm == pytest.approx(60000.0 * math.sqrt(1000), rel=1e-3)
    assert stats.names == ["param.0"]


def test_custom_group_patterns():
    model, _ = _model_and_batches(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = GradientStats(model, opt, [r"^blocks\.\d+\.(?P<group>attn|mlp)", r"^(?P<group>[^.]+)"])
    assert stats.groups.group_names == [
        "tok_emb",
        "pos_emb",
        "blocks",
        "attn",
        "mlp",
        "ln_f",
        "head",
    ]
