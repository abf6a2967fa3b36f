"""Per-rank checks on simulated DDP ranks (one process, CPU): false alarms on healthy ranks with
small batches, and the share of corrupted-gradient steps caught.

Each of `world` ranks computes its loss and its own gradient norm on its own batch; the update
is the mean of the ranks' gradients, as DDP's all-reduce makes it. With `--fault F`, rank 1's
gradients are multiplied by F at steps 50, 150, 250, ... (the update is then skipped, as the
guard would skip it when it names the rank). Seeds: tune on even, report on odd.

Run: PYTHONPATH=src python benchmarks/rank_noise.py [--seeds 1,3,5] [--fault 1000] [--steps 600]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

from trainguard.config import RanksConfig
from trainguard.detectors.base import MetricPoint
from trainguard.detectors.ranks import RankOutlierDetector

REGIMES = (  # (world, task, per-rank batch)
    (3, "regression", 32),
    (3, "classifier", 32),
    (2, "regression", 8),
    (8, "classifier", 4),
)


def run(seed: int, world: int, task: str, batch: int, steps: int, fault: float) -> tuple[int, int]:
    """(rank_outlier events on healthy steps, faulty steps whose rank 1 was named)."""
    torch.manual_seed(seed)
    outputs = 1 if task == "regression" else 5
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, outputs))
    w = torch.randn(16, outputs)

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch, 16)
        y = x @ w + (0.1 if task == "regression" else 0.5) * torch.randn(batch, outputs)
        return x, (y if task == "regression" else y.argmax(1))

    loss_fn = nn.functional.mse_loss if task == "regression" else nn.functional.cross_entropy
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    detector = RankOutlierDetector(RanksConfig())
    false_alarms = caught = 0
    for step in range(steps):
        faulty = fault > 1 and step % 100 == 50
        losses, norms, total = [], [], None
        for rank in range(world):
            x, y = data()
            model.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
            if faulty and rank == 1:
                grads = [g * fault for g in grads]
            losses.append(float(loss.detach()))
            norms.append(float(torch.nn.utils.get_total_norm(grads)))
            total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        point = MetricPoint(step, float(np.mean(losses)), rank_losses=losses, rank_grad_norms=norms)
        events = detector.update(point)
        if faulty:
            caught += any(1 in e.metrics["ranks"] for e in events)
            continue  # the guard skips the step on every rank
        false_alarms += len(events)
        assert total is not None
        for p, g in zip(model.parameters(), total, strict=True):
            p.grad = g / world
        opt.step()
    return false_alarms, caught


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,3,5")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--fault", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    alarms = caught = planted = 0
    for seed in (int(s) for s in args.seeds.split(",")):
        for world, task, batch in REGIMES:
            a, c = run(seed, world, task, batch, args.steps, args.fault)
            n = len(range(50, args.steps, 100)) if args.fault > 1 else 0
            alarms, caught, planted = alarms + a, caught + c, planted + n
            print(f"seed {seed}, {world} ranks, {task}, batch {batch}: {a} false, {c}/{n} caught")
    print(f"total: {alarms} rank_outlier events on healthy steps; {caught}/{planted} caught")


if __name__ == "__main__":
    main()
