"""`ReplicaFingerprint`: whether the data-parallel replicas of a module hold bit-identical
weights, from a fingerprint of each layer group reduced across the group in one all-reduce."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainguard.distributed.context import RankContext
from trainguard.signals.host_reads import read_now
from trainguard.signals.layer_groups import LayerGroups

WIDTH = 1 << 10  # words a row: a row's sums stay under 2**53, exact in float64
CHUNK = 1 << 20  # words widened to float64 at a time, which bounds the check's memory
PRIME = (1 << 31) - 1  # the sums are kept modulo this prime: exact, and never overflowing


class ReplicaFingerprint:
    """Fingerprints the module's replicated parameters (all but sharded ones) per layer group,
    from their bits: read as integers w_i (32-bit words; 16- or 8-bit for narrower types), the
    sum of the w_i and their sum weighted by position (i + 1), both modulo a prime. Integer sums
    are exact, so every rank gets the same figures whatever its hardware sums in, and any
    flipped bit moves the first (a change of 1e-6, a NaN), any swap of two values the second.
    `compare` tells where the ranks differ."""

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
        self._ramp: tuple[torch.Tensor, torch.Tensor] | None = None  # weights, row numbers

    @property
    def enabled(self) -> bool:
        """Whether there is anything to check: replicated parameters and `every` > 0."""
        return self.every > 0 and bool(self.params)

    def due(self, step: int) -> bool:
        """Checks come every `every` steps, from step `every` on."""
        return self.enabled and step > 0 and step % self.every == 0

    @torch.no_grad()
    def local(self) -> torch.Tensor:
        """This rank's fingerprint: (layer groups, 2) int64 in [0, PRIME), on the first
        parameter's device."""
        device = self._index.device  # a module may span devices
        parts = [self._of(_words(local_tensor(p))).to(device) for p in self.params]
        out = torch.zeros(len(self.groups), 2, device=device, dtype=torch.int64)
        return out.index_add_(0, self._index, torch.stack(parts)).remainder_(PRIME)

    def _of(self, words: torch.Tensor) -> torch.Tensor:
        """[sum of w_i, sum of (i + 1) w_i] modulo PRIME, a chunk of CHUNK words at a time, in
        rows of WIDTH words: with |w_i| < 2**31 a row's sum (< 2**41) and its sum weighted by
        the column (< 2**51) are integers that float64 holds exactly, whatever order a matrix
        product adds them in; the rows' offsets are multiplied in modulo PRIME, in int64."""
        device = words.device
        if self._ramp is None or self._ramp[0].device != device:
            columns = torch.arange(1, WIDTH + 1, device=device, dtype=torch.float64)
            rows = torch.arange(CHUNK // WIDTH, device=device, dtype=torch.int64)
            self._ramp = (torch.stack([torch.ones_like(columns), columns], dim=1), rows)
        weights, rows_per_chunk = self._ramp
        total = torch.zeros((), device=device, dtype=torch.int64)
        weighted = torch.zeros((), device=device, dtype=torch.int64)
        for start in range(0, words.numel(), CHUNK):
            chunk = words[start : start + CHUNK].to(torch.float64)
            if chunk.numel() % WIDTH:  # zeros add nothing
                chunk = torch.nn.functional.pad(chunk, (0, WIDTH - chunk.numel() % WIDTH))
            sums = (chunk.view(-1, WIDTH) @ weights).to(torch.int64)  # exact integers
            row_sums, row_weighted = sums[:, 0], sums[:, 1].remainder(PRIME)
            # row r of the chunk starts at word start + r * WIDTH
            offsets = (rows_per_chunk[: len(sums)] * WIDTH + start).remainder_(PRIME)
            shifted = (offsets * row_sums.remainder(PRIME)).remainder_(PRIME)
            total = (total + row_sums.sum()).remainder_(PRIME)
            weighted = (weighted + row_weighted.sum() + shifted.sum()).remainder_(PRIME)
        return torch.stack([total, weighted])

    @torch.no_grad()
    def compare(self) -> dict[str, list[int]]:
        """Every rank's fingerprint against the others: {} when all are identical, else for
        each layer group where they differ, each rank's class (ranks of one class agree,
        numbered in order of their first rank). One all-reduce (MAX of the fingerprint and of
        its negation: the maximum and the minimum at once) and a transfer of a flag a group;
        an all-gather of the groups that differ only when some do."""
        ctx = self.ranks
        mine = self.local().to(ctx.device).reshape(-1)
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ctx.group)
        self.calls += 1
        n = mine.numel()
        highest, lowest = both[:n], -both[n:]
        differs = (highest != lowest).reshape(-1, 2).any(dim=1)
        which = [g for g, flag in enumerate(read_now(differs)) if flag]  # one read, no nonzero
        if not which:
            return {}
        picked = mine.reshape(-1, 2)[torch.tensor(which, device=mine.device)].reshape(-1)
        out = torch.empty(ctx.world_size * picked.numel(), device=ctx.device, dtype=torch.int64)
        # torch 2.13 renamed all_gather_into_tensor to all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, picked, group=ctx.group)
        self.calls += 1
        flat = read_now(out)  # int64: read exactly; rank r's group j at (r * len(which) + j) * 2
        classes: dict[str, list[int]] = {}
        for j, g in enumerate(which):
            seen: dict[tuple[float, float], int] = {}
            at = [(r * len(which) + j) * 2 for r in range(ctx.world_size)]
            classes[self.groups.group_names[g]] = [
                seen.setdefault((flat[i], flat[i + 1]), len(seen)) for i in at
            ]
        return classes


def _replicated(param: torch.Tensor) -> bool:
    """Whether every rank holds the whole parameter (not a shard of it)."""
    return not isinstance(param, DTensor) or all(p.is_replicate() for p in param.placements)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as one flat run of integers: 32-bit words, or 16- or 8-bit ones for
    narrower types."""
    flat = tensor.detach().reshape(-1)
    size = flat.element_size()
    return flat.view(torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.int8)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
