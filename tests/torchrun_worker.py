"""A guarded DDP job for `torchrun`: resumes from its run directory when it has checkpoints;
on the first attempt, rank 1 kills itself with SIGKILL mid-run (`--kill-at`)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard as tg
from dist_worker import model_and_data
from trainguard.distributed import init_process_group

STEPS = 60


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(120, exit=True)  # a hang shows where it is, then ends
    init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)
    model, data = model_and_data(rank, STEPS + 20)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    config = tg.GuardConfig.from_dict(
        {"console": False, "recovery": {"checkpoint_every": 10, "snapshot_every": 10}}
    )
    resumed = (args.run_dir / "checkpoints").is_dir()
    if resumed:
        guard = tg.Guard.resume(args.run_dir, ddp, opt, config=config)
    else:
        guard = tg.Guard(ddp, opt, config=config, run_dir=args.run_dir)
    start = guard.global_step
    window = len(guard.detectors.state_dict()["loss_spike"]["window"])
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for i, (x, y) in enumerate(guard.batches(data)):
        step = guard.global_step
        if step >= STEPS:
            break
        if first_attempt and rank == 1 and step == args.kill_at:
            guard.checkpoints.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.mse_loss(ddp(x), y)
        if rank == 0 and step == 25:
            loss = loss * 400.0  # a toxic batch, far over the noise: skipped and quarantined
        opt.zero_grad(set_to_none=True)
        loss.backward()
        guard.step(loss, batch_ids=[f"r{rank}-b{i}"])
    guard.close()
    result = {
        "start": start,
        "window_at_start": window,
        "weights": [float(p.detach().double().sum()) for p in model.parameters()],
        "quarantined": len(guard.quarantine.records),
        "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
    }
    (args.run_dir / f"result-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
