"""`StepExchange`: the guard's one collective per step, an all-gather of each rank's `RankRow`
read back as named `RankColumns`; and `local_grad_norm_hook`, a DDP communication hook that
measures each rank's gradients before they are averaged."""

import math
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainguard.distributed.context import RankContext
from trainguard.distributed.upload import FigureUpload

if TYPE_CHECKING:
    from trainguard.detectors import MetricPoint
    from trainguard.signals.gradients import Measurement

# the scalar fields of a row, in their place in the gathered tensor; the groups' block follows
_SCALARS = ("loss", "nonfinite", "shard_sq", "own_sq", "step_time", "data_wait", "checkpoint_due")
# the per-rank figures that reach the host, in their order within each rank's part of `extra`
_PER_RANK = ("loss", "own_sq", "step_time", "data_wait")


@dataclass
class RankRow:
    """One rank's part of the step's exchange, as device tensors: scalars, and one squared norm a
    layer group in `group_shard_sq`."""

    loss: torch.Tensor
    nonfinite: torch.Tensor  # this rank's count of non-finite gradients
    shard_sq: torch.Tensor  # squared norm of this rank's own gradient shards (FSDP2)
    own_sq: torch.Tensor  # squared norm of its gradients before DDP averages them; NaN: unmeasured
    step_time: torch.Tensor  # seconds of data wait and compute
    data_wait: torch.Tensor
    # 1 where this rank's clock says a timed checkpoint is due, plus 2 where its writer is busy
    checkpoint_due: torch.Tensor
    group_shard_sq: torch.Tensor  # `shard_sq` per layer group

    def pack(self) -> torch.Tensor:
        """The row as one float32 vector: the scalars in `_SCALARS` order, then the groups."""
        device = self.loss.device
        scalars = [getattr(self, name).to(device, torch.float32).reshape(()) for name in _SCALARS]
        groups = self.group_shard_sq.to(device, torch.float32).reshape(-1)
        return torch.cat([torch.stack(scalars), groups])


@dataclass
class RankColumns:
    """Every rank's `RankRow` after the all-gather, by name: each field has one entry a rank
    (`group_shard_sq` one row a rank)."""

    loss: torch.Tensor
    nonfinite: torch.Tensor
    shard_sq: torch.Tensor
    own_sq: torch.Tensor
    step_time: torch.Tensor
    data_wait: torch.Tensor
    checkpoint_due: torch.Tensor
    group_shard_sq: torch.Tensor

    @classmethod
    def unpack(cls, gathered: torch.Tensor) -> "RankColumns":
        """Name the columns of the gathered (world, k) tensor of packed rows."""
        named = {name: gathered[:, i] for i, name in enumerate(_SCALARS)}
        return cls(**named, group_shard_sq=gathered[:, len(_SCALARS) :])

    def per_rank(self) -> torch.Tensor:
        """The figures each rank is shown by (loss, own gradient norm squared, step time, data
        wait), rank after rank: what `add_rank_figures` reads after the host transfer."""
        return torch.stack([getattr(self, name) for name in _PER_RANK], dim=1).reshape(-1)


assert {f.name for f in fields(RankRow)} == {*_SCALARS, "group_shard_sq"}


class StepExchange:
    """Gathers every rank's vector of step figures into a (world, k) tensor on every rank."""

    def __init__(self, context: RankContext) -> None:
        self.context = context
        self.calls = 0  # collectives made, for tests and benchmarks
        self.checkpoint_due = False  # whether any rank's clock said a checkpoint is due
        self.checkpoint_busy = False  # whether any rank's checkpoint writer was busy
        self._upload: FigureUpload | None = None  # pinned buffers for the step's timings

    def gather(self, vector: torch.Tensor) -> torch.Tensor:
        ctx = self.context
        local = vector.detach().to(ctx.device, torch.float32).reshape(-1)
        out = torch.empty(ctx.world_size * local.numel(), device=ctx.device, dtype=torch.float32)
        # torch 2.13 renamed all_gather_into_tensor to all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local, group=ctx.group)
        self.calls += 1
        return out.reshape(ctx.world_size, local.numel())

    def share(
        self,
        m: "Measurement",
        hook: "LocalGradNorm | None",
        ready_at: float | None,
        data_wait: float,
        last_step_time: float | None,
        checkpoint_due: bool = False,
        checkpoint_busy: bool = False,
    ) -> None:
        """The step's one collective: every rank's loss, non-finite count, shard norms, own
        gradient norm before the reduction (from the DDP `hook`), timings, whether its clock
        says a checkpoint is due and whether its writer is busy; the measurement's figures
        become global, and the per-rank ones (then the checkpoint flags of all ranks, as
        1 for due plus 2 for busy) ride along in `m.extra` to the host.

        The step's compute runs from when its batch was ready (`ready_at`, else the end of the
        last step) to when the hook saw its first bucket (else now)."""
        now = time.perf_counter()
        device = m.head.device
        own_sq = hook.sq if hook is not None and hook.sq is not None else None
        start = ready_at if ready_at is not None else last_step_time
        end = hook.first_ready if hook is not None and hook.first_ready is not None else now
        compute = end - start if start is not None else math.nan
        if self._upload is None or self._upload.device != device:
            self._upload = FigureUpload(device, torch.get_default_dtype())
        timing = self._upload.send(  # from pinned memory: no pageable copy
            [data_wait + compute, data_wait, float(checkpoint_due) + 2.0 * float(checkpoint_busy)]
        )
        loss, nonfinite = m.rank_figures()
        assert m.shard_sq is not None and m.group_shard_sq is not None
        row = RankRow(
            loss=loss,
            nonfinite=nonfinite,
            shard_sq=m.shard_sq,
            own_sq=own_sq if own_sq is not None else torch.full((), math.nan, device=device),
            step_time=timing[0],
            data_wait=timing[1],
            checkpoint_due=timing[2],
            group_shard_sq=m.group_shard_sq,
        )
        columns = RankColumns.unpack(self.gather(row.pack()).to(device))
        m.combine(
            losses=columns.loss,
            nonfinite=columns.nonfinite,
            shard_sq=columns.shard_sq,
            group_shard_sq=columns.group_shard_sq,
        )
        flags = columns.checkpoint_due
        due, busy = (flags % 2).max(), (flags >= 2).to(flags.dtype).max()
        m.extra = torch.cat([columns.per_rank(), (due + 2 * busy).reshape(1)])
        if hook is not None:
            hook.reset()

    def add_rank_figures(self, point: "MetricPoint", extra: list[float]) -> None:
        """Per-rank columns of the exchange, once on the host (`StepSignals.extra`): each rank's
        loss, own gradient norm (left out when no DDP hook measured any), step time, data wait;
        then whether a timed checkpoint is due on any rank (1) and any rank's writer busy (2)."""
        flags = int(extra[-1])
        self.checkpoint_due = bool(flags & 1)
        self.checkpoint_busy = bool(flags & 2)
        width = len(_PER_RANK)
        rows = [extra[r * width : (r + 1) * width] for r in range(self.context.world_size)]
        column = {name: [row[i] for row in rows] for i, name in enumerate(_PER_RANK)}
        point.rank_losses = column["loss"]
        own = column["own_sq"]
        if not all(math.isnan(v) for v in own):  # all NaN: no DDP hook measured them
            point.rank_grad_norms = [math.sqrt(v) if v >= 0 else v for v in own]
        point.rank_step_times = column["step_time"]
        point.rank_data_waits = column["data_wait"]


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
