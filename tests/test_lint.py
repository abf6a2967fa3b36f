"""The set-up lint: each finding raised by a planted mistake, and silent on a clean set-up."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.demo import TinyGPT
from trainguard.diagnosis.lint import lint, peak_lr_limit

from helpers import read_jsonl

TOTAL = 10_000


def clean_setup(**changes):
    """TinyGPT with scaled residual projections, AdamW (0.9, 0.95), warmup over 2%."""
    torch.manual_seed(0)
    model = TinyGPT()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                p.normal_(0, 0.02 / math.sqrt(2 * 2))
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8}
    kwargs.update(changes.pop("optimizer", {}))
    opt = torch.optim.AdamW(model.parameters(), **kwargs)
    warmup = changes.pop("warmup", 200)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    setup = {"model": model, "optimizer": opt, "scheduler": sched, "total_steps": TOTAL}
    setup.update(changes)
    return setup


def codes(setup) -> list[str]:
    return [f.code for f in lint(**setup)]


def test_a_clean_setup_is_silent():
    setup = clean_setup()
    assert codes(setup) == []
    assert setup["optimizer"].param_groups[0]["lr"] == pytest.approx(1e-3 / 200)  # untouched
    assert setup["scheduler"].last_epoch == 0


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"scheduler": None}, "no-warmup"),
        ({"warmup": 50}, "short-warmup"),
        ({"optimizer": {"lr": 1.0}}, "peak-lr"),  # the line extrapolated to 30k parameters
        ({"optimizer": {"betas": (0.9, 0.999)}}, "adam-beta2"),
        ({"optimizer": {"eps": 1e-4}}, "adam-eps"),
        ({"max_grad_norm": None}, "no-clipping"),
        ({"autocast_dtype": torch.float16}, "fp16-no-scaler"),
    ],
)
def test_each_planted_mistake_is_found(change, code):
    setup = clean_setup(**change)
    if change.get("scheduler", 1) is None:
        setup["scheduler"] = None
    assert codes(setup) == [code]


def hundred_step_warmups(total: int) -> dict[str, Callable[[torch.optim.Optimizer], Any]]:
    """A 100-step warmup to the peak in each scheduler's own terms, in a run of `total` steps."""
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    sched = torch.optim.lr_scheduler
    return {
        "LambdaLR (s+1)/100": lambda o: sched.LambdaLR(o, lambda s: min(1.0, (s + 1) / 100)),
        "LambdaLR in 4 stairs from 0": lambda o: sched.LambdaLR(o, lambda s: min(1, s // 25 / 4)),
        # LinearLR runs total_iters + 1 steps from start_factor up to the peak
        "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.01, total_iters=99),
        "OneCycleLR": lambda o: sched.OneCycleLR(o, 1e-3, total_steps=total, pct_start=100 / total),
        "SequentialLR": lambda o: sched.SequentialLR(
            o,
            [sched.LinearLR(o, 0.01, total_iters=99), sched.CosineAnnealingLR(o, total - 99)],
            milestones=[99],
        ),
        "HF linear": lambda o: get_linear_schedule_with_warmup(o, 100, total),
        "HF cosine": lambda o: get_cosine_schedule_with_warmup(o, 100, total),
    }


@pytest.mark.parametrize("name", list(hundred_step_warmups(1)))
def test_the_warmup_is_counted_exactly(name):
    """100 warmup steps are 1% of 10,000 (no finding) and reported as 100 in 20,000."""
    for total, expected in ((10_000, []), (20_000, ["the warmup lasts 100 steps, 0.50% of 20000"])):
        setup = clean_setup(total_steps=total)
        setup["scheduler"] = hundred_step_warmups(total)[name](setup["optimizer"])
        found = [f.message for f in lint(**setup) if f.code in ("short-warmup", "no-warmup")]
        assert [m.split(": ")[0] for m in found] == expected, found


def test_a_one_cycle_schedule_is_traced_to_its_end_only():
    """OneCycleLR raises when stepped past its total_steps: with no run length the trace stops
    there."""
    setup = clean_setup(total_steps=None)
    opt = setup["optimizer"]
    setup["scheduler"] = torch.optim.lr_scheduler.OneCycleLR(opt, 1e-3, total_steps=1000)
    assert codes(setup) == []


def test_init_mistakes_are_found():
    setup = clean_setup()
    torch.manual_seed(1)
    setup["model"] = TinyGPT()  # residual projections at 0.02; fine otherwise
    assert codes(setup) == ["residual-init"]
    with torch.no_grad():
        setup["model"].blocks[0].mlp[0].bias.fill_(0.1)
        for p in setup["model"].parameters():
            if p.dim() == 2:
                p.mul_(5)
    assert set(codes(setup)) >= {"init-std", "nonzero-bias"}


def test_post_ln_depth():
    layer = nn.TransformerEncoderLayer(16, 2, 32, norm_first=False)
    deep = nn.TransformerEncoder(layer, num_layers=32, enable_nested_tensor=False)
    assert "post-ln-depth" in [f.code for f in lint(deep)]
    pre = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, norm_first=True), 32, enable_nested_tensor=False
    )
    assert "post-ln-depth" not in [f.code for f in lint(pre)]


