"""`ReplicaResync`: gives the data-parallel ranks whose weights diverged a copy of a replica that
agrees with the majority, so that every rank is bit-identical again."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from trainguard.distributed.replicas import ReplicaFingerprint, local_tensor
from trainguard.events import Decision, Event, EventKind, TrainguardError

BUCKET_BYTES = 64 << 20  # tensors are broadcast in flat buckets of at most this size


class ReplicaResync:
    """Broadcasts the source rank's replicated state (the parameters the fingerprint covers,
    with `buffers` the module's buffers, and the optimizer's state of those parameters where the
    optimizer is replicated too, as under DDP) to every rank of the data-parallel group; the
    next step checks the replicas again."""

    def __init__(
        self,
        fingerprint: ReplicaFingerprint,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        buffers: bool = False,
    ) -> None:
        self.fingerprint = fingerprint
        self.module = module
        self.optimizer = optimizer
        self.buffers = buffers

    def tensors(self) -> list[torch.Tensor]:
        """What a resync copies, in the same order on every rank."""
        out = [local_tensor(p).detach() for p in self.fingerprint.params]
        if self.buffers:
            out += [local_tensor(b) for b in self.module.buffers()]
        if self.optimizer is not None:
            for p in self.fingerprint.params:
                state = self.optimizer.state.get(p, {})
                out += [
                    local_tensor(state[key])
                    for key in sorted(state, key=str)
                    if isinstance(state[key], torch.Tensor)
                ]
        return out

    @torch.no_grad()
    def apply(self, decision: Decision, dropped: list[int]) -> list[Event]:
        """Copy `decision.resync_from`'s state to every rank (a collective: every rank calls it);
        the event that says so. `dropped`: the steps of the snapshots set aside because they may
        hold a diverged replica."""
        source = decision.resync_from
        if source is None:
            return []
        ctx = self.fingerprint.ranks
        tensors = self.tensors()
        self._check_layout(tensors, source)
        size = 0
        for bucket in _buckets(tensors):
            flat = torch.cat([t.reshape(-1).to(ctx.device) for t in bucket])
            dist.broadcast(flat, group=ctx.group, group_src=source)
            size += flat.numel() * flat.element_size()
            if ctx.rank == source:
                continue
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].reshape(t.shape))
                offset += t.numel()
        ranks = ", ".join(str(r) for r in decision.resync_ranks)
        ranks = ("rank " if len(decision.resync_ranks) == 1 else "ranks ") + ranks
        has_buffers = self.buffers and any(True for _ in self.module.buffers())
        parts = "parameters" + (", buffers" if has_buffers else "")
        parts += " and optimizer state" if self.optimizer is not None else ""
        message = (
            f"gave {ranks} a copy of rank {source}'s {parts} ({len(tensors)} tensors, "
            f"{size / 2**20:.3g} MiB), which the next step checks; this step's update was left "
            "out (its gradients came in part from a diverged replica)"
        )
        if dropped:
            steps = ", ".join(map(str, dropped))
            message += (
                f"; {'the snapshot of step' if len(dropped) == 1 else 'the snapshots of steps'} "
                f"{steps}, taken after the last check where the replicas agreed, set aside"
            )
        event = Event(
            step=decision.step,
            kind=EventKind.REPLICA_RESYNC,
            severity="warning",
            message=message,
            metrics={
                "source": source,
                "ranks": list(decision.resync_ranks),
                "tensors": len(tensors),
                "bytes": size,
                "dropped_snapshots": dropped,
            },
            action=decision.action,
        )
        event.rank = decision.resync_ranks[0] if decision.resync_ranks else None
        return [event]

    def _check_layout(self, tensors: list[torch.Tensor], source: int) -> None:
        """Every rank must hold tensors of the same shapes and dtypes, or a broadcast would
        hang: one all-reduce of a checksum of the layout (its maximum and minimum)."""
        layout = repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()
        ctx = self.fingerprint.ranks
        code = torch.tensor([zlib.crc32(layout)], dtype=torch.int64, device=ctx.device)
        both = torch.cat([code, ~code])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ctx.group)
        if int(both[0]) != int(~both[1]):
            raise TrainguardError(
                f"cannot give the diverged replicas a copy of rank {source}'s state: the ranks "
                "hold parameters, buffers or optimizer state of different shapes, so the model "
                "is not replicated across the data-parallel group; check that every rank builds "
                "the same model and optimizer, or set replicas.every to 0"
            )


def _buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """The tensors in runs of one dtype of at most `BUCKET_BYTES` (a larger one alone)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket
