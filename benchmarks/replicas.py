"""The cost of one replica check, and of one resync, against a guarded DDP step (gloo, CPU).

Two processes train the benchmark GPT (4 layers, d=256, 3.3M parameters, AdamW, batch 8 per
rank) under DDP and a Guard whose own checks are off; between steps the script times, taking
turns with the steps so machine noise falls on both alike:

- a guarded step: forward, backward, guard.step(loss)
- a replica check: the float64 fingerprint of every layer group and its all-reduce across the
  ranks (what `replicas.every` adds to one step in that many)
- a resync: rank 0's parameters and AdamW state broadcast to rank 1 (the guard checks them at
  the next step, a check like the one above)

Run: python benchmarks/replicas.py [--steps 30] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from _common import gpt, write_section
from trainguard.demo import MarkovCorpus

RESYNCS = 5


def worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    corpus = MarkovCorpus(vocab_size=256, length=200_000)
    batches = list(corpus.batches(8, 128, steps + 3, seed=rank + 1))
    model, opt = gpt()
    ddp = DDP(model)
    config = tg.GuardConfig.from_dict(
        {"console": False, "recovery": {"checkpoint_every": 0}, "replicas": {"every": 10**9}}
    )
    guard = tg.Guard(ddp, opt, config=config, run_dir=Path(tempfile.mkdtemp(prefix="tg-rep-")))
    check, resync = guard.replicas, guard._resync
    assert check is not None and resync is not None
    times: dict[str, list[float]] = {"step": [], "check": [], "resync": []}

    def timed(name: str, call: object) -> None:
        dist.barrier()
        start = time.perf_counter()
        call()  # type: ignore[operator]
        times[name].append(time.perf_counter() - start)

    def step(b: object) -> None:
        loss = model.loss(ddp(b.x), b.y)  # type: ignore[attr-defined]
        loss.backward()
        guard.step(loss)
        opt.zero_grad(set_to_none=True)

    decision = tg.Decision(step=0, action="skip", resync_from=0, resync_ranks=[1])
    for i, b in enumerate(batches):
        timed("step", lambda b=b: step(b))
        timed("check", check.compare)
        if i >= 3 and len(times["resync"]) < RESYNCS:
            timed("resync", lambda: resync.apply(decision, []))
    guard.close()
    dist.destroy_process_group()
    result = {k: v[3:] if k != "resync" else v for k, v in times.items()}
    result["parameters"] = [sum(p.numel() for p in model.parameters())]
    result["tensors"] = [len(resync.tensors())]
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(2, port, args.steps, out), nprocs=2, join=True)
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
    ms = {
        k: 1000 * statistics.median(v for r in ranks for v in r[k])
        for k in ("step", "check", "resync")
    }
    params = int(ranks[0]["parameters"][0])
    body = (
        f"2 processes (gloo, CPU, one thread each), the benchmark GPT ({params:,} parameters, "
        f"AdamW), batch 8 per rank; median over both ranks of {args.steps} steps and checks, "
        f"taken in turns, and {RESYNCS} resyncs.\n\n"
        "| what | ms | share of a step |\n|---|---:|---:|\n"
        f"| guarded DDP step | {ms['step']:.1f} | 1.000 |\n"
        f"| one replica check (fingerprint + all-reduce) | {ms['check']:.2f} | "
        f"{ms['check'] / ms['step']:.4f} |\n"
        f"| one resync ({ranks[0]['tensors'][0]} tensors broadcast) | "
        f"{ms['resync']:.1f} | {ms['resync'] / ms['step']:.3f} |\n\n"
        f"At the default `replicas.every` of 100 the check costs "
        f"{100 * ms['check'] / ms['step'] / 100:.3f}% of the training time; the resync only "
        "follows a divergence."
    )
    print(body)
    if not args.no_write:
        write_section("replicas", "Replica agreement", body, "python benchmarks/replicas.py")


if __name__ == "__main__":
    main()
