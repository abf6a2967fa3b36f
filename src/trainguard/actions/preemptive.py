"""`PreemptiveActions`: the preemptive actions a decision carries on a `precursor` warning, taken
after the optimizer step: an LR cut (through `OptimizerActions`), a QK rescale and z-loss
(through the guard's `Preemption`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from trainguard.actions.optimizer_step import OptimizerActions
from trainguard.events import Decision, Event, EventKind, PreemptCall, TrainguardError


class QkAndZLoss(Protocol):
    """What the preemptive actions need of the guard's `Preemption`."""

    def rescale_qk(
        self, step: int, layer: str, factor: float, max_logit: float | None = None
    ) -> Event: ...

    def enable_z_loss(self, step: int, weight: float) -> Event: ...


class PreemptiveActions:
    """Takes a decision's `preempt` calls; each returns the `preemption` event that says what it
    did (or, where the model offers nothing to act on, why it did nothing)."""

    def __init__(
        self,
        actions: OptimizerActions | None,
        preemption: QkAndZLoss | None,
        z_loss_weight: float,
    ) -> None:
        self.actions = actions
        self.preemption = preemption
        self.z_loss_weight = z_loss_weight

    def apply(self, decision: Decision) -> list[Event]:
        """Take the decision's preemptive actions, after its optimizer step."""
        return [self._take(decision.step, call) for call in decision.preempt]

    def _take(self, step: int, call: PreemptCall) -> Event:
        where = "the output" if call.layer == "output" else f"layer {call.layer}"
        why = f"on the {call.signal} warning of {where} at step {call.warning_step}"
        if call.action == "lr_cut" and self.actions is not None and call.factor is not None:
            before = _first_lr(self.actions)
            self.actions.cut_lr(call.factor, hold=True)
            return Event(
                step=step,
                kind=EventKind.PREEMPTION,
                severity="warning",
                message=f"preemptive LR cut x{call.factor:.3g} {why}: the LR "
                f"{before:.3g} -> {_first_lr(self.actions):.3g}, held there while the schedule "
                f"would raise it; now x{self.actions.lr_scale:.3g} of the schedule",
                metrics={
                    "action": "lr_cut",
                    "layer": call.layer,
                    "signal": call.signal,
                    "lr_factor": call.factor,
                    "lr_scale": self.actions.lr_scale,
                },
                action="step",
            )
        try:
            if call.action == "qk_rescale" and self.preemption is not None and call.factor:
                event = self.preemption.rescale_qk(step, call.layer, call.factor, call.value)
                # the clipping kept up after the warning's own rescale is routine: info
                return event if call.warning_step >= step else replace(event, severity="info")
            if call.action == "z_loss" and self.preemption is not None:
                return self.preemption.enable_z_loss(step, self.z_loss_weight)
        except TrainguardError as exc:  # a layer or head it cannot find: said, not raised
            return _not_taken(step, call, why, str(exc))
        return _not_taken(
            step,
            call,
            why,
            "this guard cannot cut the LR (no optimizer)"
            if call.action == "lr_cut"
            else "this guard cannot rescale or hook the model's layers (a DeepSpeed engine's "
            "master weights would undo it)",
        )


def _not_taken(step: int, call: PreemptCall, why: str, reason: str) -> Event:
    """The event of a preemptive action that could not be taken, and why."""
    return Event(
        step=step,
        kind=EventKind.PREEMPTION,
        severity="warning",
        message=f"preemptive {call.action} {why} not taken: {reason}",
        metrics={"action": call.action, "layer": call.layer, "signal": call.signal, "taken": False},
        action="step",
    )


def _first_lr(actions: OptimizerActions) -> float:
    """The first parameter group's LR in use (read once, on a preemption only)."""
    return float(actions.optimizer.param_groups[0]["lr"])
