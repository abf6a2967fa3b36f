"""The precursor probe on tiny Hugging Face GPT-2, Llama (grouped-query attention, RoPE), GPT-NeoX
(interleaved fused qkv, partial RoPE) and Qwen3 (QK-norm): max logit and entropy against the
model's own eager attention, log Z and token accuracy against its logits and labels, and the
W_q/W_k rescale."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from trainguard.actions.preempt import Preemption
from trainguard.config import PrecursorsConfig
from trainguard.signals.gradients import precursor_dict
from trainguard.signals.precursors import PrecursorProbe

transformers = pytest.importorskip("transformers")

VOCAB, T, B = 64, 12, 3


def _gpt2() -> Any:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg), "gpt2"


def _llama() -> Any:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg), "llama"


def _neox() -> Any:
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.0,
        hidden_dropout=0.0,
    )  # fmt: skip
    return transformers.GPTNeoXForCausalLM(cfg), "gpt_neox"


def _qwen3() -> Any:
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.Qwen3ForCausalLM(cfg), "qwen3"


MODELS: dict[str, Callable[[], Any]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "gpt_neox": _neox,
    "qwen3": _qwen3,
}


def _model(name: str) -> Any:
    torch.manual_seed(0)
    model, family = MODELS[name]()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # larger logits than at init, so that the comparison means something
        for n, p in model.named_parameters():
            if p.dim() == 2 and "emb" not in n and "wte" not in n and "wpe" not in n:
                p.mul_(4.0)
    model.train()
    return model, family


@contextmanager
def _eager_logits(family: str) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """(query, key, scaling) of each eager attention call of the model family: its own q and k,
    after QK-norm and RoPE."""
    module = getattr(transformers.models, family)
    modeling = getattr(module, f"modeling_{family}")
    original = modeling.eager_attention_forward
    seen: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def spy(mod: Any, query: Any, key: Any, value: Any, mask: Any, *a: Any, **kw: Any) -> Any:
        scaling = kw.get("scaling")
        if scaling is None:
            scaling = query.size(-1) ** -0.5
        seen.append((query.detach(), key.detach(), float(scaling)))
        return original(mod, query, key, value, mask, *a, **kw)

    modeling.eager_attention_forward = spy
    try:
        yield seen
    finally:
        modeling.eager_attention_forward = original


def _reference_max(query: torch.Tensor, key: torch.Tensor, scaling: float) -> float:
    h, h_kv = query.shape[1], key.shape[1]
    key = key.repeat_interleave(h // h_kv, dim=1)
    logits = query @ key.transpose(-1, -2) * scaling
    t = logits.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return float(logits.masked_fill(~causal, -math.inf).max())


def _entropy(probs: torch.Tensor) -> float:
    return float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean())


@pytest.mark.parametrize("name", list(MODELS))
def test_figures_match_the_models_own_attention_logits_and_labels(name: str) -> None:
    model, family = _model(name)
    probe = PrecursorProbe(model, PrecursorsConfig(every=1, max_sequences=B, max_queries=T))
    assert len(probe.structure.attention) == 2 and not probe.structure.missing
    x = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    labels = x.clone()
    labels[0, :4] = -100
    probe.arm(0)
    with _eager_logits(family) as seen:
        out = model(input_ids=x, labels=labels, output_attentions=True)
    taken = probe.take(0, torch.device("cpu"))
    assert taken is not None and not probe.hooked
    got = precursor_dict(probe.names, taken[0].tolist())
    assert len(seen) == 2 and out.attentions is not None
    for layer, (query, key, scaling) in enumerate(seen):
        want = _reference_max(query, key, scaling)
        assert got["max_logit"][str(layer)] == pytest.approx(want, rel=1e-4)
        assert got["attn_entropy"][str(layer)] == pytest.approx(
            _entropy(out.attentions[layer].detach()), rel=1e-4
        )
    logits = out.logits.detach()
    assert got["log_z"]["output"] == pytest.approx(
        float(torch.logsumexp(logits.float(), -1).mean()), rel=1e-5
    )
    pred, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    valid = target != -100
    want_acc = float(((pred == target) & valid).sum() / valid.sum())
    assert float(taken[1]) == pytest.approx(want_acc)
    assert set(got["block_rms"]) == {"0", "1"}


@pytest.mark.parametrize("name", list(MODELS))
def test_rescale_qk_scales_the_max_logit_of_that_layer(name: str) -> None:
    model, _ = _model(name)
    probe = PrecursorProbe(model, PrecursorsConfig(every=1, max_sequences=B, max_queries=T))
    x = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(4))

    def sample(step: int) -> dict[str, dict[str, float]]:
        probe.arm(step)
        model(input_ids=x)
        taken = probe.take(step, torch.device("cpu"))
        assert taken is not None
        return precursor_dict(probe.names, taken[0].tolist())

    before = sample(0)
    Preemption(model, probe.structure).rescale_qk(0, "0", 0.5)
    after = sample(1)
    assert after["max_logit"]["0"] == pytest.approx(0.5 * before["max_logit"]["0"], rel=1e-4)


def test_guard_records_token_accuracy_from_the_labels_of_a_sampled_step() -> None:
    import trainguard as tg
    from trainguard.config import GuardConfig

    model, _ = _model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = GuardConfig(console=False)
    cfg.precursors = PrecursorsConfig(every=2)
    guard = tg.Guard(model, opt, config=cfg)
    accuracies = []
    for i in range(3):
        x = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(i))
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        accuracies.append(guard.step(out.loss).metrics.get("token_accuracy"))
        opt.zero_grad()
    guard.close()
    assert accuracies[1] is None and 0 <= accuracies[0] <= 1 and 0 <= accuracies[2] <= 1


def test_falcons_grouped_qkv_is_left_out_and_said_its_per_head_one_read() -> None:
    from trainguard.signals.model_structure import find_structure

    def falcon(multi_query: bool) -> Any:
        cfg = transformers.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            multi_query=multi_query, new_decoder_architecture=False,
        )  # fmt: skip
        return find_structure(transformers.FalconForCausalLM(cfg))

    grouped = falcon(True)
    assert grouped.attention == [] and "q/k split of transformer.h.0" in grouped.missing[0]
    per_head = falcon(False)
    assert [(s.kind, s.n_heads) for s in per_head.attention] == [("interleaved", 4)] * 2
