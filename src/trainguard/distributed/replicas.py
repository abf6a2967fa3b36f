"""`ReplicaFingerprint`: whether the data-parallel replicas of a module hold bit-identical
weights, from a fingerprint of each layer group reduced across the group in one all-reduce."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainguard.distributed.context import RankContext
from trainguard.signals.layer_groups import LayerGroups

CHUNK = 1 << 22  # elements converted to float64 at a time, which bounds the check's memory
_RAMP_STEP = 2.0**-22  # the position ramp's slope: exact in float64, so every rank sums alike


class ReplicaFingerprint:
    """Fingerprints the module's replicated parameters (all but sharded ones) per layer group:
    the float64 sum of the weights and their sum weighted by position (a permutation moves it),
    so that a change of one element by 1e-6 shows. `compare` tells where the ranks differ."""

    def __init__(
        self,
        module: nn.Module,
        ranks: RankContext,
        group_patterns: Sequence[str],
        every: int,
    ) -> None:
        kept = [(n, p) for n, p in module.named_parameters() if _replicated(p)]
        self.params: list[torch.Tensor] = [p for _, p in kept]
        self.groups = LayerGroups([n for n, _ in kept], group_patterns)
        self.ranks = ranks
        self.every = every
        self.calls = 0  # collectives made, for tests and benchmarks
        device = self.params[0].device if self.params else torch.device("cpu")
        self._index = torch.tensor(self.groups.index, device=device, dtype=torch.long)
        self._ramp: torch.Tensor | None = None

    @property
    def enabled(self) -> bool:
        """Whether there is anything to check: replicated parameters and `every` > 0."""
        return self.every > 0 and bool(self.params)

    def due(self, step: int) -> bool:
        """Checks come every `every` steps, from step `every` on."""
        return self.enabled and step > 0 and step % self.every == 0

    @torch.no_grad()
    def local(self) -> torch.Tensor:
        """This rank's fingerprint: (layer groups, 2) float64 on the parameters' device."""
        parts = [self._of(local_tensor(p).detach().reshape(-1)) for p in self.params]
        per_param = torch.stack(parts)
        out = torch.zeros(len(self.groups), 2, device=per_param.device, dtype=torch.float64)
        return out.index_add_(0, self._index.to(per_param.device), per_param)

    def _of(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` and its sum weighted by position i * 2**-22, in float64, a chunk of
        `CHUNK` elements at a time (chunk k's weights are k + its own ramp)."""
        ramp = self._ramp
        if ramp is None or ramp.device != x.device or ramp.numel() < min(CHUNK, x.numel()):
            longest = max(local_tensor(p).numel() for p in self.params)
            size = min(CHUNK, max(longest, x.numel()))
            ramp = torch.arange(size, device=x.device, dtype=torch.float64) * _RAMP_STEP
            self._ramp = ramp
        total = torch.zeros((), device=x.device, dtype=torch.float64)
        weighted = torch.zeros((), device=x.device, dtype=torch.float64)
        for k, start in enumerate(range(0, x.numel(), CHUNK)):
            chunk = x[start : start + CHUNK].to(torch.float64)
            s = chunk.sum()
            total += s
            weighted += torch.dot(chunk, ramp[: chunk.numel()]) + k * s
        return torch.stack([total, weighted])

    @torch.no_grad()
    def compare(self) -> dict[str, list[int]]:
        """Every rank's fingerprint against the others: {} when all are bit-identical, else for
        each layer group where they differ, each rank's class (ranks of one class agree,
        numbered in order of their first rank). One all-reduce (MAX of the fingerprint's bits and
        their complement: the maximum and the minimum at once) and a transfer of a flag a group;
        an all-gather of the groups that differ only when some do."""
        ctx = self.ranks
        bits = self.local().to(ctx.device).view(torch.int64).reshape(-1)  # exact comparison
        both = torch.cat([bits, ~bits])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ctx.group)
        self.calls += 1
        n = bits.numel()
        highest, lowest = both[:n], ~both[n:]
        differs = (highest != lowest).reshape(-1, 2).any(dim=1)
        which: list[int] = differs.nonzero().reshape(-1).tolist()
        if not which:
            return {}
        picked = bits.reshape(-1, 2)[torch.tensor(which, device=bits.device)].reshape(-1)
        out = torch.empty(ctx.world_size * picked.numel(), device=ctx.device, dtype=torch.int64)
        # torch 2.13 renamed all_gather_into_tensor to all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, picked, group=ctx.group)
        self.calls += 1
        rows = out.reshape(ctx.world_size, len(which), 2).tolist()
        classes: dict[str, list[int]] = {}
        for j, g in enumerate(which):
            seen: dict[tuple[int, int], int] = {}
            classes[self.groups.group_names[g]] = [
                seen.setdefault((row[j][0], row[j][1]), len(seen)) for row in rows
            ]
        return classes


def _replicated(param: torch.Tensor) -> bool:
    """Whether every rank holds the whole parameter (not a shard of it)."""
    return not isinstance(param, DTensor) or all(p.is_replicate() for p in param.placements)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
