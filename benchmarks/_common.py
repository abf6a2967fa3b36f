"""What the benchmarks share: the GPT they time, and writing figures into RESULTS.md."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainguard.demo import TinyGPT, TinyGPTConfig

RESULTS = Path(__file__).with_name("RESULTS.md")


def gpt(device: torch.device | str = "cpu") -> tuple[TinyGPT, torch.optim.Optimizer]:
    """The benchmark model: GPT with 4 layers, d=256, sequence 128, vocabulary 256; AdamW."""
    torch.manual_seed(0)
    cfg = TinyGPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256)
    model = TinyGPT(cfg).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4)


def record_step(
    decision: Any,
    loss: torch.Tensor,
    losses: list[float],
    grads: list[float | None],
    samples: list[Any],
    events: list[dict[str, Any]],
) -> None:
    """One guarded step's loss, grad norm, sampled precursors and events, appended to the
    early-warning benchmarks' records."""
    losses.append(float(loss.detach()))
    grads.append(decision.metrics.get("grad_norm"))
    if "precursors" in decision.metrics:
        samples.append([decision.step, decision.metrics["precursors"]])
    for e in decision.events:
        metrics = {k: v for k, v in e.metrics.items() if isinstance(v, (int, float, str))}
        events.append({"step": e.step, "kind": e.kind, "severity": e.severity, "metrics": metrics})


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
    """A pre-LN transformer block: `Attention`, then a GELU MLP of 4x the width."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out
