"""Routing health of a mixture-of-experts layer, from its router logits or its assignments."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from trainguard._torch_private import foreach_norm


@dataclass
class RoutingStats:
    """One step of a router: mean per-token routing entropy (nats; `entropy_ratio` is over its
    maximum log E), each expert's share of the assignments, max/mean load, and the tokens a
    `capacity_factor` would drop."""

    entropy: float
    entropy_ratio: float
    load_share: list[float]
    max_over_mean: float
    dropped_fraction: float

    @property
    def max_share(self) -> float:
        return max(self.load_share)

    def to_point(self) -> dict[str, float]:
        """The figures a `MetricPoint.routing` carries to the detectors."""
        return {
            "entropy": self.entropy,
            "entropy_ratio": self.entropy_ratio,
            "max_share": self.max_share,
            "max_over_mean": self.max_over_mean,
            "dropped_fraction": self.dropped_fraction,
        }

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@torch.no_grad()
def routing_stats(
    logits: torch.Tensor | None = None,
    assignments: torch.Tensor | None = None,
    n_experts: int | None = None,
    top_k: int = 1,
    capacity_factor: float = 1.25,
) -> RoutingStats:
    """Routing figures from `logits` (tokens x experts; the top-`top_k` are the assignments)
    or from `assignments` (tokens x k expert indices, with `n_experts`). One host transfer."""
    if logits is not None:
        logits = logits.reshape(-1, logits.shape[-1]).float()
        n_experts = logits.shape[-1]
        probs = logits.softmax(-1)
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1).mean()
        assignments = logits.topk(top_k, dim=-1).indices
    elif assignments is not None and n_experts is not None:
        entropy = torch.tensor(math.nan)
    else:
        raise ValueError("give router logits, or assignments and n_experts")
    assignments = assignments.reshape(assignments.shape[0], -1)
    tokens, k = assignments.shape
    counts = torch.bincount(assignments.reshape(-1), minlength=n_experts).float()
    capacity = math.ceil(capacity_factor * tokens * k / n_experts)
    dropped = (counts - capacity).clamp(min=0).sum()
    packed = torch.cat([entropy.reshape(1).to(counts.device), counts, dropped.reshape(1)])
    values = packed.tolist()
    ent, counts_host, dropped_n = values[0], values[1:-1], values[-1]
    total = sum(counts_host) or 1.0
    share = [c / total for c in counts_host]
    mean = total / n_experts
    return RoutingStats(
        entropy=ent,
        entropy_ratio=ent / math.log(n_experts) if n_experts > 1 else math.nan,
        load_share=share,
        max_over_mean=max(counts_host) / mean if mean else math.nan,
        dropped_fraction=dropped_n / total,
    )


@torch.no_grad()
def expert_grad_norms(experts: Sequence[nn.Module]) -> torch.Tensor:
    """Each expert's gradient norm (fused norms, on the device): a wide spread means some
    experts learn far faster than others."""
    grads: list[torch.Tensor] = []
    owner: list[int] = []
    for e, expert in enumerate(experts):
        for p in expert.parameters():
            if p.grad is not None:
                grads.append(p.grad)
                owner.append(e)
    if not grads:
        raise ValueError("no expert parameter has a gradient: call backward() first")
    sq = torch.stack([n.float() for n in foreach_norm(grads)]).square()
    index = torch.tensor(owner, device=sq.device)
    return torch.zeros(len(experts), device=sq.device).index_add_(0, index, sq).sqrt()
