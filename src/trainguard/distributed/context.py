"""`RankContext`: this process's rank, the world and its hosts, read from `torch.distributed`."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta

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
    token: str = ""  # chosen by rank 0 at start: names this run's temporary files on every rank

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
        found: list[object] = [None] * world
        dist.all_gather_object(found, (socket.gethostname(), uuid.uuid4().hex[:8]), group=group)
        pairs = [tuple(f) for f in found if isinstance(f, (tuple, list))]
        backend = str(dist.get_backend(group))
        comm = torch.device("cpu") if backend == "gloo" else device
        hosts = [str(p[0]) for p in pairs]
        return cls(dist.get_rank(group), world, hosts, comm, group, token=str(pairs[0][1]))

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that writes files and sends alerts."""
        return self.rank == 0


def init_process_group(backend: str = "gloo", timeout_s: float = 600.0) -> None:
    """`torch.distributed.init_process_group` that survives `torchrun --max-restarts`: each
    restart attempt rendezvous under its own store prefix, so no rank reads the address a
    killed rank left in the agent's store. Outside torchelastic, the plain call."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    timeout = timedelta(seconds=timeout_s)
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # public and documented; torch's __init__ re-exports it without `as`, which mypy wants
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=not agent and rank == 0,
        timeout=timeout,
        multi_tenant=not agent,
    )
    prefixed = dist.PrefixStore(  # type: ignore[attr-defined]
        f"trainguard/attempt-{attempt}", store
    )
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
