"""Per-rank checks on simulated DDP ranks (one process, CPU): false alarms on healthy ranks with
small batches, and the share of corrupted-gradient steps caught.

Each of `world` ranks computes its loss and its own gradient norm on its own batch; the update
is the mean of the ranks' gradients, as DDP's all-reduce makes it. With `--fault F`, rank 1's
gradients are multiplied by F at steps 50, 150, 250, ... (the update is then skipped, as the
guard would skip it when it names the rank). Seeds: tune on even, report on odd.

`--exchange reduce` (the default) judges as the `reduce` exchange does: one detector a rank, each
learning its own line against the others' geometric mean, the SUM and MAX done here in Python;
`--exchange gather` as the all-gather did: one detector over every rank's figures.

Run: PYTHONPATH=src python benchmarks/rank_noise.py [--seeds 1,3,5] [--fault 1000] [--steps 600]
     [--exchange reduce|gather]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from torch import nn

from trainguard.config import RanksConfig
from trainguard.detectors.base import MetricPoint, RankMetric
from trainguard.detectors.ranks import METRICS, RankOutlierDetector
from trainguard.events import Event

REGIMES = (  # (world, task, per-rank batch)
    (3, "regression", 32),
    (3, "classifier", 32),
    (2, "regression", 8),
    (8, "classifier", 4),
)


def reduced(
    detectors: list[RankOutlierDetector], step: int, figures: dict[str, list[float]]
) -> list[Event]:
    """One step as the `reduce` exchange judges it: each rank scores itself against its own
    line and the others' geometric mean (the SUM), the worst key and reach (the MAX) decide, and
    every rank's detector sees the same summaries with its own log-ratio; rank 0's events."""
    world = len(detectors)
    points = [MetricPoint(step, 0.0, rank_metrics={}) for _ in range(world)]
    for metric in METRICS:
        values = figures[metric]
        logs = [math.log(v) for v in values]
        total = sum(logs)
        own = [log - (total - log) / (world - 1) for log in logs]
        rules = [d.own_rule(metric) for d in detectors]
        keys = []
        for d, rule in zip(own, rules, strict=True):
            if not rule.warm:
                keys.append(math.inf if d > rule.limit else -math.inf)
            else:
                excess = d - rule.centre
                keys.append(excess / rule.spread if excess > rule.lowest else -math.inf)
        reach = max(rule.reach for rule in rules)
        worst = max(range(world), key=lambda r: keys[r])
        bar = detectors[0].bar(metric, reach)
        named = sorted(
            ((r, values[r], keys[r]) for r in range(world) if keys[r] > bar), key=lambda n: -n[2]
        )
        for r, point in enumerate(points):
            assert point.rank_metrics is not None
            point.rank_metrics[metric] = RankMetric(
                world=world,
                mean_log=total / world,
                positive=True,
                nonfinite=0,
                worst=keys[worst],
                worst_rank=worst,
                reach=reach,
                high=max(values),
                high_rank=values.index(max(values)),
                low=min(values),
                low_rank=values.index(min(values)),
                own=own[r],
                named=named[:8],
                more=len(named) > 8,
            )
    found = [d.update(point) for d, point in zip(detectors, points, strict=True)]
    return found[0]


def run(
    seed: int, world: int, task: str, batch: int, steps: int, fault: float, exchange: str
) -> tuple[int, int]:
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
    detectors = [RankOutlierDetector(RanksConfig()) for _ in range(world)]
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
        if exchange == "reduce":
            events = reduced(detectors, step, {"loss": losses, "grad_norm": norms})
        else:
            point = MetricPoint(
                step, float(np.mean(losses)), rank_losses=losses, rank_grad_norms=norms
            )
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
    parser.add_argument("--exchange", choices=("reduce", "gather"), default="reduce")
    args = parser.parse_args()
    torch.set_num_threads(1)
    alarms = caught = planted = 0
    for seed in (int(s) for s in args.seeds.split(",")):
        for world, task, batch in REGIMES:
            a, c = run(seed, world, task, batch, args.steps, args.fault, args.exchange)
            n = len(range(50, args.steps, 100)) if args.fault > 1 else 0
            alarms, caught, planted = alarms + a, caught + c, planted + n
            print(f"seed {seed}, {world} ranks, {task}, batch {batch}: {a} false, {c}/{n} caught")
    print(f"total: {alarms} rank_outlier events on healthy steps; {caught}/{planted} caught")


if __name__ == "__main__":
    main()
