"""The early-warning benchmark's second model family (issue 37): a Llama decoder (RoPE, RMSNorm,
SwiGLU) on byte-level text at two vocabulary sizes, a warmup-stable-decay schedule, an LR sweep
at two seeds; run by `early_warning.py --family llama`.

Each run's figures (loss and grad norm a step, the probe's samples, the live events) are cached;
the precursor warnings are judged again from them (`replay`) with the detector as it stands, so
a change to the detector is re-scored without training (a watching Guard does not change the
run it watches). False warnings are counted on every run whose loss never spikes.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import trainguard as tg
from _common import record_step
from trainguard.config import PreemptConfig
from trainguard.demo.data import DEMO_TEXT
from trainguard.detectors.base import MetricPoint
from trainguard.detectors.precursors import PrecursorWarningDetector
from trainguard.policy import StepPolicy

LRS = [float(x) for x in np.geomspace(2e-3, 0.2, 6)]
VOCABS = (256, 1024)
TUNE_SEEDS = (0,)
REPORT_SEEDS = (1,)
STEPS = 800  # the sweep: 1000 steps
WARMUP_SHARE, DECAY_SHARE, FINAL_LR_SHARE = 0.1, 0.2, 0.1
BATCH, SEQ, D_MODEL, LAYERS, HEADS, FFN = 16, 32, 64, 2, 2, 176
EVERY = 5
LEAD_TARGET = 100 * STEPS // 1000  # the 100 steps of a 1000-step run, scaled
LEAD_AHEAD = 20
CACHE_VERSION = 1
LOSS_KINDS = ("loss_spike", "divergence", "grad_explosion", "grad_spike", "oscillation", "stall")
ALL_ACTIONS = PreemptConfig(actions=["lr_cut", "qk_rescale", "z_loss"])


def byte_tokens(vocab: int) -> torch.Tensor:
    """The demo text as UTF-8 bytes; over 256, the `vocab - 256` most frequent adjacent byte
    pairs merged into one token each, greedily from the left."""
    text = resources.files("trainguard.demo").joinpath("corpus", DEMO_TEXT).read_bytes()
    data = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    if vocab == 256:
        return torch.from_numpy(data.copy())
    pairs = data[:-1] * 256 + data[1:]
    top = np.argsort(-np.bincount(pairs, minlength=65536), kind="stable")[: vocab - 256]
    pair_id = np.full(65536, -1, dtype=np.int64)
    pair_id[top] = 256 + np.arange(len(top))
    merged = pair_id[pairs].tolist()
    raw = data.tolist()
    out: list[int] = []
    i, n = 0, len(raw)
    while i < n:
        if i < n - 1 and merged[i] >= 0:
            out.append(merged[i])
            i += 2
        else:
            out.append(raw[i])
            i += 1
    return torch.tensor(out, dtype=torch.long)


def batches(tokens: torch.Tensor, steps: int, seed: int) -> Any:
    """`steps` batches of random windows (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(SEQ + 1)
    for _ in range(steps):
        starts = torch.randint(len(tokens) - SEQ - 1, (BATCH,), generator=g)
        windows = tokens[starts[:, None] + offsets[None, :]]
        yield windows[:, :-1], windows[:, 1:]


def llama(vocab: int) -> LlamaForCausalLM:
    """A small Llama: RoPE, RMSNorm, SwiGLU, untied head, eager attention (its weights read)."""
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=D_MODEL,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


def wsd(steps: int) -> Any:
    """Warmup-stable-decay: linear warmup, the peak held, a linear decay to a tenth at the end."""
    warmup = max(1, int(WARMUP_SHARE * steps))
    decay_from = int((1 - DECAY_SHARE) * steps)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if s < decay_from:
            return 1.0
        return 1.0 - (1.0 - FINAL_LR_SHARE) * (s - decay_from) / max(1, steps - decay_from)

    return factor


def train(lr: float, seed: int, vocab: int, steps: int, every: int) -> dict[str, Any]:
    """One run under a Guard that only watches: loss and grad norm a step, the sampled
    precursors, the live events, the attention entropy at the end."""
    torch.manual_seed(seed)
    tokens = byte_tokens(vocab)
    model = llama(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, wsd(steps))
    config = tg.GuardConfig(
        console=False,
        policy={"skip_on": []},
        recovery={"enabled": False},
        diagnosis={"lint": False},
        precursors={"every": every},
    )
    losses: list[float] = []
    grads: list[float | None] = []
    events: list[dict[str, Any]] = []
    samples: list[list[Any]] = []
    started = time.perf_counter()
    with tg.Guard(model, opt, sched, config=config) as guard:
        for x, y in batches(tokens, steps, 100 + seed):
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            decision = guard.step(loss)
            opt.zero_grad(set_to_none=True)
            record_step(decision, loss, losses, grads, samples, events)
    return {
        "losses": losses,
        "grad_norms": grads,
        "events": events,
        "samples": samples,
        "seconds": time.perf_counter() - started,
        "final_entropy": attention_entropy(model, tokens),
    }


@torch.no_grad()
def attention_entropy(model: LlamaForCausalLM, tokens: torch.Tensor) -> dict[str, float]:
    """Each layer's mean causal attention entropy (nats) on a fixed batch, from the model's own
    attention weights (not the probe's): whether a run's attention ended collapsed."""
    model.eval()
    x, _ = next(iter(batches(tokens, 1, 999)))
    attentions = model(input_ids=x, output_attentions=True).attentions
    model.train()
    return {
        str(i): float(-(a * torch.log(a.clamp_min(1e-30))).sum(-1).mean())
        for i, a in enumerate(attentions)
    }


def replay(run: dict[str, Any], vocab: int) -> list[dict[str, Any]]:
    """The precursor events the detector as it stands gives on the run's cached figures, and the
    preemptive actions a policy with every action on would take on them (the first warning's,
    exact; later ones in a run that acted would differ). Samples of an older probe without the
    vocabulary get the run's own."""
    detector = PrecursorWarningDetector()
    policy = StepPolicy(preempt=ALL_ACTIONS)
    sampled = {int(step): p for step, p in run["samples"]}
    out: list[dict[str, Any]] = []
    for step, (loss, grad) in enumerate(zip(run["losses"], run["grad_norms"], strict=True)):
        precursors = sampled.get(step)
        if precursors is not None and "vocab_size" not in precursors:
            precursors = {**precursors, "vocab_size": {"output": float(vocab)}}
        point = MetricPoint(step=step, loss=loss, grad_norm=grad, precursors=precursors)
        events = detector.update(point)
        decision = policy.decide(point, events)
        for e in events:
            out.append({"step": step, "kind": e.kind, "severity": e.severity, "metrics": e.metrics})
        for call in decision.preempt:
            out.append(
                {
                    "step": step,
                    "kind": "would_preempt",
                    "severity": "warning",
                    "metrics": {"action": call.action, "signal": call.signal},
                }
            )
    return out


def spike_step(losses: list[float]) -> int | None:
    from early_warning import spike_step as rule

    return rule(losses)


def final_loss(losses: list[float]) -> float:
    tail = losses[-50:]
    return sum(tail) / len(tail) if all(math.isfinite(x) for x in tail) else math.inf


def _one_thread() -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)


