"""The precursor early warning and the preemptive actions on an LR sweep (issue 21, part 5).

A small transformer without QK-norm (2 layers, 1 head, d=64) learns the demo's character corpus
on the CPU at 10 learning rates from 1e-3 to 0.4 for 1500 steps (a linear warmup over the first
600, then a cosine to a tenth), under a Guard that only watches (no skip, no rollback) with the
precursor probe every 5 steps (its default is 50). High-LR runs diverge through
attention-logit growth: their loss climbs back up. For the runs whose loss spikes: how many
steps before the spike the precursor warning came (median, worst, the share 20 or more steps
ahead), and what the loss-only detectors saw on the same runs; on the others: the warnings
given (false warnings). Then each warned run again with the preemptive actions on: the share of
diverging runs that stay stable and end within 2% of the best stable run's loss. The
preemptive setting is chosen on the tuning seed only and reported on the others.

Each run's raw figures are cached in a JSON file (`--cache`), so a rerun only re-scores. About
25 minutes on a loaded 2-core machine (one thread, runs one after another).

Run: nice python benchmarks/early_warning.py [--steps 1500] [--warmup 0.4] [--every 50]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg
from _common import write_section
from trainguard.demo.data import TextCorpus

LRS = [float(x) for x in np.geomspace(1e-3, 0.4, 10)]
TUNE_SEEDS = (0,)
REPORT_SEEDS = (1, 2)
BATCH, SEQ, D_MODEL, LAYERS, HEADS = 16, 32, 64, 2, 1
WARMUP_SHARE = 0.4  # 600 of the default 1500 steps
FINAL_LR_SHARE = 0.1
EVERY = 5  # steps between the probe's sampled steps (the library's default: 50)
SPIKE_RISE = 0.05  # a loss spike: the loss's EMA 5% over its lowest so far
SPIKE_EMA = 0.05  # a 20-step mean: at 0.1, batch noise alone crossed 5% late in long runs
SAVED_WITHIN = 0.02
LEAD_AHEAD = 20
# the preemptive settings tried on the tuning seed (max-logit clipping alone, `qk_rescale`,
# changed nothing on the 500-step sweep: its diverging runs ended at 2.87 against 2.84 watched)
VARIANTS: dict[str, dict[str, Any]] = {
    "qk_rescale+lr_cut": {"actions": ["qk_rescale", "lr_cut"], "lr_factor": 0.7},
    "qk_rescale+lr_cut 0.3": {"actions": ["qk_rescale", "lr_cut"], "lr_factor": 0.3},
    "qk_rescale+lr_cut 0.1": {"actions": ["qk_rescale", "lr_cut"], "lr_factor": 0.1},
    "qk_rescale+lr_cut 0.03": {"actions": ["qk_rescale", "lr_cut"], "lr_factor": 0.03},
    "lr_cut 0.3": {"actions": ["lr_cut"], "lr_factor": 0.3},
}
LOSS_KINDS = ("loss_spike", "divergence", "grad_explosion", "grad_spike", "oscillation", "stall")


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/o projections (Llama's names), no QK-norm."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q, k, v = (
            p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, c))
        return out


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class LM(nn.Module):
    """Token and position embeddings, pre-LN blocks, a final norm and a vocabulary-wide head."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block(D_MODEL, HEADS) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


def schedule(steps: int, share: float) -> Any:
    """A linear warmup over `share` of the steps, then a cosine to `FINAL_LR_SHARE`."""
    warmup = max(1, int(share * steps))

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = (s - warmup) / max(1, steps - warmup)
        return FINAL_LR_SHARE + (1 - FINAL_LR_SHARE) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train(
    lr: float, seed: int, steps: int, preempt: dict[str, Any] | None, warmup: float, every: int
) -> dict[str, Any]:
    """One run under a watching Guard; the loss a step and every event's step, kind, metrics."""
    torch.manual_seed(seed)
    corpus = TextCorpus.load()
    model = LM(corpus.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(steps, warmup))
    config = tg.GuardConfig(
        console=False,
        policy={"skip_on": []},
        recovery={"enabled": False},
        diagnosis={"lint": False},
        precursors={"every": every, **({"preempt": preempt} if preempt else {})},
    )
    losses: list[float] = []
    events: list[dict[str, Any]] = []
    samples: list[list[Any]] = []  # [step, precursors] of each sampled step
    started = time.perf_counter()
    with tg.Guard(model, opt, sched, config=config) as guard:
        for batch in corpus.batches(BATCH, SEQ, steps, seed=100 + seed):
            logits = model(batch.x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.y.reshape(-1))
            loss.backward()
            decision = guard.step(loss)
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            if "precursors" in decision.metrics:
                samples.append([decision.step, decision.metrics["precursors"]])
            for e in decision.events:
                metrics = {k: v for k, v in e.metrics.items() if isinstance(v, (int, float, str))}
                events.append({"step": e.step, "kind": e.kind, "metrics": metrics})
    seconds = time.perf_counter() - started
    return {"losses": losses, "events": events, "samples": samples, "seconds": seconds}


