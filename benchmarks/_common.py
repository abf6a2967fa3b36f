"""What the benchmarks share: the GPT they time, and writing figures into RESULTS.md."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from trainguard.demo import TinyGPT, TinyGPTConfig

RESULTS = Path(__file__).with_name("RESULTS.md")


def gpt(device: torch.device | str = "cpu") -> tuple[TinyGPT, torch.optim.Optimizer]:
    """The benchmark model: GPT with 4 layers, d=256, sequence 128, vocabulary 256; AdamW."""
    torch.manual_seed(0)
    cfg = TinyGPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256)
    model = TinyGPT(cfg).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def write_section(name: str, title: str, body: str, command: str) -> None:
    """Replace the section between `<!-- name:start -->` and `<!-- name:end -->`, or append it."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\nCommand: `{command}`\n\n{body}\n{end}"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + f"\n\n## {title}\n\n" + block + "\n"
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}", file=sys.stderr)
