"""`PrecursorProbe`: the precursors of divergence, measured on a sampled step.

Every `precursors.every` steps, forward hooks sit on the step's first training forward only:
per attention layer the max attention logit q.k*scale (causal mask) and the mean attention
entropy, per block the output RMS, the output log-partition log Z (the mean logsumexp of the
logits, sent with the vocabulary size) and the token accuracy (argmax == label, where the
forward got `labels=`); at the step's measurement, per layer group Adam's update-to-epsilon
ratio sqrt(mean v_hat)/eps. The
figures stay on the device as one tensor and ride in the step's one host transfer; on every
other step nothing is hooked and nothing is measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainguard._torch_private import foreach_mul_, foreach_norm
from trainguard.config import VOCAB_SIZE, PrecursorsConfig
from trainguard.distributed.context import RankContext
from trainguard.signals.gradients import NOT_MEASURED
from trainguard.signals.model_structure import (
    AttentionSite,
    ModelStructure,
    find_structure,
    unwrap,
)

SIGNALS = ("max_logit", "attn_entropy", "block_rms", "log_z", "adam_eps_ratio")
CHUNK_ELEMENTS = 1 << 24  # attention logits computed at once, at most (64 MB in float32)
IGNORE_INDEX = -100  # labels that take no part in the loss
MAX_CACHED_LENGTHS = 64  # sequence lengths whose query positions are kept


class PrecursorProbe:
    """Measures the precursors on sampled steps through forward hooks armed for that step's
    first training forward and removed after it; `take` hands the figures to the step's
    `Measurement` (agreed over the ranks by one all-gather in a distributed run)."""

    def __init__(
        self,
        model: nn.Module,
        config: PrecursorsConfig,
        optimizer: torch.optim.Optimizer | None = None,
        params: Sequence[torch.Tensor] = (),
        param_groups: Sequence[int] = (),
        group_names: Sequence[str] = (),
        ranks: RankContext | None = None,
    ) -> None:
        """`params` with `param_groups` (each one's index into `group_names`) name the layer
        groups the Adam ratio is given for."""
        self.config = config
        self.model = unwrap(model)
        self.structure: ModelStructure = find_structure(model)
        self.ranks = ranks
        self.optimizer = optimizer
        s = self.structure
        self.names: list[tuple[str, str]] = [("max_logit", a.layer) for a in s.attention]
        self.names += [("attn_entropy", a.layer) for a in s.attention]
        self.names += [("block_rms", layer) for layer, _ in s.blocks]
        if s.head is not None:  # log Z, and the vocabulary it is judged against (ln V)
            self.names += [("log_z", "output"), (VOCAB_SIZE, "output")]
        self._hook_count = len(self.names)
        self._adam = (
            AdamEpsRatio(optimizer, params, param_groups, group_names)
            if config.adam_eps_ratio and optimizer is not None and _adam_like(optimizer)
            else None
        )
        if self._adam is not None:
            self.names += [("adam_eps_ratio", g) for g in group_names]
        elif config.adam_eps_ratio and optimizer is not None:
            s.missing.append("an Adam-like optimizer (betas, eps, exp_avg_sq)")
        self._slot = {name: i for i, name in enumerate(self.names)}
        self._handles: list[RemovableHandle] = []
        self._armed: int | None = None  # the sampled step whose forward the hooks wait for
        self._active = False  # inside that forward
        self._figures: dict[int, torch.Tensor] = {}
        self._accuracy: torch.Tensor | None = None
        self._labels: torch.Tensor | None = None
        self._captured: dict[str, dict[str, Any]] = {}
        self._positions: dict[tuple[int, str], torch.Tensor] = {}
        self.rope_unseen = False  # a RoPE model whose rotation the hooks did not see

    # -- what could not be measured ------------------------------------------------------------
    def missing_message(self) -> str | None:
        """One line on what the probe could not find in the model (None: it found it all)."""
        if not self.structure.missing:
            return None
        rest = "the rest is measured" if self.names else "nothing is measured"
        return f"precursors: could not find {'; '.join(self.structure.missing)}: {rest}"

    # -- sampling --------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether `step` is sampled (never where the model offers nothing to measure)."""
        return self.config.enabled and bool(self.names) and step % self.config.every == 0

    def arm(self, step: int) -> None:
        """Hook the next training forward when `step` is a sampled one (else nothing)."""
        if self._armed == step:
            return
        self.disarm()
        self._armed = None
        if not self.due(step):
            return
        self._armed = step
        self._figures = {}
        self._accuracy = None
        self._labels = None
        self._captured = {}
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._enter, with_kwargs=True))
        self._handles.append(root.register_forward_hook(self._leave, always_call=True))
        for site in self.structure.attention:
            self._hook_attention(site)
        for layer, block in self.structure.blocks:
            self._handles.append(block.register_forward_hook(self._block_hook(layer)))
        if self.structure.head is not None:
            self._handles.append(self.structure.head.register_forward_hook(self._head_hook))

    def disarm(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._active = False
        self._captured = {}

    @property
    def hooked(self) -> bool:
        return bool(self._handles)

    def take(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """On a sampled step: the precursors (one value a name, `NOT_MEASURED` where the forward
        did not reach) and the token accuracy (NaN where unknown), as device tensors; agreed
        over the ranks (the max of each precursor, the mean accuracy). None on other steps;
        every rank takes the same steps."""
        if self._armed != step:
            return None
        self.disarm()
        self._armed = None
        missing = torch.full((), NOT_MEASURED, device=device)
        values = [
            self._figures[i].to(device, torch.float32).reshape(())
            if i in self._figures
            else missing
            for i in range(self._hook_count)
        ]
        parts = [torch.stack(values)] if values else []
        if self._adam is not None:
            parts.append(self._adam.measure(device))
        precursors = torch.cat(parts) if parts else torch.zeros(0, device=device)
        accuracy = (
            self._accuracy.to(device, torch.float32).reshape(1)
            if self._accuracy is not None
            else torch.full((1,), math.nan, device=device)
        )
        self._figures = {}
        self._accuracy = None
        if self.ranks is not None:
            precursors, accuracy = agree_over_ranks(precursors, accuracy, self.ranks)
        return precursors, accuracy

    # -- the hooks -----------------------------------------------------------------------------
    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._active or self._figures or not (module.training and torch.is_grad_enabled()):
            return  # only the step's first training forward
        self._active = True
        labels = kwargs.get("labels")
        self._labels = labels.detach() if isinstance(labels, torch.Tensor) else None

    def _leave(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._active:
            if self.structure.uses_rope and any("rope" not in c for c in self._captured.values()):
                self.rope_unseen = True
            self.disarm()  # until the step's `take`, nothing more is hooked

    def _set(self, signal: str, layer: str, value: torch.Tensor) -> None:
        slot = self._slot.get((signal, layer))
        if slot is not None and slot not in self._figures:
            self._figures[slot] = value

    def _block_hook(self, layer: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self._active:
                return
            x = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                with torch.no_grad():
                    x = x.detach()[: self.config.max_sequences].float()
                    self._set("block_rms", layer, x.square().mean().sqrt())

        return hook

    def _head_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._active:
            return
        logits = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            return
        if logits.dim() != 3:
            return
        with torch.no_grad():
            n = self.config.max_sequences
            full = logits.detach()[:n]
            t = full.shape[1]
            positions = self._query_positions(t, full.device)  # memory: (B, V) a position
            picked = full[:, positions].float()
            self._set("log_z", "output", torch.logsumexp(picked, dim=-1).mean())
            self._set(
                VOCAB_SIZE, "output", torch.full((), float(full.shape[-1]), device=full.device)
            )
            labels = self._labels
            if labels is None or labels.shape != logits.shape[:2]:
                return
            if self.structure.shift_labels:  # the logits at t predict the label at t + 1
                # the last position (t - 1, always the last of them) predicts no label
                picked, positions = picked[:, :-1], positions[:-1] + 1
            targets = labels[:n].to(full.device)[:, positions]
            self._accuracy = token_accuracy(picked, targets, shift=False)

    # -- attention -------------------------------------------------------------------------------
    def _hook_attention(self, site: AttentionSite) -> None:
        captured: dict[str, Any] = {}
        self._captured[site.path] = captured
        n = self.config.max_sequences

        def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self._active:
                return
            rope = kwargs.get("position_embeddings")
            if rope is None:
                rope = next((a for a in args if _is_rope(a)), None)
            if _is_rope(rope):
                captured["rope"] = rope
            if site.kind == "mha":
                with torch.no_grad():
                    self._measure_mha(site, args, kwargs)

        def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._active and "q" in captured and "k" in captured:
                with torch.no_grad():
                    self._measure(site, captured.pop("q"), captured.pop("k"), captured.get("rope"))

        def projection(which: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                if self._active and isinstance(output, torch.Tensor):
                    captured[which] = output.detach()[:n]

            return hook

        def fused(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._active and isinstance(output, torch.Tensor):
                with torch.no_grad():
                    q, k = split_qkv(site, output.detach()[:n])
                    if site.q_norm is not None and site.k_norm is not None:
                        q, k = _apply_norm(site.q_norm, q), _apply_norm(site.k_norm, k)
                captured["q"], captured["k"] = q, k

        handles = self._handles
        handles.append(site.module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(site.module.register_forward_hook(leave))
        if site.kind == "separate":
            assert site.q is not None and site.k is not None
            q_src = site.q_norm if site.q_norm is not None else site.q
            k_src = site.k_norm if site.k_norm is not None else site.k
            handles.append(q_src.register_forward_hook(projection("q")))
            handles.append(k_src.register_forward_hook(projection("k")))
        elif site.kind in ("fused", "interleaved"):
            assert site.q is not None
            handles.append(site.q.register_forward_hook(fused))

    def _measure(self, site: AttentionSite, q: torch.Tensor, k: torch.Tensor, rope: Any) -> None:
        b, t = q.shape[0], q.shape[1]
        q = q.reshape(b, t, site.n_heads, site.head_dim).float()
        k = k.reshape(b, k.shape[1], site.n_kv_heads, site.head_dim).float()
        if rope is not None:
            q, k = apply_rope(q, k, rope[0], rope[1])
        positions = self._query_positions(t, q.device)
        allowed = torch.arange(t, device=q.device)[None, :] <= positions[:, None]  # (P, T)
        max_logit, entropy = attention_figures(q, k, site.scale, positions, allowed, None)
        self._set("max_logit", site.layer, max_logit)
        self._set("attn_entropy", site.layer, entropy)

    def _measure_mha(
        self, site: AttentionSite, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        mha = site.module
        assert isinstance(mha, nn.MultiheadAttention)
        names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
        given = dict(zip(names, args, strict=False)) | kwargs
        query, key = given.get("query"), given.get("key")
        if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
            return
        if query.dim() == 2:  # unbatched (T, E)
            query, key = query.unsqueeze(0), key.unsqueeze(0)
        elif not mha.batch_first:
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        n = self.config.max_sequences
        query, key = query.detach()[:n], key.detach()[:n]
        w_q, w_k, b_q, b_k = mha_qk_weights(mha)
        q = nn.functional.linear(query, w_q, b_q)
        k = nn.functional.linear(key, w_k, b_k)
        b, t, s = q.shape[0], q.shape[1], k.shape[1]
        d, h = site.head_dim, site.n_heads
        q = q.reshape(b, t, h, d).float()
        k = k.reshape(b, s, h, d).float()
        positions = self._query_positions(t, q.device)
        mask = given.get("attn_mask")
        bias = None
        if given.get("is_causal") and mask is None:
            allowed = torch.arange(s, device=q.device)[None, :] <= positions[:, None]
        elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
            rows = mask.detach()[positions]
            if rows.dtype == torch.bool:
                allowed = ~rows
            else:
                allowed = torch.ones_like(rows, dtype=torch.bool)
                bias = rows.float()
        else:
            allowed = torch.ones(len(positions), s, dtype=torch.bool, device=q.device)
        max_logit, entropy = attention_figures(q, k, site.scale, positions, allowed, bias)
        self._set("max_logit", site.layer, max_logit)
        self._set("attn_entropy", site.layer, entropy)

    def _query_positions(self, t: int, device: torch.device) -> torch.Tensor:
        """At most `max_queries` query positions spread evenly over a sequence of `t`, rising,
        the first and the last among them; made on the device (no copy, no sync) and cached."""
        key = (t, str(device))
        found = self._positions.get(key)
        if found is None:
            p = min(t, self.config.max_queries)
            if p < 2:
                found = torch.full((1,), t - 1, dtype=torch.long, device=device)
            else:  # i * (t - 1) // (p - 1): strictly rising, as p <= t
                found = torch.arange(p, device=device) * (t - 1) // (p - 1)
            if len(self._positions) >= MAX_CACHED_LENGTHS:
                self._positions.clear()
            self._positions[key] = found
        return found


# -- the figures -----------------------------------------------------------------------------------


def attention_figures(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    positions: torch.Tensor,
    allowed: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The max attention logit and the mean attention entropy (nats) of queries `q` (B, T, H, D)
    at `positions` against keys `k` (B, S, Hkv, D), over the keys `allowed` (P, S) to each
    query (plus `bias`, an additive mask, where given); heads in chunks that bound the memory."""
    b, h = q.shape[0], q.shape[2]
    s, h_kv = k.shape[1], k.shape[2]
    qs = q[:, positions].transpose(1, 2)  # (B, H, P, D)
    ks = k.transpose(1, 2)  # (B, Hkv, S, D)
    group = h // h_kv
    p = qs.shape[2]
    per_head = max(1, b * p * s)
    chunk = max(1, min(h, CHUNK_ELEMENTS // per_head))
    neg = torch.full((), -math.inf, device=q.device)  # filled there: no host copy
    maxima: list[torch.Tensor] = []
    entropy_sum = torch.zeros((), device=q.device)
    for start in range(0, h, chunk):
        heads = torch.arange(start, min(h, start + chunk), device=q.device)
        kk = ks[:, heads // group]  # grouped-query attention: a kv head serves `group` heads
        logits = torch.matmul(qs[:, heads], kk.transpose(-1, -2)) * scale  # (B, h', P, S)
        if bias is not None:
            logits = logits + bias
        logits = torch.where(allowed, logits, neg)
        maxima.append(logits.amax())
        logp = torch.log_softmax(logits, dim=-1)
        plogp = torch.where(allowed, logp.exp() * logp, torch.zeros((), device=q.device))
        entropy_sum = entropy_sum - plogp.sum()
    max_logit = torch.stack(maxima).amax()
    return max_logit, entropy_sum / (b * h * p)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (B, T, H, D) as Hugging Face's rotary embedding does (halves rotated; the
    first cos.shape[-1] dimensions where the rotation is partial, as GPT-NeoX's)."""
    b, t = q.shape[0], q.shape[1]
    cos, sin = cos.detach().float(), sin.detach().float()
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    cos, sin = cos[:b, :t].unsqueeze(2), sin[:b, :t].unsqueeze(2)
    return _rotate(q, cos, sin), _rotate(k[:, :t] if k.shape[1] > t else k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def split_qkv(site: AttentionSite, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (B, T, H, D) from a fused projection's output: [q | k | v] along the features, or
    interleaved per head ([q_h | k_h | v_h] for each head h, GPT-NeoX)."""
    b, t = out.shape[0], out.shape[1]
    h, h_kv, d = site.n_heads, site.n_kv_heads, site.head_dim
    if site.kind == "interleaved":
        per_head = out.reshape(b, t, h, 3 * d)
        return per_head[..., :d], per_head[..., d : 2 * d]
    q = out[..., : h * d].reshape(b, t, h, d)
    k = out[..., h * d : (h + h_kv) * d].reshape(b, t, h_kv, d)
    return q, k


def token_accuracy(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """The share of labelled tokens (label != -100) whose argmax is the label; a causal LM's
    logits at t predict labels[t + 1] (`shift`). NaN where no token is labelled."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    labels = labels.to(logits.device)
    if labels.shape != logits.shape[:-1]:
        return torch.full((), math.nan, device=logits.device)
    valid = labels != IGNORE_INDEX
    hits = (logits.argmax(dim=-1) == labels) & valid
    return hits.sum().float() / valid.sum().float()


def mha_qk_weights(
    mha: nn.MultiheadAttention,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """W_q, W_k and their biases of an nn.MultiheadAttention (its packed in_proj, or its separate
    q/k projections where the key's width differs)."""
    e = mha.embed_dim
    if mha.in_proj_weight is not None:
        w_q, w_k = mha.in_proj_weight[:e], mha.in_proj_weight[e : 2 * e]
    else:
        w_q, w_k = mha.q_proj_weight, mha.k_proj_weight
    bias = mha.in_proj_bias
    b_q = bias[:e] if bias is not None else None
    b_k = bias[e : 2 * e] if bias is not None else None
    return w_q, w_k, b_q, b_k


def _apply_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A QK-norm over a fused projection's split q or k (B, T, H, D): per head, or over the
    whole width where its weight spans it."""
    weight = getattr(norm, "weight", None)
    b, t, h, d = x.shape
    if isinstance(weight, torch.Tensor) and weight.numel() == h * d and h > 1:
        out: torch.Tensor = norm(x.reshape(b, t, h * d)).reshape(b, t, h, d)
        return out
    out = norm(x)
    return out


def _is_rope(value: Any) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, torch.Tensor) for v in value)
    )


def _adam_like(optimizer: torch.optim.Optimizer) -> bool:
    return all("betas" in g and "eps" in g for g in optimizer.param_groups)


def agree_over_ranks(
    precursors: torch.Tensor, accuracy: torch.Tensor, ranks: RankContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's figures in one all-gather: the max of each precursor over the ranks (a NaN on
    any rank stays NaN; `NOT_MEASURED` where none measured it) and the mean token accuracy of
    the ranks that know theirs. Every rank gets the same figures."""
    device = precursors.device
    row = torch.cat([precursors, accuracy]).to(ranks.device, torch.float32)
    rows = torch.empty(ranks.world_size * row.numel(), device=ranks.device)
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(rows, row, group=ranks.group)
    return reduce_rows(rows.reshape(ranks.world_size, row.numel()).to(device))


def reduce_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of [precursors..., accuracy], one a rank, reduced as `agree_over_ranks` does."""
    precursors = rows[:, :-1].amax(dim=0)
    acc = rows[:, -1]
    known = torch.isfinite(acc)
    total = torch.where(known, acc, torch.zeros_like(acc)).sum()
    accuracy = total / known.sum()  # NaN where no rank knows its own
    return precursors, accuracy.reshape(1)


# -- Adam's update-to-epsilon ratio ------------------------------------------------------------


class AdamEpsRatio:
    """sqrt(mean v_hat)/eps per layer group (RMS of sqrt(v_hat)/eps over its parameters), from an
    Adam-like optimizer's `exp_avg_sq` with its bias correction: one fused L1 norm and a fused
    scale over the state, an index_add into the groups; near 1 or below, eps damps the step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        param_groups: Sequence[int],
        group_names: Sequence[str],
    ) -> None:
        self.optimizer = optimizer
        self.n_groups = len(group_names)
        self.layer_group = {id(p): g for p, g in zip(params, param_groups, strict=True)}
        self._layouts: dict[tuple[int, ...], _AdamLayout] = {}

    @torch.no_grad()
    def measure(self, device: torch.device) -> torch.Tensor:
        """One value a layer group (`NOT_MEASURED` where none of its parameters has state)."""
        tensors: list[torch.Tensor] = []
        steps: list[float | torch.Tensor] = []
        hyper: list[tuple[float, float]] = []  # (beta2, eps) of each
        groups: list[int] = []
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            beta2 = float(group["betas"][1])
            eps = float(group["eps"])
            for p in group["params"]:
                s = state.get(p) or {}
                v = s.get("exp_avg_sq")
                g = self.layer_group.get(id(p))
                if not isinstance(v, torch.Tensor) or g is None or eps <= 0 or "step" not in s:
                    continue
                tensors.append(v)
                steps.append(s["step"])
                hyper.append((beta2, eps))
                groups.append(g)
        on_device = counts_on_device(steps)
        if not on_device:  # torch's default: step counts on the host, read without a sync
            kept = [i for i, t in enumerate(steps) if float(t) > 0]
            tensors, steps = [tensors[i] for i in kept], [float(steps[i]) for i in kept]
            hyper, groups = [hyper[i] for i in kept], [groups[i] for i in kept]
        out = torch.full((self.n_groups,), NOT_MEASURED, device=device)
        if not tensors:
            return out
        layout = self._layout(tensors, groups, hyper, device)
        sums = list(foreach_norm(tensors, torch.float32, ord=1))  # v >= 0: the sum
        if on_device:  # a fused or capturable Adam keeps its step counts on the device
            count = torch.stack([_on(t, device) for t in steps])
            stepped = count > 0
            correction = torch.where(stepped, 1 - layout.beta2 ** count.clamp(min=1), 1.0)
            factors = torch.where(stepped, 1 / (correction * layout.eps_sq), 0.0)
            scaled = torch.stack([x.to(device) for x in sums]) * factors
            numel = layout.numel * stepped
        else:  # the factors ride as kernel arguments
            foreach_mul_(
                sums,
                [
                    1.0 / ((1.0 - b2 ** float(n)) * e * e)
                    for n, (b2, e) in zip(steps, hyper, strict=True)
                ],
            )
            scaled = torch.stack([x.to(device) for x in sums])
            numel = layout.numel
        totals = torch.zeros(self.n_groups, device=device).index_add_(0, layout.index, scaled)
        counts = torch.zeros(self.n_groups, device=device).index_add_(0, layout.index, numel)
        ratio = (totals / counts.clamp(min=1)).sqrt()
        return torch.where(counts > 0, ratio, out)

    def _layout(
        self,
        tensors: list[torch.Tensor],
        groups: list[int],
        hyper: list[tuple[float, float]],
        device: torch.device,
    ) -> _AdamLayout:
        key = tuple(id(t) for t in tensors)
        found = self._layouts.get(key)
        if found is None:
            self._layouts.clear()  # one layout at a time: the state's tensors rarely change
            found = _AdamLayout(
                index=_table(groups, device),
                numel=_table([float(t.numel()) for t in tensors], device),
                beta2=_table([b for b, _ in hyper], device),
                eps_sq=_table([e * e for _, e in hyper], device),
            )
            self._layouts[key] = found
        return found


@dataclass
class _AdamLayout:
    """Per state tensor, built once: its layer group, size, beta2 and eps squared."""

    index: torch.Tensor
    numel: torch.Tensor
    beta2: torch.Tensor
    eps_sq: torch.Tensor


def _table(values: list[int] | list[float], device: torch.device) -> torch.Tensor:
    """A layout's table on `device`, built on the host; on a GPU copied from pinned memory
    without blocking (a pageable copy would end in a sync)."""
    host = torch.tensor(values)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def counts_on_device(steps: list[float | torch.Tensor]) -> bool:
    """Whether an optimizer keeps step counts on an accelerator (fused or capturable Adam)."""
    return any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in steps)


def _on(count: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A step count as a float32 scalar on `device` (a host number filled in there: no copy)."""
    if isinstance(count, torch.Tensor):
        return count.detach().reshape(()).to(device, torch.float32)
    return torch.full((), float(count), device=device)
