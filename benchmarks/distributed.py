"""Per-step overhead of the Guard in a 2-process DDP run (gloo, CPU) against plain DDP.

Both variants train the benchmark GPT (4 layers, d=256, sequence 128, batch 8 per rank) in the
same processes, taking turns step by step so machine noise falls on both alike:

- plain DDP: forward, backward (DDP's all-reduce), clip_grad_norm_(1.0), optimizer.step()
- guarded DDP: forward, backward (through the guard's DDP hook), guard.step(loss): the
  per-rank statistics, the exchange (a SUM and a MAX of fixed size), the detectors and the
  decision

Run: python benchmarks/distributed.py [--steps 40] [--exchange reduce|gather] [--no-write]
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


def worker(rank: int, world: int, port: int, steps: int, out: str, exchange: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    corpus = MarkovCorpus(vocab_size=256, length=200_000)
    batches = list(corpus.batches(8, 128, steps + 5, seed=rank + 1))
    plain_model, plain_opt = gpt()
    guard_model, guard_opt = gpt()
    plain, guarded = DDP(plain_model), DDP(guard_model)
    run_dir = Path(tempfile.mkdtemp(prefix=f"tg-ddp-{rank}-"))
    config = tg.GuardConfig.from_dict(
        {"console": False, "recovery": {"checkpoint_every": 0}, "ranks": {"exchange": exchange}}
    )
    guard = tg.Guard(guarded, guard_opt, config=config, run_dir=run_dir)
    times: dict[str, list[float]] = {"plain": [], "guard": []}
    for i, b in enumerate(batches):
        order = ("plain", "guard") if i % 2 == 0 else ("guard", "plain")
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            if name == "plain":
                loss = plain_model.loss(plain(b.x), b.y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
                plain_opt.step()
                plain_opt.zero_grad(set_to_none=True)
            else:
                loss = guard_model.loss(guarded(b.x), b.y)
                loss.backward()
                guard.step(loss)
                guard_opt.zero_grad(set_to_none=True)
            if i >= 5:
                times[name].append(time.perf_counter() - start)
    guard.close()
    calls = guard.exchange.calls if guard.exchange else 0
    dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({**times, "calls": calls}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--exchange", choices=("reduce", "gather"), default="reduce")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(2, port, args.steps, out, args.exchange), nprocs=2, join=True)
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
    plain = statistics.median(t for r in ranks for t in r["plain"])
    guard = statistics.median(t for r in ranks for t in r["guard"])
    body = "\n".join(
        [
            f"2 processes (gloo, CPU, one thread each), the benchmark GPT, batch 8 per rank, "
            f"{args.steps} timed steps per variant, interleaved; median step time over both ranks.",
            "",
            "| variant | ms / step | ratio |",
            "|---|---:|---:|",
            f"| plain DDP (clip_grad_norm_) | {plain * 1000:.1f} | 1.000 |",
            f"| DDP + trainguard Guard | {guard * 1000:.1f} | {guard / plain:.3f} |",
            "",
            f"The guard made {ranks[0]['calls']} collectives for {args.steps + 5} steps: a SUM "
            "and a MAX a step, carrying the ranks' loss, own gradient norms before the "
            "reduction, non-finite counts, shard norms and timings.",
        ]
    )
    print(body)
    if not args.no_write:
        write_section(
            "distributed", "Distributed overhead", body, "python benchmarks/distributed.py"
        )


if __name__ == "__main__":
    main()
