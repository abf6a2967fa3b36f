"""The per-step exchange at 8 to 16,384 ranks, simulated on one process: the old all-gather of
one row per rank (`ranks.exchange: gather`) beside the two fixed-size reductions (`reduce`).

No collective runs: the all-gather returns a prepared (world, k) tensor of synthetic rows, the
SUM multiplies this rank's vector by the world (as if every rank sent the same) and the MAX
leaves it as it is. What is timed is the guard's per-step host work on one rank: the exchange's
packing and unpacking, the step's one host transfer (its size is given), the rank detectors
(`rank_outlier`, `straggler`, with a full history of `ranks.window` steps) and the per-rank part
of the metrics record, serialised. The bytes are the payloads each rank sends and receives,
with the ring formulas: an all-gather of W rows of k bytes sends and receives (W-1) k; an
all-reduce of n bytes sends and receives 2 (W-1)/W n.

Run: python benchmarks/scale.py [--steps 200] [--no-write]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from typing import Any

import torch

from _common import gpt, write_section
from trainguard.config import GuardConfig
from trainguard.detectors.base import MetricPoint
from trainguard.detectors.ranks import RankOutlierDetector, StragglerDetector
from trainguard.distributed.context import RankContext
from trainguard.distributed.exchange import StepExchange
from trainguard.distributed.reduce import ReduceExchange
from trainguard.recorder import rank_summary
from trainguard.signals.gradients import GradientStats, Measurement

WORLDS = (8, 64, 512, 4096, 16384)


def measurement() -> tuple[GradientStats, Measurement]:
    """One real step's measurement of the benchmark GPT (its layer groups set the row size)."""
    model, opt = gpt()
    x = torch.randint(0, 256, (2, 128))
    loss = model.loss(model(x), x)
    loss.backward()
    stats = GradientStats(model, opt, GuardConfig().group_patterns)
    return stats, stats.measure(loss, opt)


def context(world: int) -> RankContext:
    return RankContext(0, world, ["host"] * world, torch.device("cpu"))


def gather_rows(world: int, width: int, groups: int) -> torch.Tensor:
    """Synthetic rows as the all-gather would return them: healthy ranks a little apart."""
    g = torch.Generator().manual_seed(0)
    rows = torch.zeros(world, width)
    rows[:, 0] = 2.0 + 0.05 * torch.randn(world, generator=g)  # loss
    rows[:, 3] = 1.0 + 0.05 * torch.randn(world, generator=g)  # own grad norm, squared
    rows[:, 4] = 0.1 + 0.005 * torch.rand(world, generator=g)  # step time
    rows[:, 5] = 0.01  # data wait
    assert width == 7 + groups
    return rows


def warm_gather(detector: RankOutlierDetector, world: int) -> None:
    """A full window of per-rank history, as a long healthy run leaves it."""
    g = torch.Generator().manual_seed(1)
    window = detector.config.window
    for metric in ("loss", "grad_norm"):
        past = 0.02 * torch.randn(world, window, generator=g)
        detector.history[metric] = past.tolist()


def warm_reduce(detector: RankOutlierDetector) -> None:
    g = torch.Generator().manual_seed(1)
    for metric in ("loss", "grad_norm"):
        detector.own[metric] = (0.02 * torch.randn(detector.config.window, generator=g)).tolist()


