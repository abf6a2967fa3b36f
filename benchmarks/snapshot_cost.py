"""What an in-memory snapshot costs on the CPU, side by side with another version of trainguard:
the training thread's time per snapshot and per restore, host allocations per snapshot, and the
peak memory the ring adds (counted in snapshots, to show an N+1th at the peak).

Each variant runs in its own process (fresh allocator, its own peak), alternated `--rounds`
times; medians are reported. The GPU figures (pinning, the side stream) come from
`benchmarks/gpu.py` on a device.

Run: python benchmarks/snapshot_cost.py --base-src /path/to/old/src [--params 25e6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def worker(params: int, takes: int) -> dict[str, float]:
    """Time `takes` snapshots into a ring of 3 and 3 restores of a model of ~`params` params."""
    import torch
    from torch import nn

    from trainguard.actions.snapshots import SnapshotRing

    torch.manual_seed(0)
    width = 2048
    layers = max(1, params // (width * width))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())
    ring = SnapshotRing(3)
    counts: dict[str, int] = {"empty": 0}
    real_clone = torch.Tensor.clone

    def counted_clone(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        counts["empty"] += 1
        return real_clone(self, *args, **kwargs)  # type: ignore[arg-type]

    torch.Tensor.clone = counted_clone  # type: ignore[method-assign]
    try:
        from trainguard.actions import host_memory

        before_alloc = host_memory.COUNTS.allocations
    except ImportError:
        host_memory = None  # type: ignore[assignment]
        before_alloc = 0
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    take_s, restore_s = [], []
    snap = None
    for step in range(takes):
        t0 = time.perf_counter()
        snap = ring.take(step, model, opt, None, None, {}, None)
        take_s.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    clones = counts["empty"]
    assert snap is not None
    for _ in range(3):
        t0 = time.perf_counter()
        ring.restore(snap, model, opt, None, None)
        restore_s.append(time.perf_counter() - t0)
    torch.Tensor.clone = real_clone  # type: ignore[method-assign]
    allocations = (host_memory.COUNTS.allocations - before_alloc) if host_memory else 0
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": state_bytes,
        "take_first_s": take_s[0],
        "take_steady_s": statistics.median(take_s[3:]) if takes > 3 else take_s[-1],
        "restore_s": statistics.median(restore_s),
        "peak_snapshots": peak / state_bytes,
        "tensor_clones_per_snapshot": clones / takes,
        "buffers_allocated": allocations,
    }


def run(src: str, params: int, takes: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", "--params", str(params), "--takes", str(takes)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-src", required=False, help="the src/ of the version to compare")
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--takes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.params), args.takes)))
        return
    variants = {"this": str(ROOT / "src")}
    if args.base_src:
        variants = {"base": args.base_src, **variants}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, src in variants.items():
            results[name].append(run(src, int(args.params), args.takes))
    keys = [
        ("take_first_s", "first snapshot (s)"),
        ("take_steady_s", "later snapshots, median (s)"),
        ("restore_s", "restore (s)"),
        ("peak_snapshots", "peak memory added, in snapshots"),
        ("tensor_clones_per_snapshot", "tensor allocations per snapshot"),
        ("buffers_allocated", "host buffers allocated in all"),
    ]
    first = next(iter(results.values()))[0]
    print(
        f"{first['params'] / 1e6:.1f}M params, AdamW, CPU, {first['state_bytes'] / 2**20:.0f} MiB "
        f"a snapshot; {args.takes} snapshots into a ring of 3; median of {args.rounds} rounds"
    )
    print()
    print("| figure | " + " | ".join(variants) + " |")
    print("| --- | " + " | ".join("---" for _ in variants) + " |")
    for key, label in keys:
        row = [f"{statistics.median(r[key] for r in results[name]):.3g}" for name in variants]
        print(f"| {label} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
