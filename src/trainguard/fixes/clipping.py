"""Gradient clipping beyond a fixed threshold: adaptive (the threshold follows recent norms),
unit-wise adaptive clipping (AGC, Brock et al. 2021), and per-expert clipping for MoE. All use
fused multi-tensor norms and never sync with the host."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from trainguard._torch_private import foreach_mul_, foreach_norm


def _grads(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    return [p.grad for p in params if p.grad is not None]


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    # not torch's get_total_norm: that sums in the gradients' dtype, this in float32
    norms = foreach_norm(grads)
    return torch.stack([n.float() for n in norms]).square().sum().sqrt()


class AdaptiveClipper:
    """Clips to `factor` x the `quantile` of the last `window` grad norms (or their EMA when
    `ema` is set), kept within [`min_norm`, `max_norm`]; until `warmup` norms are seen it
    clips at `max_norm`. Norms that are non-finite never enter the history."""

    def __init__(
        self,
        quantile: float = 0.9,
        factor: float = 1.5,
        window: int = 100,
        ema: float | None = None,
        min_norm: float = 1e-3,
        max_norm: float = 10.0,
        warmup: int = 10,
    ) -> None:
        if not 0 < quantile <= 1 or factor <= 0 or min_norm > max_norm:
            raise ValueError("need 0 < quantile <= 1, factor > 0 and min_norm <= max_norm")
        self.quantile, self.factor, self.window, self.ema = quantile, factor, window, ema
        self.min_norm, self.max_norm, self.warmup = min_norm, max_norm, warmup
        self.history: torch.Tensor | None = None  # a ring of recent norms, on the device
        self.count = 0

    @torch.no_grad()
    def clip_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip the gradients in place; returns (norm before clipping, threshold), as device
        tensors."""
        grads = _grads(parameters)
        if not grads:
            raise ValueError("no parameter has a gradient: call backward() first")
        norm = _total_norm(grads)
        device = norm.device
        if self.history is None:
            self.history = torch.full((self.window,), float("nan"), device=device)
        threshold = torch.full((), float(self.max_norm), device=device)  # no host copy
        if self.count >= self.warmup:
            level = (
                self.history[(self.count - 1) % self.window]
                if self.ema is not None
                else torch.nanquantile(self.history, self.quantile)
            )
            threshold = (self.factor * level).clamp(self.min_norm, self.max_norm)
        coef = (threshold / (norm + 1e-6)).clamp(max=1.0)
        foreach_mul_(grads, coef.to(grads[0].dtype))
        finite = torch.isfinite(norm)
        value = norm
        if self.ema is not None and self.count > 0:
            last = self.history[(self.count - 1) % self.window]
            value = torch.where(torch.isnan(last), norm, (1 - self.ema) * last + self.ema * norm)
        slot = self.count % self.window
        self.history[slot] = torch.where(finite, value, self.history[slot - 1])
        self.count += 1
        return norm, threshold

    def state_dict(self) -> dict[str, object]:
        return {"history": self.history, "count": self.count}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        history = state["history"]
        self.history = history if isinstance(history, torch.Tensor) or history is None else None
        self.count = int(state["count"])  # type: ignore[call-overload]


def _unit_norms(x: torch.Tensor) -> torch.Tensor:
    """Norms of each output unit (row) of a weight; a vector or scalar is one unit."""
    if x.dim() <= 1:
        whole: torch.Tensor = x.norm().reshape(1)
        return whole
    rows: torch.Tensor = x.flatten(1).norm(dim=1)
    return rows.reshape(-1, *([1] * (x.dim() - 1)))


@torch.no_grad()
def agc_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, clipping: float = 0.01, eps: float = 1e-3
) -> None:
    """Unit-wise adaptive gradient clipping: each unit's gradient is scaled so its norm is at
    most `clipping` x max(its weight norm, `eps`) (Brock et al. 2021; leave the final
    classifier out, as they do)."""
    for p in [parameters] if isinstance(parameters, torch.Tensor) else parameters:
        if p.grad is None:
            continue
        w_norm = _unit_norms(p.detach()).clamp(min=eps)
        g_norm = _unit_norms(p.grad)
        limit = clipping * w_norm
        scale = (limit / g_norm.clamp(min=1e-6)).clamp(max=1.0)
        p.grad.mul_(scale.reshape(-1) if p.dim() <= 1 else scale)


@torch.no_grad()
def clip_per_expert_(
    experts: Sequence[nn.Module | Iterable[torch.Tensor]], max_norm: float
) -> torch.Tensor:
    """Clip each expert's gradients to `max_norm` by the expert's own norm, so one expert's
    spike does not shrink the others' updates; returns the experts' norms before clipping."""
    grads: list[torch.Tensor] = []
    owner: list[int] = []
    for e, expert in enumerate(experts):
        params = expert.parameters() if isinstance(expert, nn.Module) else expert
        for g in _grads(params):
            grads.append(g)
            owner.append(e)
    if not grads:
        raise ValueError("no expert parameter has a gradient: call backward() first")
    sq = torch.stack([n.float() for n in foreach_norm(grads)]).square()
    index = torch.tensor(owner, device=sq.device)
    norms = torch.zeros(len(experts), device=sq.device).index_add_(0, index, sq).sqrt()
    coefs = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    per_grad = coefs[index]
    foreach_mul_(grads, list(per_grad.unbind()))
    return norms
