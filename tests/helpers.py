"""Shared helpers: a tiny LM trained on the CPU with planted faults, and synthetic loss curves."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import trainguard as tg
from trainguard.demo import Batch, MarkovCorpus, TinyGPT

_CORPUS: MarkovCorpus | None = None
LR = 3e-3


def corpus() -> MarkovCorpus:
    global _CORPUS
    if _CORPUS is None:
        _CORPUS = MarkovCorpus(length=100_000, seed=0)
    return _CORPUS


class PlantedLog(nn.Module):
    """Wraps a module; at the planted step it adds log(0) = -inf to the output."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        if self.armed:
            out = out + torch.log(torch.zeros_like(out[..., :1]))
        return out


@dataclass
class RunResult:
    losses: list[float]
    decisions: list[tg.Decision]
    eval_loss: float
    model: TinyGPT
    optimizer: torch.optim.Optimizer
    guard: tg.Guard | None
    halted: tg.TrainingHalted | None = None
    events: list[tg.Event] = field(default_factory=list)


def eval_loss(model: TinyGPT, batches: list[Batch]) -> float:
    with torch.no_grad():
        return float(np.mean([model.loss(model(b.x), b.y).item() for b in batches]))


def train_lm(
    steps: int = 300,
    *,
    guarded: bool = True,
    toxic_at: int | None = None,
    lr_blowup: tuple[int, int, float] | None = None,
    log0_at: int | None = None,
    config: tg.GuardConfig | None = None,
    run_dir: Path | None = None,
    seed: int = 0,
) -> RunResult:
    """Train TinyGPT on the Markov corpus with AdamW; plant the faults named by the arguments."""
    data = corpus()
    torch.manual_seed(seed)
    model = TinyGPT()
    planted: PlantedLog | None = None
    if log0_at is not None:
        planted = PlantedLog(model.blocks[0].mlp)
        model.blocks[0].mlp = planted  # type: ignore[assignment]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    cfg = config or tg.GuardConfig(console=False)
    guard = tg.Guard(model, opt, config=cfg, run_dir=run_dir) if guarded else None
    losses: list[float] = []
    decisions: list[tg.Decision] = []
    halted = None
    for i, batch in enumerate(data.batches(16, 32, steps, seed=seed + 1)):
        if i == toxic_at:
            batch = data.make_toxic(batch)
        if lr_blowup is not None:
            start, length, factor = lr_blowup
            lr = LR * factor if start <= i < start + length else LR
            for group in opt.param_groups:
                group["lr"] = lr
        if planted is not None:
            planted.armed = i == log0_at
        loss = model.loss(model(batch.x, batch.input_scale), batch.y)
        loss.backward()
        losses.append(loss.item())
        if guard is not None:
            try:
                decisions.append(guard.step(loss, batch_ids=batch.ids))
            except tg.TrainingHalted as exc:
                halted = exc
                break
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        opt.zero_grad(set_to_none=True)
    if guard is not None:
        guard.close()
    evals = list(data.batches(32, 32, 8, seed=999))
    events = [e for d in decisions for e in d.events]
    if halted is not None:
        events += halted.decision.events
    return RunResult(losses, decisions, eval_loss(model, evals), model, opt, guard, halted, events)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def lm_curve(
    steps: int,
    *,
    seed: int = 0,
    start: float = 10.0,
    floor: float = 2.0,
    noise: float = 0.02,
    dof: float = 4.0,
    restarts: tuple[int, ...] = (),
    restart_rise: float = 0.15,
    restart_len: int = 200,
) -> np.ndarray:
    """A realistic LM loss curve: power-law decay, multiplicative Student-t batch noise (heavy
    tails), and optional LR warm restarts that lift the loss smoothly before it falls again."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=np.float64)
    level = floor + (start - floor) * (1.0 + t / 50.0) ** -0.7
    for r in restarts:
        after = np.clip(t - r, 0.0, None)
        bump = (
            restart_rise * (1 - np.exp(-after / (restart_len / 4))) * np.exp(-after / restart_len)
        )
        level = level * (1 + bump)
    scale = noise / math.sqrt(dof / (dof - 2))
    return level * (1.0 + scale * rng.standard_t(dof, size=steps))
