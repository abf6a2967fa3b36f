"""Detection quality of trainguard's detectors against the rules the field uses, on a labelled
set of generated LM loss curves.

The generator (`make_curve`, documented below) draws a power-law LM curve with heavy-tailed
(Student-t, 3 to 8 degrees of freedom) noise of 0.5-3% of the level, calmed where its tails
would reach past 1.9x the level once in FA_BUDGET steps (no quiet curve in data/curves goes
further), adds traps that are not incidents (LR warm restarts that lift the loss smoothly for a
while, and a change of noise level as after a batch-size change), and plants 0-3 labelled
incidents of the four spike classes, or a NaN:

- data_toxicity: one step far above the level, back at once;
- gradient_explosion: a jump that stays high and decays over ~100 steps, the grad norm with it;
- optimizer: swings of a fixed period growing for ~150 steps, then a jump;
- architecture: a steady rise over ~150 steps, then a jump;
- nan: a non-finite loss.

An incident is *visible* when its jump clears what the noise itself reaches once in FA_BUDGET
steps (the Student-t quantile at the curve's noise scale there): below that, no rule that keeps
to the false-alarm target can tell it from a noise draw, whatever it knows. The targets are
scored on visible incidents; the faint ones are planted all the same and their recall is shown
apart. An incident spans from its onset (from the start of its build-up for the optimizer and
architecture classes) to WINDOW steps after the loss is back. Its first alarm (loss_spike, or
nonfinite for a NaN) in that span and at most WINDOW steps after the onset detects it; its other
alarms are repeats, counted apart; an alarm in no incident's span is a false alarm. Latency is
from the onset (negative: during the build-up). Type accuracy is over the detected visible
spikes, with trainguard's final (revised) type. The baselines are reimplemented from their
descriptions; they have no types. The oracle knows the noiseless level and the noise's scale
and tails: it marks what the best possible rule could do. The false-alarm target is the rate at
which the noise alone passes a visible incident's height, so even the oracle's count on one seed
is a Poisson draw about it: the verdict pools the seeds.

Run: python benchmarks/detection.py [--curves 200] [--steps 6000] [--seed 0] [--also 1 2]
[--no-write]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from _common import write_section
from trainguard.detectors import DetectorSuite
from trainguard.detectors.series import MetricSeries

CLASSES = ("data_toxicity", "gradient_explosion", "optimizer", "architecture", "nan")
WINDOW = 20  # steps after the onset within which a detection counts
BUILD_UP = 150  # steps of swings or rise before an optimizer or architecture spike
FA_BUDGET = 200_000  # steps per noise draw as tall as a visible jump: 0.05 per 10k steps
MAX_NOISE_REACH = 0.9  # what the noise reaches once in FA_BUDGET steps, as a share of the level


@dataclass
class Incident:
    step: int  # the onset: the first step the loss shows it
    kind: str
    visible: bool = True  # taller than the noise reaches once in FA_BUDGET steps
    length: int = 1  # steps the loss stays off its level from the onset

    @property
    def start(self) -> int:
        return self.step - BUILD_UP if self.kind in ("optimizer", "architecture") else self.step

    @property
    def end(self) -> int:
        """The last step whose alarm belongs to this incident."""
        return self.step + self.length + WINDOW


def t_quantile(nu: float, tail: float) -> float:
    """x with P(T > x) = tail for Student's t with nu degrees of freedom (numeric integral)."""
    x = np.geomspace(1e-3, 1e5, 400_000)
    log_pdf = (
        math.lgamma((nu + 1) / 2)
        - math.lgamma(nu / 2)
        - 0.5 * math.log(nu * math.pi)
        - (nu + 1) / 2 * np.log1p(x * x / nu)
    )
    pdf = np.exp(log_pdf)
    areas = np.diff(x) * 0.5 * (pdf[1:] + pdf[:-1])
    survival = np.concatenate((np.cumsum(areas[::-1])[::-1], [0.0]))
    return float(np.interp(-tail, -survival, x))


@dataclass
class Curve:
    loss: np.ndarray
    grad: np.ndarray
    incidents: list[Incident]
    level: np.ndarray  # the noiseless level with the LR-restart lifts, without the incidents
    scale: np.ndarray  # the noise scale at each step
    tallest_noise: float  # in units of scale: what the noise reaches once in FA_BUDGET steps


