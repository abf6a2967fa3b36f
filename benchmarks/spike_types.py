"""Spike types on a second, independent generator of loss and grad-norm curves: a held-out check
of the type `loss_spike` gives (and `spike_classified` revises), on shapes other than those of
`benchmarks/detection.py`.

The generator (`make_run`) differs from detection.py's in every part:

- schedules: linear warmup then cosine decay, warmup-stable-decay (a faster fall in the last
  15-25%), or step decay (the loss drops by 3-8% at each of 2-3 LR drops); the loss is an
  exponential approach to a floor, not a power law;
- noise: AR(1) (phi 0.2-0.8) with Gaussian, Laplace or contaminated-Gaussian (2% of steps at
  3x) innovations, 0.7-2.5% of the level; the grad norm is log-normal about a slowly decaying
  level, AR(1) too;
- spike forms, each labelled with the cause an expert reads from the evidence:
  - data_toxicity, one bad batch: one step 1.4-3x the level, the grad norm up on that step only
    (a bad batch gives large gradients), back at once; or two bad batches some steps apart;
  - data_toxicity, a shard that degrades into noise: from a step on, the loss climbs (linearly
    or faster) to 1.3-2.5x over 8-30 steps while the grad norm stays within 30% of its level,
    then is back when the shard ends (after 8-40 steps);
  - gradient_explosion: the grad norm grows 3-40x over 3-12 steps first, then the loss jumps
    and stays up, decaying over 30-300 steps (or climbing for 2-5 steps first);
  - optimizer: swings of the loss (sine, triangle or square, period 4-40 steps) growing
    (linearly or exponentially) over 80-250 steps, the grad norm swinging with them, then a jump
    of 2-10 steps;
  - architecture: a slow rise of the loss by 10-40% (linear, quadratic or exponential) over
    100-400 steps with the grad norm flat or up by at most 1.5x, then a jump that lasts 5-50
    steps.

Scoring: a planted spike is detected by the first `loss_spike` from the start of its build-up
to 20 steps after its onset and its whole length; its type is the final (revised) one, as the
report card and `trainguard analyze` show it. Type accuracy is over the detected spikes. Seeds
split the set: the tune seeds (default 0, 2, 4) are the half the classifier may be tuned on,
the report seeds (1, 3, 5) the half reported.

Run: python benchmarks/spike_types.py [--curves 60] [--steps 4000] [--tune 0 2 4]
[--report 1 3 5] [--no-write]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from _common import write_section
from trainguard.detectors import DetectorSuite
from trainguard.detectors.series import MetricSeries

TYPES = ("data_toxicity", "gradient_explosion", "optimizer", "architecture")
FORMS = ("bad_batch", "two_bad_batches", "shard", "explosion", "optimizer", "architecture")
LABEL = {
    "bad_batch": "data_toxicity",
    "two_bad_batches": "data_toxicity",
    "shard": "data_toxicity",
    "explosion": "gradient_explosion",
    "optimizer": "optimizer",
    "architecture": "architecture",
}
AFTER = 20  # steps after a spike's onset (and its length) within which a detection counts


@dataclass
class Planted:
    form: str
    start: int  # the first step of its build-up (its onset where it has none)
    onset: int  # the first step the jump shows
    length: int  # steps the loss stays off its level from the onset

    @property
    def label(self) -> str:
        return LABEL[self.form]


@dataclass
class Run:
    loss: np.ndarray
    grad: np.ndarray
    planted: list[Planted]


def _level(rng: np.random.Generator, t: np.ndarray) -> np.ndarray:
    """The noiseless loss under one of three schedules."""
    n = len(t)
    floor, height, tau = rng.uniform(1.2, 3.2), rng.uniform(3.0, 8.0), rng.uniform(80, 600)
    level = floor + height * np.exp(-t / tau)
    schedule = rng.choice(["cosine", "wsd", "step"])
    if schedule == "cosine":  # a slow extra fall as the LR decays
        level -= rng.uniform(0.02, 0.08) * floor * (1 - np.cos(np.pi * t / n)) / 2
    elif schedule == "wsd":
        start = int(rng.uniform(0.75, 0.85) * n)
        level[start:] -= rng.uniform(0.04, 0.1) * floor * (t[start:] - start) / (n - start)
    else:
        for drop in sorted(rng.choice(np.arange(n // 4, n - 200), rng.integers(2, 4), False)):
            level[drop:] -= rng.uniform(0.03, 0.08) * level[drop]
    return level


def _noise(rng: np.random.Generator, n: int) -> np.ndarray:
    """AR(1) noise of unit scale with Gaussian, Laplace or contaminated innovations."""
    kind = rng.choice(["gauss", "laplace", "mixture"])
    if kind == "gauss":
        shocks = rng.normal(0, 1, n)
    elif kind == "laplace":
        shocks = rng.laplace(0, 1 / np.sqrt(2), n)
    else:
        shocks = rng.normal(0, 1, n) * np.where(rng.random(n) < 0.02, 3.0, 1.0)
    phi = rng.uniform(0.2, 0.8)
    out = np.empty(n)
    out[0] = shocks[0]
    for i in range(1, n):
        out[i] = phi * out[i - 1] + np.sqrt(1 - phi * phi) * shocks[i]
    return out


def _shape(rng: np.random.Generator, k: np.ndarray, span: int) -> np.ndarray:
    """A rise from 0 to 1 over `span` steps: linear, quadratic or exponential."""
    x = k / span
    form = rng.choice(["linear", "quadratic", "exponential"])
    if form == "linear":
        return x
    if form == "quadratic":
        return x * x
    return np.expm1(3 * x) / np.expm1(3)


def make_run(rng: np.random.Generator, steps: int) -> Run:
    """One curve with 0-3 planted spikes."""
    t = np.arange(steps, dtype=np.float64)
    level = _level(rng, t)
    loss = level * (1 + rng.uniform(0.007, 0.025) * _noise(rng, steps))
    grad_level = rng.uniform(0.2, 2.0) * (1 + 2 * np.exp(-t / rng.uniform(100, 500)))
    grad = grad_level * np.exp(rng.uniform(0.05, 0.2) * _noise(rng, steps))
    planted: list[Planted] = []
    slots = sorted(rng.choice(np.arange(700, steps - 500, 500), rng.integers(0, 4), False))
    for slot in slots:
        onset = int(slot) + int(rng.integers(-50, 50))
        form = FORMS[int(rng.integers(len(FORMS)))]
        base = level[onset]
        if form == "bad_batch":
            loss[onset] = base * rng.uniform(1.4, 3.0)
            grad[onset] *= rng.uniform(2, 10)
            planted.append(Planted(form, onset, onset, 1))
        elif form == "two_bad_batches":
            gap = int(rng.integers(8, 60))
            for at in (onset, onset + gap):
                loss[at] = level[at] * rng.uniform(1.4, 3.0)
                grad[at] *= rng.uniform(2, 10)
            planted.append(Planted(form, onset, onset, 1))
            planted.append(Planted(form, onset + gap, onset + gap, 1))
        elif form == "shard":
            climb, stay = int(rng.integers(8, 31)), int(rng.integers(0, 11))
            peak = rng.uniform(1.3, 2.5)
            k = np.arange(climb + stay)
            rise = np.minimum(_shape(rng, k + 1, climb), 1.0)
            loss[onset : onset + len(k)] += base * (peak - 1) * rise
            grad[onset : onset + len(k)] *= 1 + rng.uniform(0.0, 0.3) * rise
            planted.append(Planted(form, onset, onset, len(k)))
        elif form == "explosion":
            build = int(rng.integers(3, 13))
            k = np.arange(build)
            grad[onset - build : onset] *= np.exp(np.log(rng.uniform(3, 40)) * (k + 1) / build)
            decay = rng.uniform(30, 300)
            length = min(int(3 * decay), steps - onset)
            k = np.arange(length)
            climb = int(rng.integers(1, 6))
            jump = base * rng.uniform(0.5, 2.0) * np.minimum((k + 1) / climb, 1.0)
            loss[onset : onset + length] += jump * np.exp(-k / decay)
            grad[onset : onset + length] *= 1 + rng.uniform(5, 30) * np.exp(-k / (decay / 3))
            planted.append(Planted(form, onset - build, onset, length))
        elif form == "optimizer":
            span, period = int(rng.integers(80, 251)), int(rng.integers(4, 41))
            k = np.arange(span)
            phase = 2 * np.pi * k / period
            wave = {
                "sine": np.sin(phase),
                "triangle": 2 / np.pi * np.arcsin(np.sin(phase)),
                "square": np.sign(np.sin(phase)),
            }[str(rng.choice(["sine", "triangle", "square"]))]
            grow = _shape(rng, k, span)
            amplitude = rng.uniform(0.04, 0.12) * base
            loss[onset - span : onset] += amplitude * grow * wave
            grad[onset - span : onset] *= 1 + 0.5 * grow * (1 + wave) / 2
            length = int(rng.integers(2, 11))
            loss[onset : onset + length] += base * rng.uniform(0.4, 1.5)
            planted.append(Planted(form, onset - span, onset, length))
        else:
            span = int(rng.integers(100, 401))
            k = np.arange(span)
            rise = rng.uniform(0.1, 0.4) * base * _shape(rng, k, span)
            loss[onset - span : onset] += rise
            grad[onset - span : onset] *= 1 + rng.uniform(0.0, 0.5) * k / span
            length = int(rng.integers(5, 51))
            loss[onset : onset + length] += rise[-1] + base * rng.uniform(0.4, 1.5)
            planted.append(Planted(form, onset - span, onset, length))
    return Run(loss, grad, planted)


@dataclass
class Tally:
    planted: Counter[str]
    detected: Counter[str]
    right: Counter[str]
    confusion: Counter[tuple[str, str]]  # (form, final type) of the detected ones

    @classmethod
    def empty(cls) -> Tally:
        return cls(Counter(), Counter(), Counter(), Counter())

    def accuracy(self, forms: tuple[str, ...] = FORMS) -> float:
        detected = sum(self.detected[f] for f in forms)
        return sum(self.right[f] for f in forms) / detected if detected else float("nan")


def judge(run: Run, tally: Tally) -> None:
    """Add a run's planted spikes, their detection and final type to `tally`."""
    series = MetricSeries(np.arange(len(run.loss), dtype=np.int64), run.loss, run.grad)
    events = DetectorSuite().run(series)
    spikes = [e for e in events if e.kind == "loss_spike"]
    for p in run.planted:
        tally.planted[p.form] += 1
        hit = next((e for e in spikes if p.start <= e.step <= p.onset + p.length + AFTER), None)
        if hit is None:
            continue
        final = str(hit.revised_type(events))
        tally.detected[p.form] += 1
        tally.right[p.form] += final == p.label
        tally.confusion[(p.form, final)] += 1


