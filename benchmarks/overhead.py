"""Per-step overhead of the Guard against a plain loop and a seed-style monitor.

A small GPT (4 layers, d=256, sequence 128, batch 16) trains with AdamW; the three variants take
turns step by step (in rotating order) so that machine noise falls on all of them alike:

- plain: forward, backward, clip_grad_norm_(1.0), optimizer.step(), zero_grad
- guard: forward, backward, guard.step(loss) with default GuardConfig, zero_grad
- seed monitor: plain, plus a Python loop over parameters calling .norm().item() and a Python
  rolling mean of the loss, as a hand-written monitor does

Run: python benchmarks/overhead.py [--steps 60] [--device cpu|cuda] [--no-write]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

import trainguard as tg
from _common import gpt, write_section
from trainguard.demo import MarkovCorpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="Timed steps per variant.")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-write", action="store_true", help="Print only; leave RESULTS.md.")
    args = parser.parse_args()
    device = torch.device(args.device)
    corpus = MarkovCorpus(vocab_size=256, length=400_000)
    batches = [
        (b.x.to(device), b.y.to(device))
        for b in corpus.batches(16, 128, args.steps + args.warmup, seed=1)
    ]

    plain_model, plain_opt = gpt(device)
    guard_model, guard_opt = gpt(device)
    seed_model, seed_opt = gpt(device)
    run_dir = Path(tempfile.mkdtemp(prefix="tg-overhead-"))
    guard = tg.Guard(guard_model, guard_opt, config=tg.GuardConfig(console=False), run_dir=run_dir)
    window: deque[float] = deque(maxlen=100)

    def plain(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = plain_model.loss(plain_model(x), y)
        loss.backward()
        t0 = _now(device)
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        return _now(device) - t0

    def guarded(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = guard_model.loss(guard_model(x), y)
        loss.backward()
        t0 = _now(device)
        guard.step(loss)
        guard_opt.zero_grad(set_to_none=True)
        return _now(device) - t0

    def seed_monitor(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = seed_model.loss(seed_model(x), y)
        loss.backward()
        t0 = _now(device)
        norms = {
            n: p.grad.norm().item() for n, p in seed_model.named_parameters() if p.grad is not None
        }
        total = sum(v * v for v in norms.values()) ** 0.5
        value = loss.item()
        mean = sum(window) / len(window) if window else value
        _ = value > 2 * mean or total > 5.0
        window.append(value)
        torch.nn.utils.clip_grad_norm_(seed_model.parameters(), 1.0)
        seed_opt.step()
        seed_opt.zero_grad(set_to_none=True)
        return _now(device) - t0

    variants: dict[str, Callable[[torch.Tensor, torch.Tensor], float]] = {
        "plain loop": plain,
        "Guard (defaults)": guarded,
        "seed-style monitor": seed_monitor,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    after: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i, (x, y) in enumerate(batches):
        order = names[i % 3 :] + names[: i % 3]
        for name in order:
            t0 = _now(device)
            tail = variants[name](x, y)
            if i >= args.warmup:
                times[name].append(_now(device) - t0)
                after[name].append(tail)
    guard.close()

    base = statistics.median(times["plain loop"])
    base_after = statistics.median(after["plain loop"])
    lines = [
        f"Device: {device.type} ({_device_name(device)}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.steps} timed steps per variant, "
        f"{sum(p.numel() for p in plain_model.parameters()):,} parameters.",
        "",
        "| variant | median step (ms) | ratio to plain | median after backward (ms) "
        "| overhead after backward, as a share of the plain step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in names:
        med, tail = statistics.median(times[name]), statistics.median(after[name])
        lines.append(
            f"| {name} | {med * 1e3:.2f} | {med / base:.3f}x | {tail * 1e3:.2f} "
            f"| {(tail - base_after) / base:+.2%} |"
        )
    lines += [
        "",
        "'After backward' is clipping, the optimizer step and whatever the variant adds there "
        "(the Guard's statistics, detectors, policy and log line; the seed monitor's .item() "
        "loop): the part where the variants differ, measured inside the same steps.",
    ]
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        command = f"python benchmarks/overhead.py --steps {args.steps} --device {args.device}"
        write_section("overhead", "Per-step overhead", table, command)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
