"""`z_loss`: PaLM's auxiliary loss that keeps the softmax normaliser near 1."""

from __future__ import annotations

import torch


def z_loss(
    logits: torch.Tensor, coef: float = 1e-4, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """coef x mean over positions of log(Z)^2, Z = sum(exp(logits)) over the last dimension;
    with `mask` (True where a position counts), the mean is over the kept positions. Add it
    to the loss: it stops logits drifting large, a source of late-training spikes (PaLM)."""
    wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    log_z = torch.logsumexp(wide, dim=-1)
    sq = log_z.square()
    if mask is None:
        return coef * sq.mean()
    keep = mask.to(sq.dtype)
    return coef * (sq * keep).sum() / keep.sum().clamp(min=1.0)
