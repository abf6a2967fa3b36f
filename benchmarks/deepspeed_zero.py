"""Per-step overhead of DeepSpeedGuard in a 2-process DeepSpeed ZeRO-2 run (gloo, CPU) against
the engine's own step.

Both variants train the benchmark GPT (4 layers, d=256, sequence 128, batch 8 per rank) as two
DeepSpeed engines (ZeRO-2, fp32, gradient clipping 1.0) in the same processes, taking turns
step by step so machine noise falls on both alike:

- plain: engine(x), engine.backward(loss), engine.step()
- guarded: engine(x), engine.backward(loss), guard.step(loss): the partition's norms, the
  per-step exchange (the default, reduce: a SUM and a MAX), the detectors and the decision,
  then engine.step()

Run: DS_ACCELERATOR=cpu python benchmarks/deepspeed_zero.py [--steps 40] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trainguard as tg
from _common import gpt, write_section
from trainguard.demo import MarkovCorpus


def engine() -> tuple[Any, Any]:
    import deepspeed

    model, optimizer = gpt()
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    built, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return built, model


def worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import deepspeed

    from trainguard.integrations.deepspeed import DeepSpeedGuard

    deepspeed.utils.logger.setLevel(logging.WARNING)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    corpus = MarkovCorpus(vocab_size=256, length=200_000)
    batches = list(corpus.batches(8, 128, steps + 5, seed=rank + 1))
    plain, plain_model = engine()
    guarded, guard_model = engine()
    run_dir = Path(tempfile.mkdtemp(prefix=f"tg-ds-{rank}-"))
    config = tg.GuardConfig.from_dict({"console": False, "recovery": {"checkpoint_every": 0}})
    guard = DeepSpeedGuard(guarded, config=config, run_dir=run_dir)
    times: dict[str, list[float]] = {"plain": [], "guard": []}
    for i, b in enumerate(batches):
        order = ("plain", "guard") if i % 2 == 0 else ("guard", "plain")
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            if name == "plain":
                loss = plain_model.loss(plain(b.x), b.y)
                plain.backward(loss)
                plain.step()
            else:
                loss = guard_model.loss(guarded(b.x), b.y)
                guarded.backward(loss)
                guard.step(loss)
            if i >= 5:
                times[name].append(time.perf_counter() - start)
    guard.close()
    calls = guard.exchange.calls if guard.exchange else 0
    kind = type(guard.exchange).__name__
    dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(
        json.dumps({**times, "calls": calls, "exchange": kind})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(2, port, args.steps, out), nprocs=2, join=True)
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
    load = os.getloadavg()[1]  # the machine's other work over the run, which the figures carry
    plain = statistics.median(t for r in ranks for t in r["plain"])
    guard = statistics.median(t for r in ranks for t in r["guard"])
    body = "\n".join(
        [
            f"2 processes (gloo, CPU, one thread each), DeepSpeed ZeRO-2 in fp32, the benchmark "
            f"GPT, batch 8 per rank, {args.steps} timed steps per variant, interleaved; median "
            f"step time over both ranks. The machine's 5-minute load average at the end: "
            f"{load:.1f} on {os.cpu_count()} cores.",
            "",
            "| variant | ms / step | ratio |",
            "|---|---:|---:|",
            f"| engine.step() | {plain * 1000:.1f} | 1.000 |",
            f"| DeepSpeedGuard.step | {guard * 1000:.1f} | {guard / plain:.3f} |",
            "",
            f"The guard's exchange ({ranks[0]['exchange']}, the default) made "
            f"{ranks[0]['calls']} collectives for {args.steps + 5} steps: a SUM and a MAX a "
            "step, carrying the ranks' losses, non-finite counts, partition norms and timings.",
        ]
    )
    print(body)
    if not args.no_write:
        write_section(
            "deepspeed",
            "DeepSpeed overhead",
            body,
            "DS_ACCELERATOR=cpu python benchmarks/deepspeed_zero.py",
        )


if __name__ == "__main__":
    main()
