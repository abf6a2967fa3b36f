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
MIN_EXCESS = 1.0  # a blamed sample's loss is at least this far above the median (1 nat for CE)
RELATIVE_SPREAD = 0.1  # the robust spread is at least this share of the median
EXPLAINED = 0.9  # the blamed samples hold this share of the outliers' excess over the baseline
CARRIED = 0.5  # the outliers hold at least this share of the batch's excess, or none is blamed
NOISE_Z = 3.0  # the batch's excess must pass this many of its own noise deviations
UPPER_QUANTILE, UPPER_Z = 0.9, 1.2816  # the upper tail's spread: (q90 - median) / 1.28, a normal's


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
    *,
    baseline: float | None = None,
    min_excess: float = MIN_EXCESS,
    relative_spread: float = RELATIVE_SPREAD,
) -> list[SpikeSample]:
    """The samples whose loss is an outlier of the batch, worst first: more than `z_threshold`
    robust deviations above the median and at least `min_excess` above it in the loss's own
    units, the deviation floored at `relative_spread` x the median (a fitted batch's MAD is ~0)
    and at the upper tail's own spread (a heavy right tail, such as squared errors, is no
    outlier); or non-finite, or with a perplexity over `perplexity`.

    With `baseline`, the loss level before a spike, only the outliers that explain the spike:
    the fewest, worst first, holding `EXPLAINED` of the outliers' excess over the baseline, and
    none when the outliers together hold under `CARRIED` of the batch's excess (a spike spread
    over the whole batch) or the batch is not above its baseline beyond its own noise."""
    finite = [x for x in losses if math.isfinite(x)]
    if not finite:
        return []  # every sample non-finite: the model's fault, not one sample's
    centre = median(finite)
    spread = MAD_TO_SIGMA * median([abs(x - centre) for x in finite])
    ordered = sorted(finite)
    upper = (ordered[int(UPPER_QUANTILE * (len(ordered) - 1))] - centre) / UPPER_Z
    spread = max(spread, upper, relative_spread * abs(centre), 1e-12)
    outliers: list[SpikeSample] = []
    forced: list[SpikeSample] = []  # non-finite, or over the perplexity: blamed whatever else
    for i, value in enumerate(losses):
        if not math.isfinite(value):
            forced.append(_sample(i, losses, ids, previews, math.inf))
            continue
        z = (value - centre) / spread
        if perplexity is not None and value > math.log(perplexity):
            forced.append(_sample(i, losses, ids, previews, z))
        elif z > z_threshold and value - centre >= min_excess:
            outliers.append(_sample(i, losses, ids, previews, z))
    outliers.sort(key=lambda s: s.loss, reverse=True)
    if baseline is not None and outliers:
        outliers = _explaining(outliers, finite, baseline, spread)
    return sorted(forced + outliers, key=lambda s: s.loss, reverse=True)


def _explaining(
    outliers: list[SpikeSample], finite: list[float], baseline: float, spread: float
) -> list[SpikeSample]:
    """The fewest outliers (worst first) that explain the batch's excess over `baseline`."""
    batch_excess = sum(x - baseline for x in finite)
    if batch_excess <= NOISE_Z * math.sqrt(len(finite)) * spread:
        return []  # the batch is not above its baseline beyond its own sample noise
    excess = [max(s.loss - baseline, 0.0) for s in outliers]
    if sum(excess) < CARRIED * batch_excess:
        return []  # the spike is spread over the batch: these outliers do not carry it
    held = 0.0
    for count, value in enumerate(excess, start=1):
        held += value
        if held >= EXPLAINED * sum(excess):
            return outliers[:count]
    return outliers


def _sample(
    i: int,
    losses: Sequence[float],
    ids: Sequence[Any] | None,
    previews: Sequence[str] | None,
    z: float,
) -> SpikeSample:
    preview = None
    if previews is not None and i < len(previews):
        text = str(previews[i])
        preview = text[:PREVIEW_CHARS] + ("..." if len(text) > PREVIEW_CHARS else "")
    sample_id = ids[i] if ids is not None and i < len(ids) else i
    return SpikeSample(i, sample_id, float(losses[i]), float(z), preview)
