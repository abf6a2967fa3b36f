"""How long a checkpoint holds training up on a GPU: a GPT trained with fused AdamW under bf16
autocast, checkpointed every `--every` steps (dedup and asynchronous, the defaults), with the
base frozen or not. Per checkpoint step: its time over the median step (the training thread's
staging, and the device's wait for the copy), the bytes copied, hashed and written, and the
deferrals the guard reported. A device-wide sync anywhere on the guard's path raises.

Run: python benchmarks/checkpoint_blocking.py [--width 2048 --layers 24] [--steps 120]
(`--device cpu` is a dry run of the script: timings on the host say nothing).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

import trainguard as tg
from trainguard.demo import TinyGPT, TinyGPTConfig


def run(args: argparse.Namespace, frozen: bool) -> dict[str, Any]:
    """One run; each checkpoint step's figures and the deferral events."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = TinyGPTConfig(
        vocab_size=1024, seq_len=256, n_layer=args.layers, n_head=16, d_model=args.width
    )
    model = TinyGPT(cfg).to(device)
    if frozen:  # all but the last block and the head
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(f"blocks.{args.layers - 1}.") or "head" in name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=device.type == "cuda")
    recovery = {"checkpoint_every": args.every, "keep_checkpoints": 2}
    with tempfile.TemporaryDirectory() as run_dir:
        guard = tg.Guard(
            model, opt, config=tg.GuardConfig(console=False, recovery=recovery), run_dir=run_dir
        )
        store = guard.checkpoints
        assert store is not None and guard.checkpointing is not None
        if device.type == "cpu":
            guard.checkpointing.defers = True  # the dry run takes the device's path
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        times, saves, deferred = [], {}, []
        tokens = torch.randint(0, 1024, (args.batch, cfg.seq_len + 1), device=device)
        for _ in range(args.steps):
            sync()
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, 1024), tokens[:, 1:].reshape(-1)
            )
            loss.backward()
            guard_sync, torch.cuda.synchronize = torch.cuda.synchronize, _refuse
            try:
                decision = guard.step(loss)
            finally:
                torch.cuda.synchronize = guard_sync
            opt.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - start)
            deferred += [e.message for e in decision.events if e.kind == "checkpoint"]
            if store.writing_step == guard.global_step and guard.global_step not in saves:
                saves[guard.global_step] = {"copied": store.copied}
        guard.close()
    median = statistics.median(times)
    return {
        "median_s": median,
        "blocked_s": {s: times[s - 1] - median for s in saves},
        "copied_gb": {s: v["copied"] / 1e9 for s, v in saves.items()},
        "last_written_gb": store.written.get("written", 0) / 1e9,
        "last_hashed_gb": store.written.get("hashed", 0) / 1e9,
        "deferred": deferred,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("torch.cuda.synchronize called on the guard's path")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=30)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("checkpoint_blocking.py needs a CUDA device (or --device cpu, a dry run)")
    for frozen in (False, True):
        figures = run(args, frozen)
        print(f"frozen base: {frozen}", {k: v for k, v in figures.items()})


if __name__ == "__main__":
    main()
