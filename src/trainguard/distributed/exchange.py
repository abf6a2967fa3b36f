"""`StepExchange`: the guard's one collective per step, an all-gather of a small per-rank vector;
and `local_grad_norm_hook`, a DDP communication hook that measures each rank's gradients before
they are averaged."""

import time

import torch
import torch.distributed as dist

from trainguard.distributed.context import RankContext


class StepExchange:
    """Gathers every rank's vector of step figures into a (world, k) tensor on every rank."""

    def __init__(self, context: RankContext) -> None:
        self.context = context
        self.calls = 0  # collectives made, for tests and benchmarks

    def gather(self, vector: torch.Tensor) -> torch.Tensor:
        ctx = self.context
        local = vector.detach().to(ctx.device, torch.float32).reshape(-1)
        out = torch.empty(ctx.world_size * local.numel(), device=ctx.device, dtype=torch.float32)
        # torch 2.13 renamed all_gather_into_tensor to all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local, group=ctx.group)
        self.calls += 1
        return out.reshape(ctx.world_size, local.numel())


class LocalGradNorm:
    """State of `local_grad_norm_hook`: the squared norm of this rank's own gradients this
    step (on the device) and when its first bucket was ready (the end of its compute)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.sq: torch.Tensor | None = None
        self.first_ready: float | None = None

    def reset(self) -> None:
        self.sq = None
        self.first_ready = None


# DDP checks these annotations at run time: they stay real objects (no postponed annotations).
def local_grad_norm_hook(
    state: LocalGradNorm,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """Add the bucket's squared norm to `state`, then average it across ranks as DDP does."""
    buffer = bucket.buffer()
    if state.first_ready is None:
        state.first_ready = time.perf_counter()
    sq = buffer.detach().float().square().sum()
    state.sq = sq if state.sq is None else state.sq + sq
    group = state.group if state.group is not None else dist.group.WORLD
    buffer.div_(dist.get_world_size(group))
    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    reduced: torch.futures.Future[torch.Tensor] = future.then(lambda f: f.value()[0])
    return reduced
