"""The precursor probe's cost: a guarded training step without the probe, with it sampling every
step, and with it sampling every 50 steps (the default), timed side by side in one run.

Two Hugging Face models on the CPU (GPT-2 and Llama configurations, 4 layers, d=256, sequence
128, batch 8, vocabulary 2048, AdamW, labels passed so token accuracy is measured). The three
guards take turns step by step, each on its own copy of the model, so a slow moment of the
machine falls on all three alike; per-step medians. The amortised cost at `every` steps is
(sampled step - plain step) / every / plain step; the measured every-50 figure beside it is the
mean step time over the plain one's.
Target: at most 1% at every=50.
Run: `PYTHONPATH=src python benchmarks/precursor_cost.py` (`--steps`, `--every`, `--no-write`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import trainguard as tg
from _common import write_section

VOCAB, SEQ, BATCH = 2048, 128, 8


def _models() -> dict[str, Any]:
    import transformers

    gpt2 = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    llama = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return {
        "GPT-2": lambda: transformers.GPT2LMHeadModel(gpt2),
        "Llama": lambda: transformers.LlamaForCausalLM(llama),
    }


def _guard(model: torch.nn.Module, opt: torch.optim.Optimizer, every: int | None) -> tg.Guard:
    cfg = tg.GuardConfig(console=False)
    cfg.diagnosis.lint = False
    if every is None:
        cfg.precursors.enabled = False
    else:
        cfg.precursors.every = every
    return tg.Guard(model, opt, config=cfg)


def measure(build: Any, steps: int, every: int) -> dict[str, float]:
    """Per-step seconds of the three guards, each on its own copy of the model, taking turns."""
    runs = {}
    for key, sample_every in (("plain", None), ("every step", 1), ("every n", every)):
        torch.manual_seed(0)
        model = build()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[key] = (model, opt, _guard(model, opt, sample_every))
    times: dict[str, list[float]] = {k: [] for k in runs}
    gen = torch.Generator().manual_seed(1)
    for i in range(steps + 2):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        for key, (model, opt, guard) in runs.items():
            start = time.perf_counter()
            out = model(input_ids=x, labels=x)
            out.loss.backward()
            guard.step(out.loss)
            opt.zero_grad(set_to_none=True)
            if i >= 2:  # the first steps warm the allocator up
                times[key].append(time.perf_counter() - start)
    for _, _, guard in runs.values():
        guard.close()
    plain = statistics.median(times["plain"])
    every_step = statistics.median(times["every step"])
    extra = every_step - plain
    return {
        "plain_ms": 1e3 * plain,
        "sampled_ms": 1e3 * every_step,
        "extra_ms": 1e3 * extra,
        "amortised_pct": 100 * extra / every / plain,
        "measured_pct": 100
        * (statistics.mean(times["every n"]) / statistics.mean(times["plain"]) - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100, help="steps timed per guard and model")
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, build in _models().items():
        r = measure(build, args.steps, args.every)
        print(name, {k: round(v, 3) for k, v in r.items()})
        rows.append(
            f"| {name} | {r['plain_ms']:.1f} | {r['sampled_ms']:.1f} | {r['extra_ms']:.1f} "
            f"| {r['amortised_pct']:.2f}% | {r['measured_pct']:+.1f}% |"
        )
    body = (
        f"Guarded training steps on the CPU (one thread), 4 layers, d=256, sequence {SEQ}, batch "
        f"{BATCH}, vocabulary {VOCAB}, AdamW, labels passed; the probe's defaults "
        "(max_sequences 4, max_queries 128). Three guards take turns, each on its own copy of "
        "the model, "
        f"{args.steps} steps each; per-step medians.\n\n"
        f"| model | plain step, ms | sampled step, ms | probe, ms | amortised at "
        f"every={args.every} (target <= 1%) | measured at every={args.every}, mean |\n"
        "| --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n\n"
        "The amortised figure is the sampled step's extra time spread over "
        f"{args.every} steps; the measured one is the mean step time of the every-"
        f"{args.every} guard over the plain one's, within this machine's step-to-step noise "
        "(2 cores shared with other jobs). Steps that are not sampled carry no hook.\n"
    )
    if not args.no_write:
        write_section(
            "precursor-cost",
            "Precursor probe cost",
            body,
            "PYTHONPATH=src python benchmarks/precursor_cost.py",
        )
    else:
        print(body)


if __name__ == "__main__":
    main()