def make_curve(rng: np.random.Generator, steps: int) -> Curve:
    """One labelled curve."""
    t = np.arange(steps, dtype=np.float64)
    floor, scale, power = rng.uniform(1.5, 3.0), rng.uniform(4, 8), rng.uniform(0.3, 0.6)
    level = floor + scale * (1 + t / rng.uniform(50, 300)) ** -power
    relative = rng.uniform(0.005, 0.03)
    sigma = relative * level
    nu = rng.uniform(3, 8)
    noise = rng.standard_t(nu, steps) * sigma
    scale = sigma.copy()  # the noise scale at each step
    grad = rng.uniform(0.3, 1.0) * (1 + 0.1 * np.abs(rng.standard_normal(steps)))
    # traps: warm restarts (a smooth lift that decays) and a noise-level change
    for start in rng.choice(np.arange(800, steps - 800), size=rng.integers(0, 3), replace=False):
        lift = rng.uniform(0.02, 0.06) * level[start]
        span = np.arange(steps - start)
        level[start:] += lift * (1 - np.exp(-span / 30)) * np.exp(-span / 400)
    factor = 1.0
    if rng.random() < 0.5:
        change = int(rng.integers(1000, steps - 1000))
        factor = rng.uniform(1.5, 2.5)
        noise[change:] *= factor
        scale[change:] *= factor
    tallest_noise = t_quantile(nu, 1.0 / FA_BUDGET)
    # quiet real curves never double their loss by noise (data/curves: at most 1.9x)
    calm = min(1.0, MAX_NOISE_REACH / (tallest_noise * relative * factor))
    noise *= calm
    scale *= calm
    loss = level + noise
    incidents: list[Incident] = []
    slots = sorted(
        rng.choice(np.arange(600, steps - 400, 400), size=rng.integers(0, 4), replace=False)
    )
    for onset in slots:
        kind = CLASSES[int(rng.integers(len(CLASSES)))]
        onset = int(onset)
        base = level[onset]
        jump = rng.uniform(0.3, 1.5) * base
        length = 5 if kind in ("optimizer", "architecture") else 1
        if kind == "data_toxicity":
            loss[onset] += jump
        elif kind == "gradient_explosion":
            length = min(150, steps - onset)
            span = np.arange(length)
            loss[onset : onset + len(span)] += jump * np.exp(-span / 100)
            grad[onset : onset + len(span)] *= 1 + 20 * np.exp(-span / 100)
        elif kind == "optimizer":
            period = int(rng.integers(6, 20))
            span = np.arange(150)
            swing = 0.02 * base * (span / 150) ** 2 * np.sin(2 * np.pi * span / period) * 6
            loss[onset - 150 : onset] += swing
            loss[onset : onset + 5] += jump
            grad[onset - 150 : onset] *= 1 + (span / 150)
        elif kind == "architecture":
            span = np.arange(150)
            loss[onset - 150 : onset] += 0.25 * base * span / 150
            loss[onset : onset + 5] += jump + 0.25 * base
        else:
            loss[onset] = math.nan
        visible = kind == "nan" or jump > tallest_noise * scale[onset]
        incidents.append(Incident(onset, kind, visible, length))
    return Curve(loss, grad, incidents, level, scale, tallest_noise)