def time_steps(step: Any, steps: int, warmup: int = 5) -> float:
    """Median seconds of `step()` over `steps` calls, after `warmup` unmeasured."""
    for i in range(warmup):
        step(i)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        step(warmup + i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_gather(
    world: int, stats: GradientStats, template: Measurement, steps: int
) -> dict[str, Any]:
    groups = len(stats.groups)
    rows = gather_rows(world, 7 + groups, groups)
    exchange = StepExchange(context(world))
    exchange.gather = lambda vector: rows  # type: ignore[method-assign]
    outlier, straggler = RankOutlierDetector(), StragglerDetector()
    warm_gather(outlier, world)
    sizes: dict[str, int] = {}

    def step(i: int) -> None:
        m = dataclasses.replace(template)
        exchange.share(m, None, None, 0.01, time.perf_counter() - 0.1)
        sizes["transfer"] = m.packed.numel() * 4
        signals = stats.resolve(m)  # the step's one host transfer
        point = MetricPoint(step=i, loss=signals.loss, grad_norm=signals.grad_norm)
        exchange.add_rank_figures(point, signals.extra)
        outlier.update(point)
        straggler.update(point)
        json.dumps(
            {
                "loss": point.rank_losses,
                "grad_norm": point.rank_grad_norms,
                "step_time_s": point.rank_step_times,
                "data_wait_s": point.rank_data_waits,
            }
        )

    # seconds a step from 4,096 ranks on (minutes at 16,384): one or two steps tell
    big = world >= 4096
    seconds = time_steps(step, max(1, min(steps, 8192 // world)), warmup=0 if big else 1)
    row = (7 + groups) * 4
    return {
        "host_ms": seconds * 1000,
        "sent": (world - 1) * row,
        "received": (world - 1) * row,
        "transfer": sizes["transfer"],
    }


def run_reduce(
    world: int, stats: GradientStats, template: Measurement, steps: int, incident: bool
) -> dict[str, Any]:
    outlier, straggler = RankOutlierDetector(), StragglerDetector()
    warm_reduce(outlier)
    exchange = ReduceExchange(context(world), outlier, straggler)
    payload: dict[str, int] = {}
    groups = len(stats.groups)
    sum_logs = 2 + groups  # where the SUM's sums of logs begin

    def fake(tensor: torch.Tensor, op: Any) -> None:
        payload[str(tensor.dtype) + str(tensor.numel())] = tensor.numel() * tensor.element_size()
        if op == torch.distributed.ReduceOp.SUM:
            tensor.mul_(world)
            if incident:  # the other ranks' loss e^-3 of this rank's: it is out of line
                tensor[sum_logs] -= 3.0 * (world - 1)
        exchange.calls += 1

    exchange._reduce = fake  # type: ignore[method-assign]
    sizes: dict[str, int] = {}
    named: list[int] = []

    def step(i: int) -> None:
        m = dataclasses.replace(template)
        exchange.share(m, None, None, 0.01, time.perf_counter() - 0.1)
        sizes["transfer"] = m.packed.numel() * 4
        signals = stats.resolve(m)
        point = MetricPoint(step=i, loss=signals.loss, grad_norm=signals.grad_norm)
        exchange.add_rank_figures(point, signals.extra)
        events = outlier.update(point)
        straggler.update(point)
        json.dumps(rank_summary(point))
        named.append(len(events))

    before = exchange.calls
    seconds = time_steps(step, steps)
    per_step = sum(payload.values()) if not incident else 0
    if incident:
        assert all(named), "the planted rank was not named"
    bytes_each = math.ceil(2 * (world - 1) / world * per_step)
    return {
        "host_ms": seconds * 1000,
        "sent": bytes_each,
        "received": bytes_each,
        "transfer": sizes["transfer"],
        "payload": per_step,
        "calls": (exchange.calls - before) / (steps + 5),  # after the 5 unmeasured too
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stats, template = measurement()
    lines = [
        f"One process (torch {torch.__version__}, one thread), the benchmark GPT's "
        f"{len(stats.groups)} layer groups; median host time of a step over {args.steps} steps "
        "(after 5; the all-gather's over min(steps, 8,192 / W), at least 1, after 1, or none "
        "from 4,096 ranks on, where one step takes seconds), the rank detectors warm (a full "
        "window of history). Bytes: what each rank "
        "sends and receives per step, ring formulas (all-gather (W-1) x row; all-reduce "
        "2 (W-1)/W x payload); transfer: the step's one device-to-host copy.",
        "",
        "| ranks | gather: sent = received | gather: host transfer | gather: host ms | "
        "reduce: sent = received | reduce: host transfer | reduce: host ms | "
        "reduce: host ms, a step naming a rank |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world in WORLDS:
        old = run_gather(world, stats, template, args.steps)
        new = run_reduce(world, stats, template, args.steps, incident=False)
        hit = run_reduce(world, stats, template, max(20, args.steps // 4), incident=True)
        lines.append(
            f"| {world:,} | {old['sent']:,} B | {old['transfer']:,} B | {old['host_ms']:.2f} | "
            f"{new['sent']:,} B | {new['transfer']:,} B | {new['host_ms']:.2f} | "
            f"{hit['host_ms']:.2f} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        f"The reduce exchange makes {new['calls']:.0f} collectives a step (a SUM of float32, "
        f"then a MAX of int64: {new['payload']} bytes of payload together, whatever the world); "
        "a step whose MAX points at a rank adds one MAX round per rank named (at most 8), "
        "which carries the named rank's own figures.",
        "",
        f"At {WORLDS[-1]:,} ranks (targets: at most 1 KB a rank a step, at most 2 ms of host "
        f"time): the reductions send {new['sent']:,} B and receive {new['received']:,} B a rank "
        f"a step, in {new['host_ms']:.2f} ms of host time; the all-gather sent and received "
        f"{old['sent']:,} B and took {old['host_ms'] / 1000:.1f} s.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(
            "scale", "The exchange at 8 to 16,384 ranks", body, "python benchmarks/scale.py"
        )


if __name__ == "__main__":
    main()
