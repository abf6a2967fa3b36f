"""`PreemptiveActions`: the preemptive actions a decision carries on a `precursor` warning, taken
after the optimizer step: an LR cut (through `OptimizerActions`), a QK rescale and z-loss
(through the guard's `Preemption`). The max-logit clipping kept up after a warning's own rescale
is summed up in one `info` event every `CLIP_SUMMARY_STEPS` steps, not one a layer a step."""

from __future__ import annotations

import math
from typing import Protocol

from trainguard.actions.optimizer_step import OptimizerActions
from trainguard.events import Decision, Event, EventKind, PreemptCall, TrainguardError

CLIP_SUMMARY_STEPS = 1000  # the routine clipping's rescales are summed up this often


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
        self.rewrote_weights = False  # the last `apply` rescaled some layer's W_q and W_k
        # the routine clipping since `clipped_since`: layer -> [rescales, the strongest factor,
        # the highest max logit it brought down]
        self.clipped: dict[str, list[float]] = {}
        self.clipped_since: int | None = None

    def apply(self, decision: Decision) -> list[Event]:
        """Take the decision's preemptive actions, after its optimizer step: their events, the
        routine clipping's summed up every `CLIP_SUMMARY_STEPS` steps."""
        step = decision.step
        events: list[Event] = []
        self.rewrote_weights = False
        for call in decision.preempt:
            event = self._take(step, call)
            rescaled = event.metrics.get("action") == "rescale_qk"
            self.rewrote_weights |= rescaled
            if rescaled and call.warning_step < step:  # kept up after the warning: tallied
                self._tally(step, call)
            else:
                events.append(event)
        if self.clipped_since is not None and step - self.clipped_since >= CLIP_SUMMARY_STEPS:
            events.append(self._clipping_summary(step))
        return events

    def _tally(self, step: int, call: PreemptCall) -> None:
        if self.clipped_since is None:
            self.clipped_since = step
        count, strongest, highest = self.clipped.get(call.layer, [0.0, math.inf, -math.inf])
        factor = call.factor if call.factor is not None else math.inf
        value = call.value if math.isfinite(call.value) else -math.inf
        self.clipped[call.layer] = [count + 1, min(strongest, factor), max(highest, value)]

    def _clipping_summary(self, step: int) -> Event:
        """One `info` event for the routine clipping since `clipped_since`; the tally restarts."""
        since = self.clipped_since
        layers = {
            layer: {"rescales": int(n), "strongest_factor": f, "highest_max_logit": v}
            for layer, (n, f, v) in sorted(self.clipped.items())
        }
        total = sum(v["rescales"] for v in layers.values())
        named = ", ".join(
            f"layer {layer} {v['rescales']}x (max logit up to {v['highest_max_logit']:.4g}, "
            f"factor down to {v['strongest_factor']:.3g})"
            for layer, v in layers.items()
        )
        self.clipped, self.clipped_since = {}, None
        return Event(
            step=step,
            kind=EventKind.PREEMPTION,
            severity="info",
            message=f"max-logit clipping kept up over steps {since}-{step}: {total} rescales of "
            f"{len(layers)} attention layer(s), each back to the target: {named}",
            metrics={
                "action": "rescale_qk",
                "summary": True,
                "since_step": since,
                "rescales": total,
                "layers": layers,
            },
        )

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
                return self.preemption.rescale_qk(step, call.layer, call.factor, call.value)
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
