"""The precursor probe on trainguard's TinyGPT, nn.MultiheadAttention and a model without
attention; the Measurement plumbing; the preemptive actions (W_q/W_k rescale, z-loss)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg
from trainguard.actions.preempt import Preemption
from trainguard.config import GuardConfig, PrecursorsConfig
from trainguard.demo.model import TinyGPT, TinyGPTConfig
from trainguard.events import ConfigError, EventKind, TrainguardError
from trainguard.signals.gradients import NOT_MEASURED, precursor_dict
from trainguard.signals.model_structure import find_structure
from trainguard.signals.precursors import PrecursorProbe, reduce_rows

from helpers import read_jsonl


def _config(every: int = 1, **precursors: Any) -> GuardConfig:
    cfg = GuardConfig(console=False)
    cfg.precursors = PrecursorsConfig(every=every, **precursors)
    return cfg


def _tiny(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(TinyGPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32))


def _batch(seed: int = 1, b: int = 3, t: int = 16) -> torch.Tensor:
    return torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))


def _attention_inputs(model: TinyGPT, x: torch.Tensor) -> list[torch.Tensor]:
    """The input of each block's attention in a forward of `model` on `x`."""
    seen: list[torch.Tensor] = []
    handles = [
        block.attn.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
        for block in model.blocks
    ]
    model(x)
    for h in handles:
        h.remove()
    return seen


