"""A fine-tuning run for the checkpoint-by-change tests and benchmarks/checkpoint_dedup.py: a
small transformer whose base (embedding and encoder) is frozen and whose head trains with AdamW;
dropout and a shuffled loader, so that random state and data position matter on resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

VOCAB = 64


class Finetuned(nn.Module):
    """Embedding and encoder layers (the frozen base), and a trainable head of `head` units."""

    def __init__(self, width: int, layers: int, head: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.encoder = nn.Sequential(  # each layer initialised on its own, unlike a deep copy
            *[
                nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.1, batch_first=True)
                for _ in range(layers)
            ]
        )
        self.head = nn.Sequential(nn.Linear(width, head), nn.Tanh(), nn.Linear(head, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(self.embed(tokens)))
        return out


def build(
    width: int = 32, layers: int = 2, head: int = 21
) -> tuple[Finetuned, torch.optim.Optimizer]:
    """The model with its base frozen (`requires_grad=False`, not in the optimizer), and AdamW
    over the head."""
    torch.manual_seed(0)
    model = Finetuned(width, layers, head)
    for p in [*model.embed.parameters(), *model.encoder.parameters()]:
        p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=3e-3)


def frozen_share(model: nn.Module) -> float:
    """The share of the model's parameters that are frozen."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if not p.requires_grad) / total


def loader(seq: int = 16, batch: int = 8) -> DataLoader[Any]:
    """Token windows (a fixed random sequence), shuffled: 4 batches an epoch."""
    tokens = torch.randint(0, VOCAB, (32, seq + 1), generator=torch.Generator().manual_seed(5))
    return DataLoader(TensorDataset(tokens), batch_size=batch, shuffle=True)


def config(every: int, keep: int = 3, dedup: bool = True, asynchronous: bool = True) -> Any:
    return tg.GuardConfig(
        console=False,
        diagnosis={"lint": False},
        recovery={
            "checkpoint_every": every,
            "keep_checkpoints": keep,
            "async_checkpoints": asynchronous,
            "dedup_checkpoints": dedup,
        },
    )


def train(guard: tg.Guard, model: nn.Module, data: DataLoader[Any], until: int) -> list[str]:
    """Train to step `until`; each step's loss, exact (as hex)."""
    losses: list[str] = []
    while guard.global_step < until:
        for (tokens,) in guard.batches(data):
            if guard.global_step >= until:
                break
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
            guard.step(loss)
            assert guard.optimizer is not None
            guard.optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()).hex())
    return losses


def stored_bytes(run_dir: Path) -> dict[str, int]:
    """Every file under the run's checkpoints, by path, with its size."""
    root = run_dir / "checkpoints"
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}
