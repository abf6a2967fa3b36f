"""Distributed runs: the ranks' context, the one per-step exchange, and the DDP hook that sees
each rank's gradients before they are reduced."""

from trainguard.distributed.context import RankContext, init_process_group
from trainguard.distributed.exchange import LocalGradNorm, StepExchange, local_grad_norm_hook

__all__ = [
    "LocalGradNorm",
    "RankContext",
    "StepExchange",
    "init_process_group",
    "local_grad_norm_hook",
]
