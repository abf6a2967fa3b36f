"""`LoadBalancer`: auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias on the
router scores, used only to choose experts, nudged against the load imbalance each step."""

from __future__ import annotations

import torch
from torch import nn


class LoadBalancer(nn.Module):
    """`route(scores, k)` picks each token's top-k experts by `scores + bias` and gates them by
    the unbiased scores; `update(indices)` then moves each expert's bias by `rate` towards
    balance: down for experts above the mean load, up for those below."""

    def __init__(self, n_experts: int, rate: float = 1e-3) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.rate = rate
        self.bias: torch.Tensor
        self.register_buffer("bias", torch.zeros(n_experts))

    def route(self, scores: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert indices, gate weights) of each token; weights sum to 1 over its k experts."""
        indices = (scores + self.bias).topk(k, dim=-1).indices
        gates = scores.gather(-1, indices).softmax(-1)
        return indices, gates

    @torch.no_grad()
    def update(self, indices: torch.Tensor) -> None:
        """One step of the bias update from the step's assignments (on the device, no sync)."""
        counts = torch.bincount(indices.reshape(-1), minlength=self.n_experts).float()
        self.bias.add_(self.rate * torch.sign(counts.mean() - counts))
