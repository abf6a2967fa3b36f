"""`evaluation_results`: the evaluation results among a framework's metrics, as
`guard.evaluate` takes them."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from trainguard.analysis.logs import is_evaluation


def evaluation_results(metrics: Mapping[str, object]) -> dict[str, float]:
    """The metrics that are evaluation results (`eval_*`, `val*`, not an evaluation's runtime or
    throughput: `analysis.logs.is_evaluation`, as the log readers choose them) as floats: plain
    numbers and one-element tensors."""
    values: dict[str, float] = {}
    for name, value in metrics.items():
        if not is_evaluation(name) or isinstance(value, bool):
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            values[name] = float(value.detach().reshape(()).item())
        elif isinstance(value, (int, float)):
            values[name] = float(value)
    return values