def _reference(model: TinyGPT, x: torch.Tensor) -> tuple[list[float], list[float]]:
    """Max causal attention logit and mean attention entropy per layer, computed directly."""
    maxima, entropies = [], []
    with torch.no_grad():
        for block, h in zip(model.blocks, _attention_inputs(model, x), strict=True):
            b, t, c = h.shape
            q, k, _ = block.attn.qkv(h).split(c, dim=2)
            nh = block.attn.n_head
            q = q.view(b, t, nh, c // nh).transpose(1, 2)
            k = k.view(b, t, nh, c // nh).transpose(1, 2)
            logits = q @ k.transpose(-1, -2) / math.sqrt(c // nh)
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            masked = logits.masked_fill(~causal, -math.inf)
            maxima.append(float(masked.max()))
            p = masked.softmax(-1)
            ent = -(p * p.clamp_min(1e-30).log()).masked_fill(~causal, 0).sum(-1)
            entropies.append(float(ent.mean()))
    return maxima, entropies


def _probe(model: nn.Module, **cfg: Any) -> PrecursorProbe:
    return PrecursorProbe(model, PrecursorsConfig(**cfg))


def _sample(probe: PrecursorProbe, forward: Any, step: int = 0) -> dict[str, dict[str, float]]:
    probe.arm(step)
    forward()
    taken = probe.take(step, torch.device("cpu"))
    assert taken is not None
    return precursor_dict(probe.names, taken[0].tolist())


# -- structure and figures ------------------------------------------------------------------------


def test_finds_tiny_gpt_fused_qkv_blocks_and_head() -> None:
    model = _tiny()
    found = find_structure(model)
    assert [s.layer for s in found.attention] == ["0", "1"]
    site = found.attention[0]
    assert (site.kind, site.n_heads, site.n_kv_heads, site.head_dim) == ("fused", 2, 2, 16)
    assert [name for name, _ in found.blocks] == ["0", "1"]
    assert found.head is model.head and not found.missing


def test_max_logit_entropy_block_rms_and_log_z_match_direct_computation() -> None:
    model = _tiny()
    model.train()
    x = _batch()
    want_max, want_entropy = _reference(model, x)
    probe = _probe(model, max_sequences=8, max_queries=64)
    got = _sample(probe, lambda: model(x))
    for layer in ("0", "1"):
        assert got["max_logit"][layer] == pytest.approx(want_max[int(layer)], rel=1e-5)
        assert got["attn_entropy"][layer] == pytest.approx(want_entropy[int(layer)], rel=1e-5)
    outputs: list[torch.Tensor] = []
    handles = [b.register_forward_hook(lambda m, a, o: outputs.append(o)) for b in model.blocks]
    with torch.no_grad():
        logits = model(x)
    for h in handles:
        h.remove()
    for i, out in enumerate(outputs):
        assert got["block_rms"][str(i)] == pytest.approx(
            float(out.square().mean().sqrt()), rel=1e-5
        )
    want_z = float(torch.logsumexp(logits, -1).mean())
    assert got["log_z"]["output"] == pytest.approx(want_z, rel=1e-5)


def test_subsampled_queries_and_sequences_bound_the_full_figures() -> None:
    model = _tiny()
    x = _batch(b=6)
    want_max, _ = _reference(model, x)
    probe = _probe(model, max_sequences=2, max_queries=4)
    got = _sample(probe, lambda: model(x))
    want_sub, _ = _reference(model, x[:2])
    for layer in ("0", "1"):  # 4 of 16 queries of 2 of 6 sequences: at most the full figure
        assert got["max_logit"][layer] <= want_sub[int(layer)] + 1e-6
        assert got["max_logit"][layer] <= want_max[int(layer)] + 1e-6
    cpu = torch.device("cpu")
    for t, cap in ((16, 4), (16, 16), (100, 7), (5, 128), (1, 4)):
        positions = _probe(model, max_queries=cap)._query_positions(t, cpu).tolist()
        assert len(positions) == min(t, cap) and positions[-1] == t - 1 and positions[0] == 0
        assert positions == sorted(set(positions))  # rising, each once


def test_multihead_attention_with_causal_mask_matches_its_weights() -> None:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 24)
            self.layers = nn.ModuleList(
                nn.MultiheadAttention(24, 3, batch_first=True) for _ in "ab"
            )
            self.out = nn.Linear(24, 50)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = self.emb(idx)
            t = idx.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            for layer in self.layers:
                h = h + layer(h, h, h, attn_mask=mask, need_weights=False)[0]
            out: torch.Tensor = self.out(h)
            return out

    net = Net()
    x = torch.randint(0, 50, (2, 10))
    got = _sample(_probe(net, max_queries=64), lambda: net(x))
    h = net.emb(x).detach()
    mask = torch.ones(10, 10, dtype=torch.bool).triu(1)
    with torch.no_grad():
        _, weights = net.layers[0](h, h, h, attn_mask=mask, average_attn_weights=False)
    entropy = -(weights * weights.clamp_min(1e-30).log()).sum(-1).mean()
    assert got["attn_entropy"]["0"] == pytest.approx(float(entropy), rel=1e-4)
    layer = net.layers[0]
    with torch.no_grad():
        want = _mha_max_logit(layer, h, mask)
    assert got["max_logit"]["0"] == pytest.approx(float(want), rel=1e-5)
    Preemption(net).rescale_qk(0, "0", 0.25)  # the packed in_proj's q and k rows, and biases
    with torch.no_grad():
        assert float(_mha_max_logit(layer, h, mask)) == pytest.approx(0.25 * float(want), rel=1e-5)


def _mha_max_logit(
    layer: nn.MultiheadAttention, h: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    q = F.linear(h, layer.in_proj_weight[:24], layer.in_proj_bias[:24]).view(2, 10, 3, 8)
    k = F.linear(h, layer.in_proj_weight[24:48], layer.in_proj_bias[24:48]).view(2, 10, 3, 8)
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8)
    return logits.masked_fill(mask, -math.inf).max()


def test_reduce_rows_takes_the_max_precursor_and_the_mean_known_accuracy() -> None:
    rows = torch.tensor(
        [
            [1.0, NOT_MEASURED, 3.0, 0.5],
            [2.0, NOT_MEASURED, math.nan, math.nan],
            [0.5, NOT_MEASURED, 1.0, 0.7],
        ]
    )
    precursors, accuracy = reduce_rows(rows)
    assert precursors[0] == 2.0 and precursors[1] == NOT_MEASURED
    assert math.isnan(precursors[2])  # a non-finite layer on any rank stays visible
    assert float(accuracy) == pytest.approx(0.6)
    assert precursor_dict([("a", "0"), ("a", "1"), ("b", "0")], precursors.tolist()).keys() == {
        "a",
        "b",
    }


# -- in the guard ---------------------------------------------------------------------------------


def _train(guard: tg.Guard, model: TinyGPT, steps: int, **step_kwargs: Any) -> list[Any]:
    out = []
    for i in range(steps):
        x = _batch(seed=i)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
        loss.backward()
        out.append(guard.step(loss, **step_kwargs))
        guard.optimizer.zero_grad()  # type: ignore[union-attr]
    return out


def test_guard_samples_every_n_steps_and_hooks_nothing_between(tmp_path: Path) -> None:
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = tg.Guard(model, opt, config=_config(every=3), run_dir=tmp_path)
    hooked: list[bool] = []
    for _ in range(7):
        hooked.append(any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()))
        _train(guard, model, 1)
    guard.close()
    assert hooked == [i % 3 == 0 for i in range(7)]
    lines = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "step" in r]
    sampled = [r["step"] for r in lines if "precursors" in r]
    assert sampled == [0, 3, 6]
    assert set(lines[3]["precursors"]) == {
        "max_logit",
        "attn_entropy",
        "block_rms",
        "log_z",
        "vocab_size",  # sent beside log Z: the logits' last dimension
        "adam_eps_ratio",
    }
    assert "adam_eps_ratio" not in lines[0]["precursors"]  # no optimizer state before step 0