def job(lr: float, seed: int, vocab: int, steps: int, every: int) -> dict[str, Any]:
    return train(lr, seed, vocab, steps, every)


def ensure(
    cache: dict[str, Any], path: Path, steps: int, every: int, jobs: int
) -> dict[tuple[int, float, int], dict[str, Any]]:
    """Every run of the sweep, trained where the cache lacks it (`jobs` at a time)."""
    import json

    def key(vocab: int, lr: float, seed: int) -> str:
        return f"llama-v{CACHE_VERSION}|{vocab}|{lr:.6g}|{seed}|{steps}|every {every}"

    wanted = [(v, lr, s) for v in VOCABS for s in TUNE_SEEDS + REPORT_SEEDS for lr in LRS]
    missing = [w for w in wanted if key(*w) not in cache]
    if missing:
        with ProcessPoolExecutor(jobs, initializer=_one_thread) as pool:
            futures = {pool.submit(job, lr, s, v, steps, every): (v, lr, s) for v, lr, s in missing}
            for future in as_completed(futures):
                k = key(*futures[future])
                cache[k] = future.result()
                path.write_text(json.dumps(cache))
                print(f"{k}: {cache[k]['seconds']:.0f}s", file=sys.stderr, flush=True)
    return {w: cache[key(*w)] for w in wanted}


