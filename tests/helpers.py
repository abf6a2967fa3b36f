"""Shared helpers: the demo corpus, reading run files, and synthetic loss curves."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from trainguard.demo import MarkovCorpus, scenarios


def corpus() -> MarkovCorpus:
    return scenarios.corpus()


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