def test_only_the_first_training_forward_of_a_sampled_step_is_measured() -> None:
    model = _tiny()
    probe = _probe(model)
    x, y = _batch(seed=1), _batch(seed=2)
    probe.arm(0)
    with torch.no_grad():
        model(y)  # an evaluation forward: not measured
    model(x)
    assert not probe.hooked  # removed after the sampled forward
    model(y)  # a second micro-batch: not measured
    taken = probe.take(0, torch.device("cpu"))
    assert taken is not None
    want_max, _ = _reference(model, x)
    got = precursor_dict(probe.names, taken[0].tolist())
    assert got["max_logit"]["0"] == pytest.approx(want_max[0], rel=1e-5)
    assert probe.take(1, torch.device("cpu")) is None


def test_adam_eps_ratio_matches_the_optimizer_state() -> None:
    model = _tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-6)
    guard = tg.Guard(model, opt, config=_config(every=2))
    decisions = _train(guard, model, 3)
    got = decisions[2].metrics["precursors"]["adam_eps_ratio"]
    head = model.head.weight
    # the state as it was when step 2 measured it: after the update of step 1
    state = opt.state[head]
    assert float(state["step"]) == 3  # the update of step 2 came after the measurement
    guard.close()
    model2 = _tiny()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-6)
    guard2 = tg.Guard(model2, opt2, config=_config(every=100))
    _train(guard2, model2, 2)
    guard2.close()
    v = opt2.state[model2.head.weight]["exp_avg_sq"] / (1 - 0.99**2)
    assert got["head"] == pytest.approx(float(v.mean().sqrt() / 1e-6), rel=1e-4)


def test_token_accuracy_passed_in_is_recorded_and_overrides(tmp_path: Path) -> None:
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = tg.Guard(model, opt, config=_config(every=1), run_dir=tmp_path)
    d = _train(guard, model, 1, token_accuracy=0.25)[0]
    assert d.metrics["token_accuracy"] == 0.25
    d = _train(guard, model, 1, token_accuracy=torch.tensor(0.5))[0]
    assert d.metrics["token_accuracy"] == 0.5
    guard.close()
    with tg.Monitor(GuardConfig(console=False)) as monitor:
        assert monitor.observe(0, loss=1.0, token_accuracy=0.75).metrics["token_accuracy"] == 0.75


def test_a_model_without_attention_is_measured_where_it_can_and_said_once(
    tmp_path: Path,
) -> None:
    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(40, 16)
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.out = nn.Linear(16, 40)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for layer in self.layers:
                h = h + torch.tanh(layer(h))
            out: torch.Tensor = self.out(h)
            return out

    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = tg.Guard(model, opt, config=_config(every=1), run_dir=tmp_path)
    for i in range(3):
        x = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(i))
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        d = guard.step(loss)
        opt.zero_grad()
    guard.close()
    assert set(d.metrics["precursors"]) == {"block_rms", "log_z", "vocab_size", "adam_eps_ratio"}
    assert d.metrics["precursors"]["vocab_size"] == {"output": 40.0}  # log Z's reference, ln 40
    notes = [
        e
        for e in read_jsonl(tmp_path / "events.jsonl")
        if e["kind"] == EventKind.LINT and "precursors" in e["message"]
    ]
    assert len(notes) == 1 and notes[0]["severity"] == "info"
    assert "an attention layer" in notes[0]["message"]