# -- the rules the field uses, reimplemented from their descriptions --------------------------
def _prior(loss: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std of the `window` finite values before each step (NaN before there are any)."""
    x = np.where(np.isfinite(loss), loss, np.nan)
    mean = np.full(len(x), np.nan)
    std = np.full(len(x), np.nan)
    w = np.lib.stride_tricks.sliding_window_view(x[:-1], window)
    with np.errstate(all="ignore"):
        mean[window:] = np.nanmean(w, axis=1)
        std[window:] = np.nanstd(w, axis=1)
    return mean, std


def rule_seed_ratio(loss: np.ndarray) -> np.ndarray:
    mean, _ = _prior(loss, 100)
    return loss > 2 * mean


def rule_seed_z(loss: np.ndarray) -> np.ndarray:
    mean, std = _prior(loss, 100)
    return (loss - mean) / std > 10


def rule_best(loss: np.ndarray) -> np.ndarray:
    best = np.fmin.accumulate(np.where(np.isfinite(loss), loss, np.inf))
    out = np.zeros(len(loss), dtype=bool)
    out[1:] = loss[1:] > 5 * best[:-1]
    return out


def rule_ema(loss: np.ndarray, alpha: float = 0.01) -> np.ndarray:
    out = np.zeros(len(loss), dtype=bool)
    ema = math.nan
    for i, v in enumerate(loss.tolist()):
        if not math.isfinite(v):
            continue
        if math.isfinite(ema) and v > 3 * ema:
            out[i] = True
        ema = v if math.isnan(ema) else (1 - alpha) * ema + alpha * v
    return out


def rule_olmo(loss: np.ndarray) -> np.ndarray:
    mean, std = _prior(loss, 128)
    return loss > mean + 6 * std


def rule_lightning(loss: np.ndarray) -> np.ndarray:
    """Lightning SpikeDetection(mode=min, window=10, rtol=2): |loss - mean| > 2 |mean|."""
    mean, _ = _prior(loss, 10)
    return np.abs(loss - mean) > 2 * np.abs(mean)


def rule_foundry(loss: np.ndarray, patience: int = 4) -> np.ndarray:
    """llm-foundry KillLossSpike: the loss over 2 x the running mean on `patience` steps in a
    row (the running mean of the last 100 non-outliers)."""
    out = np.zeros(len(loss), dtype=bool)
    window: list[float] = []
    streak = 0
    for i, v in enumerate(loss.tolist()):
        if not math.isfinite(v):
            continue
        if len(window) >= 10 and v > 2 * (sum(window) / len(window)):
            streak += 1
            if streak == patience:
                out[i] = True
            continue
        streak = 0
        window.append(v)
        if len(window) > 100:
            window.pop(0)
    return out


BASELINES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "seed: 2 x rolling mean": rule_seed_ratio,
    "seed: z > 10": rule_seed_z,
    "5 x best loss": rule_best,
    "loss > 3 x EMA": rule_ema,
    "OLMo-core: 6 sigma over 128": rule_olmo,
    "Lightning SpikeDetection: rtol 2 over 10": rule_lightning,
    "llm-foundry KillLossSpike: 2 x mean, patience 4": rule_foundry,
}


def rule_oracle(curve: Curve) -> np.ndarray:
    """What a rule knowing the noiseless level, the noise scale and its tails would flag at the
    false-alarm target: every step further over the level than the noise reaches."""
    with np.errstate(invalid="ignore"):
        return np.asarray(curve.loss - curve.level > curve.tallest_noise * curve.scale)


def onsets(mask: np.ndarray) -> list[int]:
    """The first step of each run of flagged steps."""
    idx = np.flatnonzero(mask)
    return [int(i) for k, i in enumerate(idx) if k == 0 or idx[k - 1] != i - 1]


@dataclass
class Score:
    tp: int = 0
    fn: int = 0
    fp: int = 0
    repeats: int = 0
    faint: int = 0
    faint_found: int = 0
    steps: int = 0
    latency: float = 0.0
    typed: int = 0
    typed_right: int = 0

    def add(self, flagged: list[int], incidents: list[Incident], types: dict[int, str] | None):
        left = sorted(set(flagged))
        for inc in incidents:
            inside = [s for s in left if inc.start <= s <= inc.end]
            left = [s for s in left if s not in inside]
            early = [s for s in inside if s <= inc.step + WINDOW]
            if not inc.visible:
                self.faint += 1
                self.faint_found += bool(early)
                continue
            self.repeats += len(inside) - bool(early)
            if not early:
                self.fn += 1
                continue
            hit = early[0]
            self.tp += 1
            self.latency += hit - inc.step
            if types is not None and inc.kind != "nan":
                self.typed += 1
                self.typed_right += types.get(hit) == inc.kind
        self.fp += len(left)

    def __iadd__(self, other: Score) -> Score:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def figures(self) -> tuple[float, float, float, float]:
        """Precision, recall, F1 and false alarms per 10k steps."""
        p = self.tp / max(self.tp + self.fp, 1)
        r = self.tp / max(self.tp + self.fn, 1)
        return p, r, 2 * p * r / max(p + r, 1e-12), self.fp / max(self.steps, 1) * 10_000

    def row(self, name: str) -> str:
        p, r, f1, fa = self.figures()
        lat = self.latency / max(self.tp, 1)
        acc = f"{self.typed_right / self.typed:.3f}" if self.typed else "-"
        rep = self.repeats / max(self.tp, 1)
        faint = self.faint_found / max(self.faint, 1)
        return (
            f"| {name} | {p:.3f} | {r:.3f} | {f1:.3f} | {fa:.3f} | {lat:.1f} | {acc} | "
            f"{rep:.2f} | {faint:.3f} |"
        )


def trainguard_flags(loss: np.ndarray, grad: np.ndarray) -> tuple[list[int], dict[int, str]]:
    series = MetricSeries(np.arange(len(loss), dtype=np.int64), loss, grad)
    events = DetectorSuite().run(series)
    flagged = [e.step for e in events if e.kind in ("loss_spike", "nonfinite")]
    spikes = [e for e in events if e.kind == "loss_spike"]
    types = {e.step: t for e in spikes if (t := e.revised_type(events))}  # the revised type
    return flagged, types


def _summary(score: Score, oracle: Score) -> str:
    _, _, f1, fa = score.figures()
    acc = score.typed_right / max(score.typed, 1)
    return (
        f"F1 {f1:.3f}, {fa:.3f} false alarms per 10k steps ({score.fp} in {score.steps:,} steps; "
        f"the oracle: {oracle.fp}), type accuracy {acc:.3f}"
    )


def _verdict(score: Score, seeds: int) -> str:
    _, _, f1, fa = score.figures()
    acc = score.typed_right / max(score.typed, 1)
    met = f1 >= 0.97 and fa <= 0.05 and acc >= 0.9
    return (
        f"trainguard against its targets, over the {seeds} seeds ({score.steps:,} steps): F1 "
        f"{f1:.3f} (>= 0.97), false alarms {fa:.3f} per 10k steps (<= 0.05), type accuracy "
        f"{acc:.3f} (>= 0.9): " + ("met." if met else "not met yet.")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", type=int, default=200)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--also", type=int, nargs="*", default=[1, 2], help="more seeds, summed up")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    lines, ours, oracle = score_seed(args.curves, args.steps, args.seed)
    pooled, pooled_oracle = Score(), Score()
    pooled += ours
    pooled_oracle += oracle
    lines += ["", f"Seed {args.seed}: {_summary(ours, oracle)}."]
    for seed in args.also:
        _, ours, oracle, _ = run_seed(args.curves, args.steps, seed)
        pooled += ours
        pooled_oracle += oracle
        lines.append(f"Seed {seed}: {_summary(ours, oracle)}.")
    lines += [
        "",
        _verdict(pooled, 1 + len(args.also)),
        f"The false-alarm target is the rate at which the noise itself passes the height of a "
        f"visible incident (once in {FA_BUDGET:,} steps), so even the oracle's count on one seed "
        "is a Poisson draw about that rate: the verdict pools the seeds.",
    ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("detection", "Detection quality", body, "python benchmarks/detection.py")


def run_seed(
    curves: int, steps: int, seed: int
) -> tuple[dict[str, tuple[int, int]], Score, Score, dict[str, Score]]:
    """Every detector over `curves` generated curves: the planted and faint counts per class,
    and the scores of trainguard, the oracle and the baselines."""
    rng = np.random.default_rng(seed)
    ours = Score()
    oracle = Score()
    theirs = {name: Score() for name in BASELINES}
    labels = {k: 0 for k in CLASSES}
    faint = {k: 0 for k in CLASSES}
    for _ in range(curves):
        curve = make_curve(rng, steps)
        loss, incidents = curve.loss, curve.incidents
        for inc in incidents:
            labels[inc.kind] += 1
            faint[inc.kind] += not inc.visible
        flagged, types = trainguard_flags(loss, curve.grad)
        ours.steps += len(loss)
        ours.add(flagged, incidents, types)
        nan_steps = [int(i) for i in np.flatnonzero(~np.isfinite(loss))]
        for name in (*BASELINES, "oracle"):
            with np.errstate(all="ignore"):
                mask = rule_oracle(curve) if name == "oracle" else BASELINES[name](loss)
                found = onsets(mask)
            score = oracle if name == "oracle" else theirs[name]
            score.steps += len(loss)
            score.add(sorted(set(found) | set(nan_steps)), incidents, None)
    counts = {k: (labels[k], faint[k]) for k in CLASSES}
    return counts, ours, oracle, theirs


def score_seed(curves: int, steps: int, seed: int) -> tuple[list[str], Score, Score]:
    """The table of one seed with its setting, and trainguard's and the oracle's scores."""
    start = time.perf_counter()
    counts, ours, oracle, theirs = run_seed(curves, steps, seed)
    secs = time.perf_counter() - start
    labels = {k: n for k, (n, _) in counts.items()}
    faint = {k: f for k, (_, f) in counts.items()}
    total, faint_total = sum(labels.values()), sum(faint.values())
    all_recall = ours.tp / max(ours.tp + ours.fn + ours.faint - ours.faint_found, 1)
    lines = [
        f"{curves} generated curves of {steps:,} steps (seed {seed}), "
        f"{total} planted incidents ({', '.join(f'{n} {k}' for k, n in labels.items())}), "
        f"of which {faint_total} are faint: under the height the noise reaches once in "
        f"{FA_BUDGET:,} steps ({', '.join(f'{n} {k}' for k, n in faint.items() if n)}). "
        "Traps: LR warm restarts and noise-level changes. An incident is detected by the first "
        f"alarm from the start of its build-up to {WINDOW} steps after its onset; more alarms "
        "there are repeats. Every rule is also given the NaN steps, which any check sees. "
        "Targets for trainguard: F1 >= 0.97, <= 0.05 false alarms per 10k steps, type "
        "accuracy >= 0.9, on the visible incidents.",
        "",
        "| detector | precision | recall | F1 | false alarms / 10k steps | latency (steps) | "
        "type accuracy | repeats per incident | recall of faint incidents |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ours.row("**trainguard** (DetectorSuite, defaults)"),
        *(score.row(name) for name, score in theirs.items()),
        oracle.row("oracle: the true level, noise scale and tails (not a rule one can run)"),
        "",
        f"Counting the faint incidents as misses too, trainguard's recall is {all_recall:.3f}.",
        f"({secs:.0f} s for this seed.)",
    ]
    return lines, ours, oracle


if __name__ == "__main__":
    main()