def spike_step(losses: list[float]) -> int | None:
    """The first step where the loss's EMA is `SPIKE_RISE` over its lowest so far (or the loss
    is not finite); None for a run that never climbs back."""
    ema, lowest = math.nan, math.inf
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            return i
        ema = x if math.isnan(ema) else (1 - SPIKE_EMA) * ema + SPIKE_EMA * x
        if i > 50 and ema > (1 + SPIKE_RISE) * lowest:
            return i
        lowest = min(lowest, ema)
    return None


def final_loss(losses: list[float]) -> float:
    tail = losses[-50:]
    return sum(tail) / len(tail) if all(math.isfinite(x) for x in tail) else math.inf


def warnings(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in run["events"] if e["kind"] == "precursor"]


def reached_critical(run: dict[str, Any], warning: dict[str, Any]) -> bool:
    """Whether the warned layer's signal went on to its critical level in the run's samples."""
    m = warning["metrics"]
    falling = m["signal"] in ("attn_entropy", "adam_eps_ratio")
    for _, sample in run["samples"]:
        value = sample.get(m["signal"], {}).get(m["layer"])
        if value is None:
            continue
        size = abs(value) if m["signal"] == "log_z" else value
        if (size <= m["critical"]) if falling else (size >= m["critical"]):
            return True
    return False


def lead(run: dict[str, Any]) -> int | None:
    """Steps from the first precursor warning to the loss spike (negative: after it); None for
    a run without a spike or without a warning."""
    spike = spike_step(run["losses"])
    w = warnings(run)
    return None if spike is None or not w else spike - int(w[0]["step"])


