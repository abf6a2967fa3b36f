"""`RankContext`: this process's rank, the world and its hosts, read from `torch.distributed`."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class RankContext:
    """Where this process sits in a distributed run; `detect` gives None outside one."""

    rank: int
    world_size: int
    hosts: list[str]
    device: torch.device  # where the collectives' tensors live (CPU for gloo)
    group: dist.ProcessGroup | None = None

    @classmethod
    def detect(
        cls, device: torch.device, group: dist.ProcessGroup | None = None
    ) -> RankContext | None:
        """The context of an initialised process group of 2 or more ranks (one collective, at
        start, to learn the hosts); None otherwise."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size(group)
        if world < 2:
            return None
        hosts: list[object] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        backend = str(dist.get_backend(group))
        comm = torch.device("cpu") if backend == "gloo" else device
        return cls(dist.get_rank(group), world, [str(h) for h in hosts], comm, group)

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that writes files and sends alerts."""
        return self.rank == 0
