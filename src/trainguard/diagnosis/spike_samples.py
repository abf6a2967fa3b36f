"""`blame_samples`: the samples of a spiking batch that carry the spike."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trainguard.detectors.stats import MAD_TO_SIGMA, median

PREVIEW_CHARS = 120


def lm_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """The standard LM loss per sample: token cross-entropy averaged over each sequence's
    counted tokens. logits (batch, time, vocab), targets (batch, time)."""
    tokens = F.cross_entropy(
        logits.transpose(1, 2).float(), targets, ignore_index=ignore_index, reduction="none"
    )
    counted = (targets != ignore_index).sum(1).clamp_min(1)
    return tokens.sum(1) / counted


@dataclass
class SpikeSample:
    """One sample blamed for a spike: its place in the batch, id, loss and robust z-score."""

    index: int
    id: Any
    loss: float
    z: float
    preview: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def blame_samples(
    losses: Sequence[float],
    ids: Sequence[Any] | None = None,
    previews: Sequence[str] | None = None,
    z_threshold: float = 5.0,
    perplexity: float | None = None,
) -> list[SpikeSample]:
    """Per-sample losses more than `z_threshold` robust deviations (median and MAD within the
    batch) above the batch median, or with a perplexity over `perplexity`; worst first."""
    finite = [x for x in losses if math.isfinite(x)]
    if not finite:
        return []
    centre = median(finite)
    spread = MAD_TO_SIGMA * median([abs(x - centre) for x in finite])
    spread = max(spread, 1e-3 * abs(centre), 1e-12)
    blamed = []
    for i, value in enumerate(losses):
        z = (value - centre) / spread if math.isfinite(value) else math.inf
        too_perplexed = perplexity is not None and (
            not math.isfinite(value) or value > math.log(perplexity)
        )
        if z > z_threshold or too_perplexed:
            preview = None
            if previews is not None and i < len(previews):
                text = str(previews[i])
                preview = text[:PREVIEW_CHARS] + ("..." if len(text) > PREVIEW_CHARS else "")
            sample_id = ids[i] if ids is not None and i < len(ids) else i
            blamed.append(SpikeSample(i, sample_id, float(value), float(z), preview))
    return sorted(blamed, key=lambda s: s.loss, reverse=True)
