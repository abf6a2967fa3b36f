"""Fix kits: each checked against its definition, and the MoE balancing helper against a
router that collapses without it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg
from trainguard.demo import TinyGPT, TinyGPTConfig
from trainguard.fixes import (
    AdaptiveClipper,
    DeepNormResidual,
    RMSNorm,
    WarmupCosineRestarts,
    agc_,
    clip_per_expert_,
    deepnorm_constants,
    deepnorm_init_,
    scaled_init_,
    z_loss,
)
from trainguard.moe import LoadBalancer, expert_grad_norms, routing_stats


def gpt(n_layer: int = 4) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig(vocab_size=64, seq_len=16, n_layer=n_layer, n_head=2, d_model=64))


def test_scaled_init_scales_the_residual_projections_and_silences_the_lint():
    model = gpt(4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95))
    before = {f.code for f in tg.lint(model, opt)}
    assert "residual-init" in before
    scaled = scaled_init_(model, n_layers=4)
    assert scaled and all("proj" in n or "mlp" in n for n in scaled)
    params = dict(model.named_parameters())
    for name in scaled:
        assert params[name].std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.15)
    assert params["tok_emb.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert all(p.abs().max() == 0 for n, p in params.items() if n.endswith(".bias"))
    after = {f.code for f in tg.lint(model, opt)}
    assert "residual-init" not in after and "init-std" not in after and "nonzero-bias" not in after


def test_deepnorm_constants_init_and_residual():
    alpha, beta = deepnorm_constants(6)
    assert alpha == pytest.approx(12**0.25) and beta == pytest.approx(48**-0.25)
    torch.manual_seed(0)
    block = nn.ModuleDict(
        {"attn": nn.ModuleDict({"q_proj": nn.Linear(256, 256), "v_proj": nn.Linear(256, 256)})}
    )
    scaled = deepnorm_init_(block, n_layers=6)
    assert scaled == ["attn.v_proj.weight"]
    xavier = math.sqrt(2 / 512)
    assert block["attn"]["v_proj"].weight.std().item() == pytest.approx(beta * xavier, rel=0.05)
    assert block["attn"]["q_proj"].weight.std().item() == pytest.approx(xavier, rel=0.05)
    sub = nn.Linear(32, 32)
    res = DeepNormResidual(sub, 32, n_layers=6)
    x = torch.randn(4, 32)
    expected = F.layer_norm(12**0.25 * x + sub(x), (32,), res.norm.weight, res.norm.bias)
    assert torch.allclose(res(x), expected, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_rmsnorm_matches_a_float64_reference(monkeypatch, fused):
    if not fused:
        monkeypatch.delattr(F, "rms_norm", raising=False)
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 48) * 7
    x64 = x.double()
    ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    assert torch.allclose(norm(x).double(), ref, rtol=1e-5, atol=1e-6)


def test_warmup_cosine_restarts_follows_its_closed_form_per_group():
    p1, p2 = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p1], "lr": 1.0}, {"params": [p2], "lr": 0.1}], lr=1.0)
    sched = WarmupCosineRestarts(
        opt, warmup_steps=10, total_steps=110, n_cycles=2, min_lr_ratio=0.1
    )
    seen = []
    for _ in range(120):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    for step, (a, b) in enumerate(seen):
        for base, lr in ((1.0, a), (0.1, b)):
            if step < 10:
                want = base * step / 10
            elif step >= 110:
                want = 0.1 * base
            else:
                within = ((step - 10) / 100 * 2) % 1
                want = 0.1 * base + 0.9 * base * 0.5 * (1 + math.cos(math.pi * within))
            assert lr == pytest.approx(want, abs=1e-12), step
    assert seen[0][0] == 0.0 and seen[9][0] == pytest.approx(0.9) and seen[10][0] == 1.0
    assert seen[59][0] == pytest.approx(0.1, abs=0.01) and seen[60][0] == 1.0  # the restart
    state = sched.state_dict()
    again = WarmupCosineRestarts(
        opt, warmup_steps=10, total_steps=110, n_cycles=2, min_lr_ratio=0.1
    )
    again.load_state_dict(state)
    assert again.get_last_lr() == sched.get_last_lr()


def test_adaptive_clipping_follows_recent_norms_within_bounds():
    p = nn.Parameter(torch.zeros(100))
    clip = AdaptiveClipper(quantile=0.9, factor=1.5, window=50, warmup=10, max_norm=100.0)
    torch.manual_seed(0)
    for _ in range(30):
        p.grad = torch.randn(100) * 0.1  # norm about 1
        norm, threshold = clip.clip_(p)
        assert p.grad.norm() <= threshold + 1e-4
    p.grad = torch.randn(100) * 10  # a spike of about 100
    norm, threshold = clip.clip_(p)
    assert norm.item() > 50 and 1.0 < threshold.item() < 2.5
    assert p.grad.norm().item() == pytest.approx(threshold.item(), rel=1e-3)
    p.grad = torch.full((100,), float("nan"))
    clip.clip_(p)
    assert torch.isfinite(clip.history[~torch.isnan(clip.history)]).all()


def test_adaptive_clipping_by_an_ema_of_the_norms():
    p = nn.Parameter(torch.zeros(4))
    clip = AdaptiveClipper(ema=0.5, factor=2.0, window=8, warmup=2, min_norm=0.1, max_norm=50.0)
    for norm in (1.0, 3.0, 5.0):
        p.grad = torch.tensor([norm, 0.0, 0.0, 0.0])
        clip.clip_(p)
    assert clip.history[2].item() == pytest.approx(3.5)  # EMA: 1 -> 2 -> 3.5
    p.grad = torch.tensor([100.0, 0.0, 0.0, 0.0])
    _, threshold = clip.clip_(p)
    assert threshold.item() == pytest.approx(7.0) and p.grad.norm().item() == pytest.approx(7.0)


def test_agc_clips_each_unit_by_its_weight_norm():
    w = nn.Parameter(torch.tensor([[3.0, 4.0], [0.3, 0.4]]))  # unit norms 5 and 0.5
    w.grad = torch.tensor([[1.0, 0.0], [0.0, 0.001]])
    agc_([w], clipping=0.1)
    assert w.grad[0].norm().item() == pytest.approx(0.5)  # 1.0 clipped to 0.1 x 5
    assert w.grad[1].norm().item() == pytest.approx(0.001)  # under 0.1 x 0.5: kept


def test_per_expert_clipping_leaves_the_quiet_experts_alone():
    experts = [nn.Linear(4, 4), nn.Linear(4, 4)]
    for e, scale in zip(experts, (100.0, 0.01), strict=True):
        for p in e.parameters():
            p.grad = torch.full_like(p, scale)
    quiet = [p.grad.clone() for p in experts[1].parameters()]
    norms = clip_per_expert_(experts, max_norm=1.0)
    assert norms[0].item() > 100 and expert_grad_norms(experts)[0].item() == pytest.approx(
        1.0, rel=1e-4
    )
    assert all(torch.equal(p.grad, q) for p, q in zip(experts[1].parameters(), quiet, strict=True))


def test_z_loss_value_mask_and_gradient():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    want = 1e-4 * torch.logsumexp(logits, -1).square().mean()
    assert z_loss(logits).item() == pytest.approx(want.item())
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    masked = 1e-4 * torch.logsumexp(logits, -1)[mask].square().mean()
    assert z_loss(logits, mask=mask).item() == pytest.approx(masked.item())
    assert torch.autograd.gradcheck(lambda t: z_loss(t, coef=0.5, mask=mask).double(), (logits,))


def test_routing_stats_from_logits_and_assignments():
    logits = torch.tensor([[5.0, 0, 0, 0]] * 6 + [[0, 5.0, 0, 0]] * 2)
    s = routing_stats(logits, top_k=1, capacity_factor=1.0)
    assert s.load_share == [0.75, 0.25, 0.0, 0.0] and s.max_over_mean == 3.0
    assert s.dropped_fraction == pytest.approx(4 / 8)  # capacity 2 per expert: 4 of 6 dropped
    assert 0 < s.entropy_ratio < 0.2
    a = routing_stats(assignments=torch.tensor([[0, 1], [2, 3]]), n_experts=4, top_k=2)
    assert a.load_share == [0.25] * 4 and math.isnan(a.entropy)


def train_moe(balance: bool, steps: int = 400) -> tuple[list[tg.Event], float]:
    """A top-1 MoE regression on the CPU; the guard watches its routing."""
    torch.manual_seed(0)
    n, d = 4, 16
    router = nn.Linear(d, n)
    experts = nn.ModuleList(
        nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, d)) for _ in range(n)
    )
    model = nn.ModuleDict({"router": router, "experts": experts})
    balancer = LoadBalancer(n, rate=0.01) if balance else None
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False, max_grad_norm=None))
    target = torch.randn(d, d) / d**0.5
    events: list[tg.Event] = []
    share = 0.0
    for _ in range(steps):
        x = torch.randn(256, d)
        scores = router(x).softmax(-1)
        if balancer is not None:
            idx, gate = balancer.route(scores, 1)
        else:
            idx = scores.topk(1, -1).indices
            gate = scores.gather(-1, idx)
        out = torch.zeros_like(x)
        for e in range(n):
            chosen = idx[:, 0] == e
            if chosen.any():
                out[chosen] = gate[chosen] * experts[e](x[chosen])
        loss = (out - torch.tanh(x @ target)).square().mean()
        loss.backward()
        bias = balancer.bias if balancer is not None else 0.0
        stats = routing_stats(scores.detach() + bias, top_k=1)
        decision = guard.step(loss, routing=stats)
        events += decision.events
        opt.zero_grad(set_to_none=True)
        if balancer is not None:
            balancer.update(idx)
        share = stats.max_share
    return [e for e in events if e.kind == "routing_collapse"], share


def test_a_moe_router_collapses_without_the_balancer_and_stays_balanced_with_it():
    collapsed, share = train_moe(balance=False)
    assert collapsed and "of the tokens" in collapsed[0].message and share > 0.6
    balanced, share = train_moe(balance=True)
    assert balanced == [] and share < 0.45