def first_of(run: dict[str, Any], kinds: tuple[str, ...]) -> int | None:
    steps = [e["step"] for e in run["events"] if e["kind"] in kinds]
    return min(steps) if steps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument(
        "--warmup", type=float, default=WARMUP_SHARE, help="share of the steps warming up"
    )
    parser.add_argument(
        "--every", type=int, default=EVERY, help="steps between the probe's sampled steps"
    )
    parser.add_argument("--cache", type=Path, default=Path("benchmarks/.early_warning.json"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # attention collapsed to one token leaves denormals
    cache: dict[str, Any] = json.loads(args.cache.read_text()) if args.cache.exists() else {}

    def run(arm: str, lr: float, seed: int) -> dict[str, Any]:
        key = f"{arm}|{lr:.6g}|{seed}|{args.steps}"
        if args.warmup != WARMUP_SHARE:
            key += f"|warmup {args.warmup:g}"
        if args.every != EVERY:
            key += f"|every {args.every}"
        if key not in cache:
            result = train(lr, seed, args.steps, VARIANTS.get(arm), args.warmup, args.every)
            cache[key] = result
            args.cache.write_text(json.dumps(cache))
            print(f"{key}: {result['seconds']:.0f}s", file=sys.stderr, flush=True)
        out: dict[str, Any] = cache[key]
        return out

    seeds = TUNE_SEEDS + REPORT_SEEDS
    base = {(lr, s): run("base", lr, s) for s in seeds for lr in LRS}
    warned = [k for k, r in base.items() if warnings(r)]
    diverging = {k for k, r in base.items() if spike_step(r["losses"]) is not None}
    best = {
        s: min(
            final_loss(r["losses"])
            for (lr, seed), r in base.items()
            if seed == s and (lr, s) not in diverging
        )
        for s in seeds
    }

    def saved(arm: str, seeds_: tuple[int, ...]) -> tuple[int, int, list[str], float]:
        rows, n, total, ends = [], 0, 0, []
        for lr, s in sorted(k for k in diverging if k[1] in seeds_):
            total += 1
            r = run(arm, lr, s) if (lr, s) in warned else base[(lr, s)]
            end = final_loss(r["losses"])
            ends.append(end)
            ok = spike_step(r["losses"]) is None and end <= (1 + SAVED_WITHIN) * best[s]
            n += ok
            acts = [e for e in r["events"] if e["kind"] == "preemption"]
            rows.append(
                f"| {lr:.3g} | {s} | {final_loss(base[(lr, s)]['losses']):.3f} | "
                f"{end:.3f} | {best[s]:.3f} | {len(acts)} | {'yes' if ok else 'no'} |"
            )
        return n, total, rows, statistics.mean(ends) if ends else math.inf

    tuned = {arm: saved(arm, TUNE_SEEDS) for arm in VARIANTS}
    # the most diverging runs saved; on a tie, the lowest mean final loss of those runs
    chosen = max(VARIANTS, key=lambda a: (tuned[a][0], -tuned[a][3]))
    reported = saved(chosen, REPORT_SEEDS)
    false_warned = sorted(k for k in warned if k not in diverging and k[1] in REPORT_SEEDS)
    on_stable = {k: run(chosen, *k) for k in false_warned}
    body = report(base, diverging, best, tuned, chosen, reported, on_stable, args)
    print(body)
    if not args.no_write:
        write_section(
            "early-warning",
            "Early warning: precursors before the loss spike (issue 21)",
            body,
            f"nice python benchmarks/early_warning.py --steps {args.steps} "
            f"--warmup {args.warmup:g} --every {args.every}",
        )


def report(
    base: dict[tuple[float, int], dict[str, Any]],
    diverging: set[tuple[float, int]],
    best: dict[int, float],
    tuned: dict[str, tuple[int, int, list[str], float]],
    chosen: str,
    reported: tuple[int, int, list[str], float],
    on_stable: dict[tuple[float, int], dict[str, Any]],
    args: argparse.Namespace,
) -> str:
    """The figures as markdown."""
    lines: list[str] = [
        f"The setup: a {LAYERS}-layer, {HEADS}-head transformer (d={D_MODEL}, separate q/k/v/o "
        f"projections, no QK-norm) on the demo's character corpus, batch {BATCH} x {SEQ} "
        "tokens, AdamW (betas 0.9/0.95, no weight decay), the guard's clipping at 1.0, "
        f"{args.steps} steps: a linear warmup over the first {int(args.warmup * args.steps)}, "
        f"then a cosine to a tenth; {len(LRS)} LRs from {LRS[0]:.3g} to {LRS[-1]:.3g} "
        "(log-spaced). The Guard only watches (`policy.skip_on: []`, `recovery.enabled: "
        f"false`) with the probe every {args.every} steps and the warning's defaults. Seed(s) "
        f"{', '.join(map(str, TUNE_SEEDS))} tune (they choose the preemptive setting); seeds "
        f"{', '.join(map(str, REPORT_SEEDS))} are reported. A loss spike: the loss's EMA "
        f"({SPIKE_EMA}) {SPIKE_RISE:.0%} over its lowest so far; a run is saved when it has "
        f"none and ends (mean of the last 50 losses) within {SAVED_WITHIN:.0%} of its seed's "
        "best stable run. Only warned runs are rerun with the actions on (a run with no "
        "warning takes no action: the same run).",
        "",
    ]
    rdiv = sorted(k for k in diverging if k[1] in REPORT_SEEDS)
    rstable = sorted(k for k in base if k[1] in REPORT_SEEDS and k not in diverging)
    rleads = [lead(base[k]) for k in rdiv]
    rgot = [x for x in rleads if x is not None]
    rahead = sum(x >= LEAD_AHEAD for x in rgot)
    rfalse = sum(bool(warnings(base[k])) for k in rstable)
    n_saved, n_div = reported[0], reported[1]

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    median = statistics.median(rgot) if rgot else math.nan
    lines += [
        f"| report seeds {', '.join(map(str, REPORT_SEEDS))} | measured | target | |",
        "| --- | --- | --- | --- |",
        f"| median lead of the warning before the loss spike | {median:g} steps (worst "
        f"{min(rgot) if rgot else 'n/a'}; {len(rgot)} of {len(rdiv)} warned at all) "
        f"| >= 100 | {verdict(median >= 100)} |",
        f"| diverging runs warned >= {LEAD_AHEAD} steps ahead | {rahead} of {len(rdiv)} "
        f"| >= 80% | {verdict(bool(rdiv) and rahead >= 0.8 * len(rdiv))} |",
        f"| false warnings on stable runs | {rfalse} of {len(rstable)} runs | <= 1 "
        f"| {verdict(rfalse <= 1)} |",
        f"| diverging runs saved by `{chosen}` | {n_saved} of {n_div} | >= 70% "
        f"| {verdict(bool(n_div) and n_saved >= 0.7 * n_div)} |",
        "",
    ]
    for split, seeds in (("tuning", TUNE_SEEDS), ("report", REPORT_SEEDS)):
        div = sorted(k for k in diverging if k[1] in seeds)
        stable = sorted(k for k in base if k[1] in seeds and k not in diverging)
        leads = []
        loss_leads = []
        for k in div:
            spike = spike_step(base[k]["losses"])
            assert spike is not None
            leads.append(lead(base[k]))
            first = first_of(base[k], LOSS_KINDS)
            loss_leads.append(None if first is None else spike - first)
        got = [x for x in leads if x is not None]
        false = [k for k in stable if warnings(base[k])]
        never_reached = sum(not reached_critical(base[k], warnings(base[k])[0]) for k in false)
        lines.append(
            f"**{split} seeds {', '.join(map(str, seeds))}**: {len(div)} diverging runs of "
            f"{len(div) + len(stable)}; precursor lead before the loss spike: median "
            f"{statistics.median(got) if got else 'n/a'} steps, worst "
            f"{min(got) if got else 'n/a'} ({len(got)} of {len(div)} warned at all); warned "
            f">= {LEAD_AHEAD} steps ahead: {sum(x >= LEAD_AHEAD for x in got)} of {len(div)}; "
            f"stable runs warned (false warnings): {len(false)} of {len(stable)}"
            + (f" (LR {', '.join(f'{lr:.3g}' for lr, _ in false)})" if false else "")
            + f", of which {never_reached}"
            " where the warned signal never reached its critical level"
            + "; the loss-only detectors' first event: "
            + ", ".join("none" if x is None else f"{x:+d}" for x in loss_leads)
            + " steps before the spike."
        )
        lines.append("")
    lines.append(
        "Per run (watched only): final loss (mean of the last 50 steps), the loss spike's step, "
        "the first precursor warning (step: signal, layer, value, steps left it estimated), the "
        "loss-only detectors' first event."
    )
    lines.append("")
    lines.append("| LR | seed | final loss | spike | precursor warning | loss-only detectors |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for (lr, s), r in sorted(base.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        w = warnings(r)
        wtxt = (
            f"{w[0]['step']}: {w[0]['metrics']['signal']} {w[0]['metrics']['layer']} "
            f"{w[0]['metrics']['value']:.3g}, ~{w[0]['metrics']['steps_left']} left"
            if w
            else "-"
        )
        loss_evs = [e for e in r["events"] if e["kind"] in LOSS_KINDS]
        ltxt = f"{loss_evs[0]['step']}: {loss_evs[0]['kind']}" if loss_evs else "-"
        spike = spike_step(r["losses"])
        lines.append(
            f"| {lr:.3g} | {s} | {final_loss(r['losses']):.3f} | {spike or '-'} | {wtxt} | {ltxt} |"
        )
    lines.append("")
    lines.append(
        "Preemptive settings on the tuning seed (diverging runs saved: no spike and the final "
        "loss within 2% of the seed's best stable run): "
        + ", ".join(
            f"`{a}` {tuned[a][0]} of {tuned[a][1]} (their mean final loss {tuned[a][3]:.3f})"
            for a in VARIANTS
        )
        + f"; chosen: `{chosen}` ({VARIANTS[chosen]})."
    )
    lines.append("")
    n, total, rows, _ = reported
    lines.append(f"**Report seeds, `{chosen}`: {n} of {total} diverging runs saved.**")
    lines.append("")
    lines.append(
        "| LR | seed | final loss, watched | final loss, preempted | best stable | preemptions "
        "| saved |"
    )
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    lines.extend(rows)
    lines.append("")
    lines.append(
        f"The stable runs of the report seeds that were warned, again with `{chosen}` (what a "
        "false warning's action costs): "
        + (
            ", ".join(
                f"LR {lr:.3g} seed {s}: {final_loss(base[(lr, s)]['losses']):.3f} -> "
                f"{final_loss(r['losses']):.3f}"
                for (lr, s), r in sorted(on_stable.items())
            )
            or "none"
        )
        + "."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