def test_config_section_is_validated() -> None:
    assert GuardConfig().precursors.every == 50
    with pytest.raises(ConfigError, match=r"precursors\.every"):
        GuardConfig.from_dict({"precursors": {"every": 0}})
    with pytest.raises(ConfigError, match=r"precursors\.max_queries"):
        GuardConfig.from_dict({"precursors": {"max_queries": -1}})
    cfg = _config()
    cfg.precursors.enabled = False
    guard = tg.Guard(_tiny(), torch.optim.SGD(_tiny().parameters(), lr=0.1), config=cfg)
    assert guard.probe is None and guard.preemption is not None
    guard.close()


# -- preemption -----------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.5, 0.25])
def test_rescale_qk_scales_the_measured_max_logit_by_the_factor(factor: float) -> None:
    model = _tiny()
    x = _batch()
    probe = _probe(model, every=1)
    before = _sample(probe, lambda: model(x), step=0)
    event = Preemption(model).rescale_qk(7, "1", factor)
    after = _sample(probe, lambda: model(x), step=1)
    assert event.kind == EventKind.PREEMPTION and event.metrics["layer"] == "1"
    assert after["max_logit"]["1"] == pytest.approx(before["max_logit"]["1"] * factor, rel=1e-4)
    assert after["max_logit"]["0"] == pytest.approx(before["max_logit"]["0"], rel=1e-6)


def test_rescale_qk_rejects_a_bad_factor_or_layer() -> None:
    preemption = Preemption(_tiny())
    with pytest.raises(TrainguardError, match="factor"):
        preemption.rescale_qk(0, "0", 0.0)
    with pytest.raises(TrainguardError, match="no attention layer '9'"):
        preemption.rescale_qk(0, "9", 0.5)


def test_z_loss_gradient_equals_that_of_the_loss_plus_weighted_log_z_squared() -> None:
    weight = 0.3
    x = _batch()
    model = _tiny()
    preemption = Preemption(model)
    event = preemption.enable_z_loss(0, weight)
    assert event.kind == EventKind.PREEMPTION
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    hooked = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    preemption.disable_z_loss(1)
    reference = _tiny()
    logits = reference(x)
    z = torch.logsumexp(logits, -1)
    (F.cross_entropy(logits.flatten(0, 1), x.flatten()) + weight * z.square().mean()).backward()
    for name, p in reference.named_parameters():
        assert torch.allclose(hooked[name], p.grad, rtol=1e-4, atol=1e-7), name
    model.zero_grad()
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()  # off again: plain loss
    plain = _tiny()
    F.cross_entropy(plain(x).flatten(0, 1), x.flatten()).backward()
    assert torch.allclose(model.head.weight.grad, plain.head.weight.grad, atol=1e-7)
    with torch.no_grad():  # no z-loss function on an evaluation forward
        assert model(x).grad_fn is None


def test_preemption_state_round_trips_through_the_guard_state(tmp_path: Path) -> None:
    cfg = _config()
    cfg.precursors.enabled = False  # the head's only hook is z-loss's
    model = _tiny()
    guard = tg.Guard(model, torch.optim.AdamW(model.parameters()), config=cfg)
    assert guard.preemption is not None
    guard.preemption.enable_z_loss(3, 1e-3)
    guard.preemption.rescale_qk(4, "0", 0.5)
    state = guard.state_dict()
    guard.close()
    assert state["preemption"]["z_loss_weight"] == 1e-3
    fresh_model = _tiny()
    fresh = tg.Guard(fresh_model, torch.optim.AdamW(fresh_model.parameters()), config=cfg)
    fresh.load_state_dict(state)
    assert fresh.preemption is not None
    assert fresh.preemption.z_loss_weight == 1e-3
    assert fresh.preemption.rescales == [{"step": 4, "layer": "0", "factor": 0.5}]
    assert fresh_model.head._forward_hooks  # z-loss is on again
    state["preemption"]["z_loss_weight"] = None
    fresh.load_state_dict(state)
    assert fresh.preemption.z_loss_weight is None and not fresh_model.head._forward_hooks
    fresh.close()