class BertStyleBlock(nn.Module):
    """A hand-written transformer block: post-LN, `norm(x + f(x))`, or pre-LN, `x + f(norm(x))`;
    or DeepNorm's `norm(alpha x + f(x))`."""

    def __init__(self, kind: str, d: int = 8) -> None:
        super().__init__()
        self.kind = kind
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.attn_norm, self.ffn_norm = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "pre":
            h = self.attn_norm(x)
            x = x + self.attn(h, h, h, key_padding_mask=mask, need_weights=False)[0]
            return x + self.ffn(self.ffn_norm(x))
        attended, _ = self.attn(x, x, x, key_padding_mask=mask, need_weights=False)
        x = self.attn_norm(self.skip(x) + attended)
        return self.ffn_norm(self.skip(x) + self.ffn(x))

    def skip(self, x: torch.Tensor) -> torch.Tensor:
        """The residual path: DeepNorm weights it up by alpha (2 here)."""
        return x * 2.0 if self.kind == "deepnorm" else x


@pytest.mark.parametrize(("kind", "flagged"), [("post", True), ("pre", False), ("deepnorm", False)])
def test_a_hand_written_post_ln_stack_is_found_by_its_structure(kind, flagged):
    model = nn.ModuleList(BertStyleBlock(kind) for _ in range(32))
    found = [f.message.split(":")[0] for f in lint(model) if f.code == "post-ln-depth"]
    assert found == (["32 post-LN transformer layers"] if flagged else [])


def test_post_ln_layers_nested_in_stages_are_counted_once():
    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(BertStyleBlock("post") for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    found = [f.message for f in lint(nn.ModuleList(Stage() for _ in range(8)))]
    assert [m for m in found if m.startswith("32 post-LN transformer layers:")] != []


def test_peak_lr_table():
    assert peak_lr_limit(int(7e9)) == pytest.approx(3e-4)
    assert peak_lr_limit(int(70e9)) == pytest.approx(1e-4)
    assert peak_lr_limit(int(405e9)) == pytest.approx(8e-5)
    assert 1e-4 < peak_lr_limit(int(20e9)) < 3e-4


def test_the_guard_lints_once_at_the_start(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # beta2 0.999, no warmup
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False), run_dir=tmp_path)
    guard.close()
    lint_events = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "lint"]
    found = {e["metrics"]["code"] for e in lint_events}
    assert {"no-warmup", "adam-beta2", "residual-init"} <= found
    assert all(e["severity"] == "info" and "fix:" in e["message"] for e in lint_events)
    off = tg.GuardConfig(console=False, diagnosis={"lint": False})
    assert tg.Guard(model, opt, config=off).findings == []
