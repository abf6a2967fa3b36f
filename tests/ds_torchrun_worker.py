"""A guarded DeepSpeed ZeRO-2 job for `torchrun` on the CPU: resumes from its run directory's
DeepSpeed checkpoints when it has them; on the first attempt, rank 1 kills itself with SIGKILL
mid-run (`--kill-at`)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from torch import nn

import trainguard as tg
from dist_worker import model_and_data
from ds_worker import build_engine, weights
from trainguard.distributed import init_process_group
from trainguard.integrations.deepspeed import DeepSpeedGuard

STEPS = 50


def main() -> None:
    import deepspeed

    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(150, exit=True)  # a hang shows where it is, then ends
    deepspeed.utils.logger.setLevel(logging.WARNING)
    init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)
    engine = build_engine(2, "bf16")
    _, data = model_and_data(rank, STEPS + 20)
    config = tg.GuardConfig.from_dict(
        {"console": False, "recovery": {"checkpoint_every": 10, "snapshot_every": 10}}
    )
    resumed = (args.run_dir / "checkpoints").is_dir()
    if resumed:
        guard = DeepSpeedGuard.resume(args.run_dir, engine, config=config)
    else:
        guard = DeepSpeedGuard(engine, config=config, run_dir=args.run_dir)
    start = guard.global_step
    window = len(guard.detectors.state_dict()["loss_spike"]["window"])
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for i, (x, y) in enumerate(guard.batches(data)):
        step = guard.global_step
        if step >= STEPS:
            break
        if first_attempt and rank == 1 and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y)
        if rank == 0 and step == 25:
            loss = loss * 400.0  # a toxic batch, far over the noise: skipped and quarantined
        engine.backward(loss)
        guard.step(loss, batch_ids=[f"r{rank}-b{i}"])
    guard.close()
    result = {
        "start": start,
        "window_at_start": window,
        "weights": weights(engine),
        "engine_steps": engine.global_steps,
        "quarantined": len(guard.quarantine.records),
        "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
    }
    (args.run_dir / f"result-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
