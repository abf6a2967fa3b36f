"""`find_structure`: a model's attention layers (with their q/k projections, QK-norms and head
counts), its blocks and its output head, found by structure, for the precursor probe and the
preemptive actions.

Recognised: separate projections (`q_proj`/`k_proj`, `query`/`key`, `q`/`k`: Llama, Mistral,
Qwen, BERT-style), fused ones split as [q | k | v] (`c_attn`, GPT-2's Conv1D; `Wqkv`, `qkv_proj`,
`in_proj`, `qkv`: nn.Linear), GPT-NeoX's `query_key_value` (q, k, v interleaved per head) and
`nn.MultiheadAttention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch import nn

from trainguard._torch_private import compiled_original

SEPARATE = (("q_proj", "k_proj"), ("query", "key"), ("q", "k"))
FUSED = ("c_attn", "Wqkv", "qkv_proj", "in_proj", "qkv")
INTERLEAVED = ("query_key_value",)
QK_NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"), ("query_norm", "key_norm"))
HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "n_heads_q")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "n_head_kv")
HEAD_DIM = ("head_dim", "head_size", "d_head", "attention_head_size")
ROPE_CONFIG = ("rope_theta", "rope_parameters", "rotary_pct", "rotary_dim", "rope_scaling")

Kind = Literal["separate", "fused", "interleaved", "mha"]


@dataclass
class AttentionSite:
    """One attention layer: where its queries and keys come from and how they are split."""

    layer: str  # the name the precursors carry: the block's index, or the module's path
    path: str
    module: nn.Module
    kind: Kind
    q: nn.Module | None  # separate: the q and k projections; fused/interleaved: the one module
    k: nn.Module | None
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float  # the logits are q.k * scale
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    transposed: bool = False  # GPT-2's Conv1D keeps its weight as (in, out)


NO_HEAD_COUNT = (
    "q/k projections found, no head count: give the module num_heads or head_dim, or the "
    "model's config num_attention_heads"
)


class Unread(NamedTuple):
    """An attention module whose q/k heads could not be read, and why."""

    path: str
    reason: str


@dataclass
class ModelStructure:
    """What `find_structure` found; `missing` says what it could not."""

    attention: list[AttentionSite] = field(default_factory=list)
    blocks: list[tuple[str, nn.Module]] = field(default_factory=list)  # (layer name, block)
    head: nn.Module | None = None
    unsized: list[str] = field(default_factory=list)  # q/k projections found, no head count
    shift_labels: bool = False  # a causal LM that predicts labels[t + 1] at position t
    uses_rope: bool = False
    missing: list[str] = field(default_factory=list)

    def site(self, layer: str) -> AttentionSite:
        """The attention layer named `layer`."""
        for site in self.attention:
            if site.layer == layer:
                return site
        known = ", ".join(s.layer for s in self.attention) or "none found"
        raise KeyError(f"no attention layer {layer!r} (layers: {known})")


def unwrap(model: nn.Module) -> nn.Module:
    """The module a DDP/FSDP wrapper (`.module`) or `torch.compile` holds, else `model`."""
    while True:
        inner = compiled_original(model)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        wrapped = getattr(model, "module", None)
        if type(model).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
            wrapped, nn.Module
        ):
            model = wrapped
            continue
        return model


def find_structure(model: nn.Module) -> ModelStructure:
    """The attention layers, blocks and output head of `model`, found by structure."""
    model = unwrap(model)
    found = ModelStructure()
    config = getattr(model, "config", None)
    unread: list[Unread] = []
    for path, module in model.named_modules():
        site = _attention_site(path, module, config)
        if site is None:
            continue
        if isinstance(site, Unread):
            unread.append(site)
            continue
        found.attention.append(site)
    found.blocks = _blocks(model, [s.path for s in found.attention])
    block_paths = {id(block): name for name, block in found.blocks}
    prefixes = _block_paths(model, block_paths)
    for site in found.attention:
        site.layer = _layer_of(site.path, prefixes)
    _unique_layers(found.attention)
    found.head = _output_head(model)
    found.shift_labels = _is_causal_lm(model)
    found.uses_rope = _uses_rope(model)
    found.unsized = [u.path for u in unread if u.reason == NO_HEAD_COUNT]
    reasons: dict[str, list[str]] = {}
    for u in unread:
        reasons.setdefault(u.reason, []).append(u.path)
    unread_note = "; ".join(
        f"the heads or q/k split of {', '.join(paths)} ({reason})"
        for reason, paths in reasons.items()
    )
    if not found.attention:
        found.missing.append(
            "an attention layer (q/k projections, fused qkv, nn.MultiheadAttention)"
            + (f"; {unread_note}" if unread else "")
        )
    elif unread:
        found.missing.append(unread_note)
    if not found.blocks:
        found.missing.append("blocks (a ModuleList of one class)")
    if found.head is None:
        found.missing.append("an output head (get_output_embeddings, a vocab-wide Linear)")
    return found


# -- blocks and layer names ---------------------------------------------------------------------


def _blocks(model: nn.Module, attention: list[str]) -> list[tuple[str, nn.Module]]:
    """The children of the largest ModuleList whose children are all of one class, among those
    that hold attention layers where any does (a MoE layer's list of experts is no stack)."""
    lists = [
        (path, list(m))
        for path, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1
    ]
    holding = [
        (path, children)
        for path, children in lists
        if any(a == path or a.startswith(path + ".") for a in attention)
    ]
    candidates = holding or lists
    best = max(candidates, key=lambda pc: len(pc[1]), default=("", []))[1]
    return [(str(i), block) for i, block in enumerate(best)]


def _block_paths(model: nn.Module, block_names: dict[int, str]) -> list[tuple[str, str]]:
    """(module path prefix, layer name) of each block, the longest paths first."""
    out = [
        (path + ".", block_names[id(m)])
        for path, m in model.named_modules()
        if id(m) in block_names
    ]
    return sorted(out, key=lambda p: -len(p[0]))


def _layer_of(path: str, prefixes: list[tuple[str, str]]) -> str:
    for prefix, name in prefixes:
        if path.startswith(prefix) or path == prefix[:-1]:
            return name
    return path or "model"


def _unique_layers(sites: list[AttentionSite]) -> None:
    """Two attention layers in one block (cross-attention) get their paths as names."""
    counts: dict[str, int] = {}
    for site in sites:
        counts[site.layer] = counts.get(site.layer, 0) + 1
    for site in sites:
        if counts[site.layer] > 1:
            site.layer = site.path


# -- attention layers ------------------------------------------------------------------------------


def _attention_site(path: str, module: nn.Module, config: object) -> AttentionSite | Unread | None:
    """The attention layer `module` is (None: it is none; `Unread`: one whose heads are not
    read)."""
    if isinstance(module, nn.MultiheadAttention):
        d = module.embed_dim // module.num_heads
        return AttentionSite(
            "", path, module, "mha", None, None, module.num_heads, module.num_heads, d,
            1 / math.sqrt(d),
        )  # fmt: skip
    children = dict(module.named_children())
    for q_name, k_name in SEPARATE:
        q, k = children.get(q_name), children.get(k_name)
        if _projection(q) and _projection(k):
            assert q is not None and k is not None
            return _separate(path, module, q, k, config)
    for name in INTERLEAVED:
        qkv = children.get(name)
        if _projection(qkv):
            assert qkv is not None
            return _fused(path, module, qkv, config, "interleaved")
    for name in FUSED:
        qkv = children.get(name)
        if _projection(qkv):
            assert qkv is not None
            return _fused(path, module, qkv, config, "fused")
    return None


def _projection(module: nn.Module | None) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and len(_shape(weight)) == 2


def _shape(weight: torch.Tensor) -> tuple[int, ...]:
    """A weight's full shape, also where DeepSpeed ZeRO-3 partitioned it (`ds_shape`)."""
    return tuple(getattr(weight, "ds_shape", None) or weight.shape)


def out_features(module: nn.Module, transposed: bool = False) -> int:
    """The output width of a projection (nn.Linear, or GPT-2's Conv1D when `transposed`)."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    shape = _shape(weight)
    return int(shape[1] if transposed else shape[0])


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _number(owners: tuple[object, ...], names: tuple[str, ...]) -> int | None:
    for owner in owners:
        if owner is None:
            continue
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _scale(module: nn.Module, head_dim: int) -> float:
    scaling = getattr(module, "scaling", None)
    if isinstance(scaling, float) and scaling > 0:
        return scaling
    return 1 / math.sqrt(head_dim)


def _qk_norms(module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    children = dict(module.named_children())
    for q_name, k_name in QK_NORMS:
        if q_name in children and k_name in children:
            return children[q_name], children[k_name]
    return None, None


def _separate(
    path: str, module: nn.Module, q: nn.Module, k: nn.Module, config: object
) -> AttentionSite | Unread:
    owners = (module, getattr(module, "config", None), config)
    q_out, k_out = out_features(q), out_features(k)
    heads = _number(owners, HEADS)
    head_dim = _number(owners, HEAD_DIM)
    if head_dim is None and heads is not None and q_out % heads == 0:
        head_dim = q_out // heads
    if head_dim is None:
        return Unread(path or "model", NO_HEAD_COUNT)
    if q_out % head_dim or k_out % head_dim:
        return Unread(path or "model", f"q/k widths {q_out}, {k_out} not a multiple of {head_dim}")
    q_norm, k_norm = _qk_norms(module)
    return AttentionSite(
        "", path, module, "separate", q, k, q_out // head_dim, k_out // head_dim, head_dim,
        _scale(module, head_dim), q_norm, k_norm,
    )  # fmt: skip


def _fused(
    path: str, module: nn.Module, qkv: nn.Module, config: object, kind: Kind
) -> AttentionSite | Unread:
    owners = (module, getattr(module, "config", None), config)
    transposed = _is_conv1d(qkv)
    total = out_features(qkv, transposed)
    heads = _number(owners, HEADS)
    if heads is None:
        return Unread(path or "model", NO_HEAD_COUNT)
    kv_heads = _number(owners, KV_HEADS) or heads
    if kind == "interleaved" and kv_heads != heads:
        # Falcon's grouped layout: not GPT-NeoX's per-head interleave
        return Unread(path or "model", "a grouped q/k/v layout (Falcon's), not read")
    width = heads + 2 * kv_heads
    if total % width:
        return Unread(path or "model", f"width {total} not a multiple of {width} heads")
    head_dim = total // width
    q_norm, k_norm = _qk_norms(module)
    return AttentionSite(
        "", path, module, kind, qkv, qkv, heads, kv_heads, head_dim, _scale(module, head_dim),
        q_norm, k_norm, transposed,
    )  # fmt: skip


# -- the output head and the labels -----------------------------------------------------------


def _output_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (NotImplementedError, AttributeError):
            head = None
        if isinstance(head, nn.Module):
            return head
    vocab = max(
        (m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=None
    )
    if vocab is None:
        return None
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == vocab]
    return heads[-1] if heads else None


def _is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face causal LM shifts its `labels` by one inside its forward."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    name = type(model).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def _uses_rope(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    if config is not None and any(getattr(config, n, None) is not None for n in ROPE_CONFIG):
        pos = getattr(config, "position_embedding_type", "rope")
        return pos in ("rope", "rotary")
    return any("rotary" in type(m).__name__.lower() for m in model.modules())
