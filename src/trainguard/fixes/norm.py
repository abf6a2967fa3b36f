"""`RMSNorm`: root-mean-square layer norm (Zhang and Sennrich 2019), no mean subtraction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last `len(shape)` dimensions; uses
    `torch.nn.functional.rms_norm` where the installed torch has it."""

    def __init__(
        self, shape: int | tuple[int, ...], eps: float = 1e-6, elementwise_affine: bool = True
    ) -> None:
        super().__init__()
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(self.shape)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        dims = tuple(range(-len(self.shape), 0))
        y = x * torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + self.eps).to(x.dtype)
        return y * self.weight if self.weight is not None else y

    def extra_repr(self) -> str:
        return f"{self.shape}, eps={self.eps}, elementwise_affine={self.weight is not None}"
