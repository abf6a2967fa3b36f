"""`OptimizerActions`: unscale, clip, step or skip, in the order a mixed-precision loop needs."""

from __future__ import annotations

from typing import Any

import torch


class OptimizerActions:
    """Carries out the policy's decision on the optimizer, its scheduler and GradScaler."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        max_grad_norm: float | None = 1.0,
    ) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.max_grad_norm = max_grad_norm

    def unscale(self) -> None:
        """Unscale the gradients before they are measured (no-op without a scaler)."""
        if self.scaler is None:
            return
        try:
            self.scaler.unscale_(self.optimizer)
        except RuntimeError as exc:  # the user already unscaled this step
            if "unscale_() has already been called" not in str(exc):
                raise

    @torch.no_grad()
    def clip(self, grads: list[torch.Tensor], total_norm: torch.Tensor) -> None:
        """Scale gradients down to `max_grad_norm` on the device, with no host sync."""
        if self.max_grad_norm is None or not grads:
            return
        coef = (self.max_grad_norm / (total_norm + 1e-6)).clamp_(max=1.0)
        if grads[0].device == grads[-1].device:  # GradientStats orders gradients by device
            torch._foreach_mul_(grads, coef.to(grads[0].device))
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for device, group in by_device.items():
            torch._foreach_mul_(group, coef.to(device))

    def step(self, loss: float) -> None:
        """Apply the update: optimizer step, loss-scale update, scheduler step."""
        self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        self._step_scheduler(loss)

    def skip(self) -> None:
        """Discard this step's gradients; weights, optimizer state and scheduler stay as they are.

        A scaler still updates, so an overflow lowers the loss scale as it would on its own.
        """
        if self.scaler is not None:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def _step_scheduler(self, loss: float) -> None:
        if self.scheduler is None:
            return
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(loss)
        else:
            self.scheduler.step()