def test_analyze_reads_the_precursors_of_a_guarded_run(tmp_path: Path) -> None:
    from trainguard.analysis.logs import read_log

    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = tg.Guard(model, opt, config=_config(every=2), run_dir=tmp_path)
    live = [d.metrics for d in _train(guard, model, 5, token_accuracy=0.5)]
    guard.close()
    series = read_log(tmp_path).series()
    points = [series.point(i) for i in range(len(series))]
    assert [p.step for p in points] == [0, 1, 2, 3, 4]
    for point, record in zip(points, live, strict=True):
        assert point.precursors == record.get("precursors")
    assert [r["token_accuracy"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "step" in r] == [
        0.5
    ] * 5
    assert [p.precursors is not None for p in points] == [True, False, True, False, True]


def _packed_after_extra(m: Any) -> None:
    m.extra = torch.tensor([7.0, 8.0])
    m.precursors = torch.tensor([1.5, NOT_MEASURED, math.nan])
    m.precursor_names = [("max_logit", "0"), ("max_logit", "1"), ("block_rms", "0")]
    m.token_accuracy = torch.tensor([0.25])


def test_both_resolvers_read_extra_then_precursors_then_token_accuracy() -> None:
    from trainguard.signals.gradients import GradientStats

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(
        [{"params": [model.weight], "lr": torch.tensor(0.1)}, {"params": [model.bias], "lr": 0.2}]
    )
    model(torch.ones(1, 3)).sum().backward()
    stats = GradientStats(model, opt, [r"^(?P<group>[^.]+)"])
    m = stats.measure(torch.tensor(1.0), opt)
    _packed_after_extra(m)
    signals = stats.resolve(m)
    assert signals.lrs == pytest.approx([0.1, 0.2]) and signals.extra == [7.0, 8.0]
    assert signals.token_accuracy == 0.25
    assert signals.precursors is not None
    assert signals.precursors["max_logit"] == {"0": 1.5}  # "1" was not measured
    assert math.isnan(signals.precursors["block_rms"]["0"])  # a NaN measured stays


def test_the_deepspeed_resolver_reads_them_after_extra_too() -> None:
    pytest.importorskip("deepspeed")
    from trainguard.integrations.deepspeed import ZeroGradients
    from trainguard.signals.gradients import Measurement

    zero = ZeroGradients.__new__(ZeroGradients)  # resolve reads the engine only on a NaN step
    m = Measurement(
        total_norm=torch.tensor(2.0),
        head=torch.tensor([1.0, 2.0, 0.0, 0.0, 0.0]),
        first=torch.zeros(0),
        group_norms=torch.tensor([2.0]),
        tail=[],
        present=None,
        n_first=0,
        lrs=[0.1],
        has_scaler=False,
        pending_step=None,
    )
    _packed_after_extra(m)
    signals = zero.resolve(m)
    assert signals.extra == [7.0, 8.0] and signals.token_accuracy == 0.25
    assert signals.precursors is not None and signals.precursors["max_logit"] == {"0": 1.5}


def test_observe_takes_precursors_of_your_own(tmp_path: Path) -> None:
    with tg.Monitor(GuardConfig(console=False), run_dir=tmp_path) as monitor:
        d = monitor.observe(0, loss=1.0, precursors={"max_logit": {"0": 12}})
        assert d.metrics["precursors"] == {"max_logit": {"0": 12.0}}
        with pytest.raises(TrainguardError, match=r"observe\(precursors=\.\.\.\) takes"):
            monitor.observe(1, loss=1.0, precursors={"max_logit": 3.0})  # type: ignore[dict-item]
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["precursors"] == {"max_logit": {"0": 12.0}}


class _Rotary(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, half = x.shape[1], x.shape[-1] // 2
        angle = torch.arange(t, dtype=x.dtype)[:, None, None] * 0.3
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)


class _RotatingAttention(nn.Module):
    """Llama-like projections, rotating q and k itself (no `position_embeddings` argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = 2, 8
        self.q_proj, self.k_proj = nn.Linear(16, 16), nn.Linear(16, 16)
        self.v_proj, self.o_proj = nn.Linear(16, 16), nn.Linear(16, 16)
        self.rotary = _Rotary()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 2, 8) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, 16))
        return out


def test_rotation_inside_the_attention_module_is_said_once(tmp_path: Path) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(30, 16)
            self.layers = nn.ModuleList(_RotatingAttention() for _ in range(2))
            self.lm_head = nn.Linear(16, 30)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for layer in self.layers:
                h = h + layer(h)
            out: torch.Tensor = self.lm_head(h)
            return out

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    guard = tg.Guard(net, opt, config=_config(every=1), run_dir=tmp_path)
    for i in range(3):
        x = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(i))
        loss = F.cross_entropy(net(x).flatten(0, 1), x.flatten())
        loss.backward()
        d = guard.step(loss)
        opt.zero_grad()
    guard.close()
    assert set(d.metrics["precursors"]["max_logit"]) == {"0", "1"}
    notes = [
        e["message"]
        for e in read_jsonl(tmp_path / "events.jsonl")
        if e["kind"] == EventKind.LINT and "rotary" in e["message"]
    ]
    assert len(notes) == 1 and "before the rotation" in notes[0]


def test_blocks_are_the_stack_that_holds_the_attention_not_a_longer_list_of_experts() -> None:
    class MoeBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = _RotatingAttention()
            self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(MoeBlock() for _ in range(2))

    found = find_structure(Net())
    assert [name for name, _ in found.blocks] == ["0", "1"]
    assert all(isinstance(block, MoeBlock) for _, block in found.blocks)
    assert [s.layer for s in found.attention] == ["0", "1"]


def test_adam_eps_ratio_reads_step_counts_kept_on_the_device_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fused or capturable Adam keeps its step counts on the accelerator: they are read there
    (no sync), to the same figures."""
    import trainguard.signals.precursors as precursors

    model = _tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    for i in range(3):
        x = _batch(seed=i)
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
    params = list(model.parameters())
    ratio = precursors.AdamEpsRatio(
        opt, params, list(range(len(params))), [str(i) for i in range(len(params))]
    )
    host = ratio.measure(torch.device("cpu"))
    monkeypatch.setattr(precursors, "counts_on_device", lambda steps: True)
    device = precursors.AdamEpsRatio(
        opt, params, list(range(len(params))), [str(i) for i in range(len(params))]
    )
    assert torch.allclose(device.measure(torch.device("cpu")), host, rtol=1e-5)
    v = opt.state[params[0]]["exp_avg_sq"] / (1 - 0.999**3)
    assert float(host[0]) == pytest.approx(float((v.mean() / 1e-14).sqrt()), rel=1e-4)


class _UnsizedAttention(nn.Module):
    """q/k/v projections like Llama's, but no head count anywhere: it cannot be measured."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        out: torch.Tensor = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out


def test_attention_without_a_head_count_is_a_warning_that_says_what_to_set(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Embedding(64, 16), nn.ModuleList([_UnsizedAttention(16)]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, config=_config(every=1), run_dir=tmp_path)
    guard.close()
    (note,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if "precursors:" in e["message"]]
    assert note["severity"] == "warning"
    assert "q/k split of 1.0 (q/k projections found, no head count" in note["message"]
    assert "num_heads or head_dim" in note["message"]
    # a model with no attention at all is told so quietly (not every model is a transformer)
    plain = nn.Sequential(nn.Linear(4, 4))
    tg.Guard(
        plain, torch.optim.SGD(plain.parameters(), lr=0.1), config=_config(), run_dir=tmp_path / "p"
    ).close()
    (quiet,) = [
        e for e in read_jsonl(tmp_path / "p" / "events.jsonl") if "precursors:" in e["message"]
    ]
    assert quiet["severity"] == "info" and "nothing is measured" in quiet["message"]
