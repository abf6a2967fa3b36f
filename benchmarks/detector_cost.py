"""Live cost of the detectors: microseconds per `DetectorSuite.update` on a realistic run.

Feeds N steps (a noisy decaying loss with a few spikes, a grad norm, a warmup-then-cosine LR)
through a `DetectorSuite(GuardConfig())` and prints the best of `--repeat` timings in µs a step.
Run: `PYTHONPATH=src python benchmarks/detector_cost.py`; to compare with older code, point
PYTHONPATH at a worktree of it (`git worktree add /tmp/old 40f9630`,
`PYTHONPATH=/tmp/old/src python benchmarks/detector_cost.py`) in the same session.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from trainguard.config import GuardConfig
from trainguard.detectors import DetectorSuite
from trainguard.detectors.base import MetricPoint


def make_points(n: int, seed: int = 0) -> list[MetricPoint]:
    """A run of `n` steps: power-law loss fall with Student-t noise and four spikes, a grad norm
    that jumps with the spikes, and a warmup-then-cosine LR."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    loss = 2.0 + 8.0 / np.sqrt(1 + t / 100) + 0.03 * rng.standard_t(5, n)
    grad = 0.5 + 0.05 * np.abs(rng.standard_normal(n))
    for at in np.linspace(n // 5, n - n // 5, 4).astype(int):
        loss[at] += 2.0
        grad[at] *= 6.0
    lr = 3e-4 * np.minimum(1, (t + 1) / 2000) * (0.55 + 0.45 * np.cos(np.pi * t / n))
    return [
        MetricPoint(step=int(s), loss=float(v), grad_norm=float(g), lr=float(r))
        for s, v, g, r in zip(t.tolist(), loss.tolist(), grad.tolist(), lr.tolist(), strict=True)
    ]


def time_updates(points: list[MetricPoint]) -> tuple[float, int]:
    """Seconds to feed every point through a fresh suite, and the events it raised."""
    suite = DetectorSuite(GuardConfig())
    events = 0
    start = time.perf_counter()
    for point in points:
        events += len(suite.update(point))
    return time.perf_counter() - start, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3, help="timings taken; the best is shown")
    args = parser.parse_args()
    points = make_points(args.steps)
    best, events = min(time_updates(points) for _ in range(args.repeat))
    print(f"{best / args.steps * 1e6:.1f} us/step over {args.steps:,} steps ({events} events)")


if __name__ == "__main__":
    main()
