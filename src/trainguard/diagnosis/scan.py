"""`scan`: look through a dataset offline for toxic samples and quarantine them for the guard."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainguard.actions.data import default_batch_ids
from trainguard.actions.quarantine import Quarantine
from trainguard.diagnosis.spike_samples import (
    MIN_EXCESS,
    RELATIVE_SPREAD,
    SpikeSample,
    blame_samples,
)
from trainguard.events import TrainguardError


@dataclass
class ScanResult:
    """The samples flagged over the whole dataset, worst first, and how many were scanned."""

    flagged: list[SpikeSample]
    scanned: int
    median_loss: float
    quarantine: Path | None = None
    losses: list[float] = field(default_factory=list, repr=False)


def scan(
    model: nn.Module,
    batches: Iterable[Any],
    per_sample_loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    ids: Callable[[Any], list[Any] | None] = default_batch_ids,
    text: Callable[[Any], list[str] | None] | None = None,
    z_threshold: float = 5.0,
    perplexity: float | None = None,
    quarantine_path: str | Path | None = None,
    min_excess: float = MIN_EXCESS,
    relative_spread: float = RELATIVE_SPREAD,
) -> ScanResult:
    """Per-sample losses of every batch (no gradients, eval mode), then the robust outlier test
    of the spike samples over the whole dataset (with its floors: `min_excess` above the median
    in loss units, the spread at least `relative_spread` x the median); flagged samples go to
    `quarantine_path`, which a Guard with that run_dir honours."""
    was_training = model.training
    model.eval()
    losses: list[float] = []
    sample_ids: list[Any] = []
    previews: list[str] = []
    try:
        with torch.no_grad():
            for batch in batches:
                values = per_sample_loss_fn(model, batch).detach().float().reshape(-1).tolist()
                batch_ids = ids(batch)
                if batch_ids is None:
                    batch_ids = list(range(len(losses), len(losses) + len(values)))
                if len(batch_ids) != len(values):
                    raise TrainguardError(
                        f"per_sample_loss_fn gave {len(values)} losses for a batch of "
                        f"{len(batch_ids)} ids: it must return one loss per sample"
                    )
                losses += values
                sample_ids += batch_ids
                if text is not None:
                    previews += text(batch) or [""] * len(values)
    finally:
        model.train(was_training)
    if not losses:
        raise TrainguardError("the dataset gave no batches to scan")
    flagged = blame_samples(
        losses,
        sample_ids,
        previews or None,
        z_threshold=z_threshold,
        perplexity=perplexity,
        min_excess=min_excess,
        relative_spread=relative_spread,
    )
    path = Path(quarantine_path) if quarantine_path is not None else None
    if path is not None and flagged:
        quarantine = Quarantine(path)
        for s in flagged:
            quarantine.add(-1, f"scan: loss {s.loss:.4g} (z={s.z:.1f})", s.loss, None, [s.id])
    ordered = sorted(losses)
    return ScanResult(flagged, len(losses), ordered[len(ordered) // 2], path, losses)
