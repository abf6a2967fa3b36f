"""Initialisations that keep deep transformers trainable: GPT-2-style scaled residual init and
DeepNet's DeepNorm (Wang et al. 2022) with its residual module."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
from torch import nn

from trainguard.diagnosis.lint import RESIDUAL_OUT

# Attention projections DeepNet scales by beta (values and output); queries and keys keep gain 1.
DEEPNORM_SCALED = re.compile(
    r"(^|\.)(v_proj|value|out_proj|o_proj|c_proj|proj|dense|fc1|fc2|w1|w2|w3|up_proj|down_proj"
    r"|gate_proj|mlp\.\d+)\.weight$"
)


def _matches(name: str, patterns: Sequence[str | re.Pattern[str]]) -> bool:
    return any(re.search(p, name) for p in patterns)


@torch.no_grad()
def scaled_init_(
    model: nn.Module,
    n_layers: int,
    std: float = 0.02,
    residual_patterns: Sequence[str | re.Pattern[str]] = (RESIDUAL_OUT,),
) -> list[str]:
    """normal(0, `std`) for Linear and Embedding weights, zero biases, and std/sqrt(2 n_layers)
    for the residual output projections (names matching `residual_patterns`, by default the
    common GPT/Llama names); returns the names of those scaled down."""
    if n_layers < 1:
        raise ValueError("n_layers must be at least 1")
    scaled: list[str] = []
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, std)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                nn.init.zeros_(bias)
    for name, param in model.named_parameters():
        if name.endswith("weight") and param.dim() >= 2 and _matches(name, residual_patterns):
            nn.init.normal_(param, 0.0, std / math.sqrt(2 * n_layers))
            scaled.append(name)
    return scaled


def deepnorm_constants(n_layers: int) -> tuple[float, float]:
    """DeepNet's (alpha, beta) for a decoder-only stack of `n_layers` blocks:
    alpha = (2N)^(1/4) multiplies the residual, beta = (8N)^(-1/4) is the init gain."""
    if n_layers < 1:
        raise ValueError("n_layers must be at least 1")
    return (2 * n_layers) ** 0.25, (8 * n_layers) ** -0.25


@torch.no_grad()
def deepnorm_init_(
    model: nn.Module,
    n_layers: int,
    scaled_patterns: Sequence[str | re.Pattern[str]] = (DEEPNORM_SCALED,),
) -> list[str]:
    """Xavier-normal init for every Linear, with gain beta = (8N)^(-1/4) for the feed-forward
    and the attention value and output projections (`scaled_patterns`), gain 1 for the rest;
    zero biases. Use with `DeepNormResidual`. Returns the names scaled by beta."""
    _, beta = deepnorm_constants(n_layers)
    scaled: list[str] = []
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        name = f"{module_name}.weight"
        gain = beta if _matches(name, scaled_patterns) else 1.0
        nn.init.xavier_normal_(module.weight, gain=gain)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
        if gain != 1.0:
            scaled.append(name)
    return scaled


class DeepNormResidual(nn.Module):
    """x -> LayerNorm(alpha x + sublayer(x)) with alpha = (2N)^(1/4): DeepNorm's post-LN
    residual, which keeps post-LN stable at hundreds of layers."""

    def __init__(self, sublayer: nn.Module, d_model: int, n_layers: int, eps: float = 1e-5):
        super().__init__()
        self.sublayer = sublayer
        self.alpha, _ = deepnorm_constants(n_layers)
        self.norm = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.alpha * x + self.sublayer(x))
        return out