def _warnings(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "precursor" and e.get("severity") == "warning"]


def _infos(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "precursor" and e.get("severity") == "info"]


WORSE_END = 0.1  # a run with no spike ending this share over its seed's best: a worse end


def classify(
    runs: dict[tuple[int, float, int], dict[str, Any]],
) -> dict[tuple[int, float, int], str]:
    """Each run's outcome: 'diverging' (its loss spikes), 'worse end' (no spike, but it ends
    over `WORSE_END` above the best run of its vocabulary and seed) or 'stable'."""
    ends = {k: final_loss(r["losses"]) for k, r in runs.items()}
    spiking = {k for k, r in runs.items() if spike_step(r["losses"]) is not None}
    best = {
        (v, s): min(e for k, e in ends.items() if (k[0], k[2]) == (v, s) and k not in spiking)
        for v, _, s in runs
    }
    return {
        k: "diverging"
        if k in spiking
        else ("worse end" if ends[k] > (1 + WORSE_END) * best[(k[0], k[2])] else "stable")
        for k in runs
    }


def report(
    runs: dict[tuple[int, float, int], dict[str, Any]],
    steps: int,
    every: int,
    splits: tuple[tuple[str, tuple[int, ...]], ...] = (
        ("tune", TUNE_SEEDS),
        ("report", REPORT_SEEDS),
    ),
    lead_target: int = LEAD_TARGET,
) -> tuple[str, dict[str, dict[str, Any]]]:
    """The figures as markdown: per split and vocabulary, the lead on diverging runs and the
    warnings on runs that never spike (stable, or ending worse); before (the live events of
    the code that trained the cache) and now (replayed); and the per-split figures."""
    judged = {k: replay(r, k[0]) for k, r in runs.items()}
    outcome = classify(runs)
    lines = [
        "| split | vocab | runs: diverging / worse end / stable | lead median (worst), now | "
        "warned >= 20 ahead, now | warnings on stable runs, before -> now (runs) | warnings on "
        "worse-end runs, before -> now | info events on runs with no spike, now | stable runs "
        "acted on, now |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary: dict[str, dict[str, Any]] = {}
    vocabs = sorted({k[0] for k in runs})
    for split, seeds in splits:
        for vocab in (*vocabs, None) if len(vocabs) > 1 else (vocabs[0],):
            keys = [k for k in runs if k[2] in seeds and (vocab is None or k[0] == vocab)]
            div = [k for k in keys if outcome[k] == "diverging"]
            worse = [k for k in keys if outcome[k] == "worse end"]
            stable = [k for k in keys if outcome[k] == "stable"]
            leads = []
            for k in div:
                w = _warnings(judged[k])
                spike = spike_step(runs[k]["losses"])
                if w and spike is not None:
                    leads.append(spike - int(w[0]["step"]))
            ahead = sum(x >= LEAD_AHEAD for x in leads)

            def count(ks: list[tuple[int, float, int]], source: str) -> int:
                return sum(
                    len(_warnings(runs[k]["events"] if source == "before" else judged[k]))
                    for k in ks
                )

            now_runs = sum(bool(_warnings(judged[k])) for k in stable)
            infos = sum(len(_infos(judged[k])) for k in stable + worse)
            acted = sum(any(e["kind"] == "would_preempt" for e in judged[k]) for k in stable)
            median = statistics.median(leads) if leads else math.nan
            summary[f"{split}/{vocab or 'all'}"] = {
                "median": median,
                "ahead": ahead,
                "div": len(div),
                "false": count(stable, "now"),
                "stable": len(stable),
            }
            lines.append(
                f"| {split} | {vocab or 'both'} | {len(div)} / {len(worse)} / {len(stable)} | "
                f"{median:g} ({min(leads) if leads else 'n/a'}) | {ahead} of {len(div)} | "
                f"{count(stable, 'before')} -> {count(stable, 'now')} ({now_runs} of "
                f"{len(stable)}) | {count(worse, 'before')} -> {count(worse, 'now')} | {infos} "
                f"| {acted} |"
            )
    rep = summary[f"{splits[-1][0]}/{'all' if len(vocabs) > 1 else vocabs[0]}"]
    lines += [
        "",
        f"Targets on the {splits[-1][0]} half: at most 1 precursor warning over all stable runs: "
        f"{rep['false']} ({'met' if rep['false'] <= 1 else '**missed**'}); lead median >= "
        f"{lead_target} steps: {rep['median']:g} "
        f"({'met' if rep['median'] >= lead_target else '**missed**'}); >= 80% of diverging runs "
        f"warned >= {LEAD_AHEAD} steps ahead: {rep['ahead']} of {rep['div']} "
        f"({'met' if rep['div'] and rep['ahead'] >= 0.8 * rep['div'] else '**missed**'}).",
        "",
        "Per run: its outcome, final loss (mean of the last 50), the loss spike's step, the least "
        "attention entropy at the end (nats), the first precursor warning before and now (step: "
        "signal layer value), warnings / infos now, the loss-only detectors' first live event.",
        "",
        "| vocab | LR | seed | outcome | final loss | spike | end entropy | first warning, "
        "before | first warning, now | warnings / infos now | loss-only detectors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def first(ws: list[dict[str, Any]]) -> str:
        if not ws:
            return "-"
        m = ws[0]["metrics"]
        return f"{ws[0]['step']}: {m['signal']} {m['layer']} {float(m['value']):.3g}"

    for k in sorted(runs, key=lambda k: (k[2], k[0], k[1])):
        vocab, lr, seed = k
        r = runs[k]
        loss_evs = [e for e in r["events"] if e["kind"] in LOSS_KINDS]
        ltxt = f"{loss_evs[0]['step']}: {loss_evs[0]['kind']}" if loss_evs else "-"
        spike = spike_step(r["losses"])
        lines.append(
            f"| {vocab} | {lr:.3g} | {seed} | {outcome[k]} | {final_loss(r['losses']):.3f} | "
            f"{spike or '-'} | {min(r['final_entropy'].values()):.2f} | "
            f"{first(_warnings(r['events']))} | {first(_warnings(judged[k]))} | "
            f"{len(_warnings(judged[k]))} / {len(_infos(judged[k]))} | {ltxt} |"
        )
    return "\n".join(lines), summary


def setup(steps: int, every: int) -> str:
    """The second family's setup, as the report states it."""
    return (
        f"The setup: Hugging Face's LlamaForCausalLM ({LAYERS} layers, {HEADS} heads, "
        f"d={D_MODEL}, SwiGLU width {FFN}, RoPE, RMSNorm, untied head, no QK-norm) on the demo "
        "text as UTF-8 bytes (vocabulary 256) and as bytes plus the 768 most frequent byte pairs "
        f"(vocabulary 1024); batch {BATCH} x {SEQ}, AdamW (betas 0.9/0.95, no weight decay), the "
        f"guard's clipping at 1.0, {steps} steps of warmup-stable-decay (linear warmup over "
        f"{WARMUP_SHARE:.0%}, the peak held, a linear decay to a tenth over the last "
        f"{DECAY_SHARE:.0%}); {len(LRS)} LRs from {LRS[0]:.3g} to {LRS[-1]:.3g} (log-spaced), "
        f"seed(s) {', '.join(map(str, TUNE_SEEDS))} tune and "
        f"{', '.join(map(str, REPORT_SEEDS))} report. The issue's sweep was 8 LRs x 2 seeds x "
        f"1000 steps; shortened to {steps} steps and 6 LRs to run on 2 shared CPU cores (about "
        f"40 minutes with 2 jobs), so the lead target scales to {LEAD_TARGET} steps "
        f"({steps / 1000:g} x 100). The Guard only watches, the probe every {every} steps, the "
        "warning's defaults. A loss spike as in the first family (the loss's 20-step EMA 5% over "
        "its lowest); a run with none is 'worse end' where it ends over "
        f"{WORSE_END:.0%} above the best run of its vocabulary and seed, else 'stable'; "
        "warnings are counted on both. 'Before': the live events of the code that trained the "
        "cache (the detector before issue 37); 'now': the same runs' figures judged again by "
        "the detector as it stands (`replay`; a watching guard does not change its run). 'Acted "
        "on': the preemptive actions a policy with `lr_cut`, `qk_rescale` and `z_loss` all on "
        "would take on the first warnings (exact for the first; a watched run takes none)."
    )
