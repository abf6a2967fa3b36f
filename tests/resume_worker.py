"""A training process for the resume tests: trains TinyGPT with a Guard, writes each step's loss
(exact, as hex) to RUN_DIR/losses.txt, and can die by SIGKILL on cue.

python resume_worker.py RUN_DIR STEPS [--resume] [--kill-at STEP] [--kill-writing STEP]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
import trainguard as tg
from trainguard.demo import TinyGPT

from helpers import corpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-writing", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.kill_writing is not None:  # die inside the checkpoint writer, files half written
        from trainguard.actions.checkpoint_blobs import BlobWriter

        original = BlobWriter.finish  # called once every blob is written, before the manifest

        def finish(self, *a, **k):  # type: ignore[no-untyped-def]
            if f"step-{args.kill_writing}." in str(self.path):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *a, **k)

        BlobWriter.finish = finish  # type: ignore[method-assign]

    data = corpus()
    windows = torch.cat(
        [torch.cat([b.x[:, :1], b.y], 1) for b in data.batches(1, 32, 4000, seed=3)]
    )
    loader = DataLoader(TensorDataset(windows), batch_size=16, shuffle=True)  # 33 tokens each
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    cfg = tg.GuardConfig(console=False, recovery={"checkpoint_every": 40, "snapshot_every": 20})
    if args.resume:
        guard = tg.Guard.resume(args.run_dir, model, opt, sched, config=cfg)
    else:
        guard = tg.Guard(model, opt, sched, config=cfg, run_dir=args.run_dir)
    with (args.run_dir / "losses.txt").open("a") as out:
        while guard.global_step < args.steps:
            for (tokens,) in guard.batches(loader):
                if guard.global_step >= args.steps:
                    break
                keep = torch.rand(tokens[:, :32].shape) > 0.1  # random masking: the RNG matters
                x = torch.where(keep, tokens[:, :32], 0)
                loss = model.loss(model(x), tokens[:, 1:])
                loss.backward()
                step = guard.global_step
                guard.step(loss)
                opt.zero_grad(set_to_none=True)
                out.write(f"{step} {float(loss.detach()).hex()}\n")
                out.flush()
                if args.kill_at is not None and guard.global_step == args.kill_at:
                    guard.checkpoints.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
    guard.close()


if __name__ == "__main__":
    main()
