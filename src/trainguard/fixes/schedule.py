"""`WarmupCosineRestarts`: linear warmup from 0, then cosine cycles down to a floor."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler


class WarmupCosineRestarts(LRScheduler):
    """Each group's LR rises linearly from 0 to its base over `warmup_steps`, then follows
    `n_cycles` cosine cycles from the base down to `min_lr` (a fraction of the base when
    `min_lr_ratio`), restarting at the base, until `total_steps`; after that it stays at the
    floor. Step it once per optimizer step."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int,
        total_steps: int,
        n_cycles: int = 1,
        min_lr: float = 0.0,
        min_lr_ratio: float | None = None,
        last_epoch: int = -1,
    ) -> None:
        if warmup_steps < 0 or total_steps <= warmup_steps or n_cycles < 1:
            raise ValueError("need 0 <= warmup_steps < total_steps and n_cycles >= 1")
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.n_cycles = n_cycles
        self.min_lr = min_lr
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int, base: float) -> float:
        """The closed form: the LR of a group with base LR `base` at `step`."""
        floor = base * self.min_lr_ratio if self.min_lr_ratio is not None else self.min_lr
        if step < self.warmup_steps:
            return base * step / self.warmup_steps
        if step >= self.total_steps:
            return floor
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        within = (progress * self.n_cycles) % 1.0
        return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * within))

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [self.lr_at(self.last_epoch, float(base)) for base in self.base_lrs]
