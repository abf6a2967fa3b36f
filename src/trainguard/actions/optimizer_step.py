"""`OptimizerActions`: unscale, clip, step or skip, in the order a mixed-precision loop needs."""

from __future__ import annotations

from typing import Any

import torch

from trainguard._torch_private import set_found_inf


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
        self.lr_cut = 1.0  # the LR multiplier right after the last cut
        self.lr_ceiling = 1.0  # the multiplier a re-warm climbs back to (kept cuts lower it)
        self.rewarm_steps = 0  # steps the last cut takes to climb back; 0 keeps it
        self.since_cut = 0  # optimizer steps since then, for the re-warm
        self.lr_hold: list[float | None] | None = None  # per group: the LR a held cut never passes
        self._schedule_lrs: list[Any] | None = None  # the LR the schedule wants, per group
        self._set: list[Any] | None = None  # the LRs the guard last put in the groups

    def unscale(self) -> None:
        """Unscale the gradients before they are measured (no-op without a scaler)."""
        if self.scaler is None:
            return
        try:
            self.scaler.unscale_(self.optimizer)
        except RuntimeError as exc:  # the user already unscaled this step
            if "unscale_() has already been called" not in str(exc):
                raise

    def clip(self, parameters: list[torch.Tensor], total_norm: torch.Tensor) -> None:
        """Scale the parameters' gradients down to `max_grad_norm` by the measured `total_norm`
        (torch's `clip_grads_with_norm_`): launched on the device, with no host sync."""
        if self.max_grad_norm is None:
            return
        torch.nn.utils.clip_grads_with_norm_(parameters, self.max_grad_norm, total_norm)

    def step(self, loss: float) -> None:
        """Apply the update: optimizer step, loss-scale update, scheduler step, LR re-warm."""
        self._take_schedule_lrs()
        self._apply_update()
        self.after_update(loss)

    def gated_step(self, skip: torch.Tensor) -> None:
        """Launch the update behind the device gate `skip` (1.0: the fused optimizer leaves
        weights, moments and step counts untouched), with no host read; `after_update` follows
        once the host knows it was applied."""
        self._take_schedule_lrs()
        set_found_inf(self.optimizer, skip)
        try:
            self.optimizer.step()
        finally:
            set_found_inf(self.optimizer, None)

    def _take_schedule_lrs(self) -> None:
        if self._schedule_lrs is not None and self._moved_elsewhere():
            # a schedule the guard does not step (a Trainer's) set the LRs since: they are the
            # schedule's now, and the cut goes on top of them
            self._schedule_lrs = [g["lr"] for g in self.optimizer.param_groups]
            self._apply_lr_scale()

    def after_update(self, loss: float) -> None:
        """After an applied update: scheduler step and LR re-warm."""
        if self._schedule_lrs is None:
            self._step_scheduler(loss)
            return
        self.since_cut += 1
        self._set_lrs(self._schedule_lrs)  # the scheduler works on its own LRs, not ours
        self._step_scheduler(loss)
        self._schedule_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self._apply_lr_scale()

    def _apply_update(self) -> None:
        """The update itself: the optimizer's step and the loss-scale update."""
        self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()

    # -- LR cuts ----------------------------------------------------------------------------------
    @property
    def lr_scale(self) -> float:
        """The factor between the schedule's LR and the LR in use."""
        if self.rewarm_steps <= 0 or self.lr_cut >= self.lr_ceiling:
            return self.lr_cut
        progress = min(1.0, self.since_cut / self.rewarm_steps)
        return self.lr_cut + (self.lr_ceiling - self.lr_cut) * progress

    def cut_lr(self, factor: float, rewarm_steps: int = 0, hold: bool = False) -> None:
        """Multiply the LR in use by `factor`; it climbs back to where it was before the cuts
        that were kept over `rewarm_steps` optimizer steps, or stays cut when that is 0. A `hold`
        cut also keeps the LR from climbing past its new value while the schedule still rises (a
        warmup): the scale falls as the schedule climbs, and stays there as it decays."""
        if self._schedule_lrs is None:
            self._schedule_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.lr_cut = self.lr_scale * factor
        if rewarm_steps <= 0:
            self.lr_ceiling = self.lr_cut
        self.rewarm_steps = rewarm_steps
        self.since_cut = 0
        if hold:
            held = [_plain(lr * self.lr_cut) for lr in self._schedule_lrs]
            self.lr_hold = [
                h if old is None or h is None else min(h, old)
                for h, old in zip(held, self.lr_hold or [None] * len(held), strict=True)
            ]
        self._apply_lr_scale()

    def schedule_lrs(self) -> list[Any]:
        return list(self._schedule_lrs or [g["lr"] for g in self.optimizer.param_groups])

    def restore_schedule_lrs(self, lrs: list[Any]) -> None:
        """After a rollback: the schedule's LRs of the snapshot, with the current cut on top."""
        self._schedule_lrs = list(lrs)
        self._apply_lr_scale()

    def _apply_lr_scale(self) -> None:
        assert self._schedule_lrs is not None
        if self.lr_hold is not None:
            self._keep_under_hold()
        scale = self.lr_scale
        self._set_lrs([lr * scale for lr in self._schedule_lrs])

    def _keep_under_hold(self) -> None:
        """Lower the kept cut where the schedule climbed so far that the LR in use would pass a
        held cut's LR."""
        assert self._schedule_lrs is not None and self.lr_hold is not None
        for lr, held in zip(self._schedule_lrs, self.lr_hold, strict=False):
            planned = _plain(lr)
            if held is None or planned is None or planned <= 0:
                continue
            if planned * self.lr_cut > held:
                self.lr_cut = held / planned
                self.lr_ceiling = min(self.lr_ceiling, self.lr_cut)

    def _set_lrs(self, lrs: list[Any]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._set = list(lrs)

    def _moved_elsewhere(self) -> bool:
        """Whether a group's LR is no longer the one the guard last set (a float compared by
        value, a tensor LR by identity)."""
        if self._set is None:
            return False
        return any(
            not (now is was or (not isinstance(now, torch.Tensor) and now == was))
            for now, was in zip(
                (g["lr"] for g in self.optimizer.param_groups), self._set, strict=False
            )
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr_cut": self.lr_cut,
            "lr_ceiling": self.lr_ceiling,
            "rewarm_steps": self.rewarm_steps,
            "since_cut": self.since_cut,
            "schedule_lrs": self._schedule_lrs,
            "lr_hold": self.lr_hold,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr_cut = float(state["lr_cut"])
        self.lr_ceiling = float(state.get("lr_ceiling", self.lr_cut))  # earlier: every cut kept
        self.rewarm_steps = int(state.get("rewarm_steps", 0))
        self.since_cut = int(state["since_cut"])
        self._schedule_lrs = state["schedule_lrs"]
        hold = state.get("lr_hold")  # earlier: no held cut
        self.lr_hold = None if hold is None else [None if h is None else float(h) for h in hold]

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


def _plain(lr: Any) -> float | None:
    """A float LR as a float; None for a tensor LR (a held cut leaves those alone rather than
    reading them back from the device every step)."""
    return float(lr) if isinstance(lr, (int, float)) else None