def tally_of(seeds: list[int], curves: int, steps: int) -> Tally:
    tally = Tally.empty()
    for seed in seeds:
        rng = np.random.default_rng(1000 + seed)
        for _ in range(curves):
            judge(make_run(rng, steps), tally)
    return tally


def table(tally: Tally) -> list[str]:
    lines = [
        "| form (label) | planted | detected | typed right | final types of the detected |",
        "|---|---:|---:|---:|---|",
    ]
    for form in FORMS:
        got = {t: n for (f, t), n in sorted(tally.confusion.items()) if f == form}
        said = ", ".join(f"{t} {n}" for t, n in got.items()) or "-"
        lines.append(
            f"| {form} ({LABEL[form]}) | {tally.planted[form]} | {tally.detected[form]} | "
            f"{tally.right[form]} | {said} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", type=int, default=60, help="curves per seed")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--tune", type=int, nargs="*", default=[0, 2, 4])
    parser.add_argument("--report", type=int, nargs="*", default=[1, 3, 5])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    halves = {
        "tune": tally_of(args.tune, args.curves, args.steps),
        "report": tally_of(args.report, args.curves, args.steps),
    }
    elapsed = time.perf_counter() - started
    lines = [
        f"The independent generator of `benchmarks/spike_types.py` (its docstring): {args.curves} "
        f"curves of {args.steps:,} steps a seed, 0-3 planted spikes each in six forms labelled "
        "by cause (one or two bad batches and a shard that degrades into noise are data "
        "toxicity). Type accuracy is the final (revised) type over the detected spikes. Tune "
        f"seeds {', '.join(map(str, args.tune))}; report seeds "
        f"{', '.join(map(str, args.report))} (held out).",
    ]
    for name, tally in halves.items():
        acc = tally.accuracy()
        arch = tally.right["architecture"], tally.detected["architecture"]
        lines += [
            "",
            f"**{name}**: type accuracy {acc:.3f} over {sum(tally.detected.values())} detected "
            f"of {sum(tally.planted.values())} planted; architecture {arch[0]} of {arch[1]}.",
            "",
            *table(tally),
        ]
    lines += ["", f"({elapsed:.0f} s.)"]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(
            "spike_types",
            "Spike types on a second, independent generator (issue 37)",
            body,
            "python benchmarks/spike_types.py",
        )


if __name__ == "__main__":
    main()
