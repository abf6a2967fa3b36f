"""`StepPolicy`: step, skip, roll back or halt, from the events of one step and its own history."""

from __future__ import annotations

from collections import deque
from typing import Any

from trainguard.config import PolicyConfig, RecoveryConfig
from trainguard.detectors.base import MetricPoint
from trainguard.events import Action, Decision, Event

SAME_REGION = 2  # rollbacks to targets this many snapshot intervals apart hit the same region
MAX_WIDENING = 3  # the skip doubles with each repeat in a region, up to 2**3 times


class StepPolicy:
    """The only place where events become an action (README: the rules, in order)."""

    def __init__(
        self, config: PolicyConfig | None = None, recovery: RecoveryConfig | None = None
    ) -> None:
        self.config = config or PolicyConfig()
        self.recovery = recovery or RecoveryConfig()
        self.consecutive_skips = 0
        self.consecutive_nonfinite = 0
        self.nonfinite_steps: deque[int] = deque(maxlen=self.recovery.nonfinite_rollback)
        self.rollback_steps: deque[int] = deque(maxlen=self.recovery.max_rollbacks + 1)
        self.lr_cuts = 0
        self.architecture_rollbacks = 0
        self.last_target: int | None = None
        self.region_repeats = 0

    def decide(
        self, point: MetricPoint, events: list[Event], can_roll_back: bool = False
    ) -> Decision:
        cfg, rec = self.config, self.recovery
        kinds = {e.kind for e in events}
        step = point.step
        nonfinite = (
            "nonfinite" in kinds
            or not point.loss_finite
            or (not point.grads_finite and not point.overflow)
        )
        halting = [e for e in events if e.kind in cfg.halt_on]
        if halting:  # the user's halt list wins over every other rule
            return self._halt(point, events, f"{halting[0].kind}: {halting[0].message}")
        if nonfinite:
            self.consecutive_nonfinite += 1
            self.nonfinite_steps.append(step)
            recent = [s for s in self.nonfinite_steps if step - s < rec.nonfinite_window]
            if can_roll_back and rec.enabled and len(recent) >= rec.nonfinite_rollback:
                self.nonfinite_steps.clear()
                return self._rollback(
                    point,
                    events,
                    recent[0],
                    f"{len(recent)} non-finite steps within {rec.nonfinite_window}",
                    explosion=True,
                )
            if self.consecutive_nonfinite >= cfg.max_consecutive_nonfinite:
                return self._halt(
                    point,
                    events,
                    f"non-finite loss or gradients on {self.consecutive_nonfinite} steps in a "
                    "row: the weights or the data give NaN/Inf every step; resume from a "
                    "checkpoint before the incident with a lower LR, or trace the first module "
                    "that made it",
                )
            return self._decide(point, events, "skip", "non-finite loss or gradients")
        self.consecutive_nonfinite = 0
        if point.overflow:
            return self._decide(point, events, "skip", "fp16 overflow: the scaler skipped it")
        if rec.enabled and can_roll_back:
            decision = self._recovery(point, events)
            if decision is not None:
                return decision
        if rec.enabled and "oscillation" in kinds:
            decision = self._decide(point, events, "step", "oscillation: LR lowered")
            decision.lr_factor = self._next_lr_factor()
            return decision
        skipping = [e for e in events if e.kind in cfg.skip_on]
        if skipping:
            if self.consecutive_skips < cfg.max_consecutive_skips:
                self.consecutive_skips += 1
                reasons = ", ".join(sorted({e.kind for e in skipping}))
                decision = self._decide(point, events, "skip", f"skipped for {reasons}")
                toxic = any(e.kind == "loss_spike" and e.type == "data_toxicity" for e in skipping)
                if toxic:
                    decision.quarantine = True
                    decision.incident_step = step
                return decision
            return self._decide(
                point,
                events,
                "step",
                f"{self.consecutive_skips} skips in a row already: stepping, since skipping "
                "more batches does not repair the model",
            )
        self.consecutive_skips = 0
        return self._decide(point, events, "step", "")

    # -- recovery ---------------------------------------------------------------------------------
    def _recovery(self, point: MetricPoint, events: list[Event]) -> Decision | None:
        """A rollback for a gradient explosion (typed at onset or on follow-up), an
        architecture-type spike or a divergence; None when no event calls for one."""
        for e in events:
            if e.kind == "loss_spike" and e.type == "gradient_explosion":
                return self._rollback(point, events, e.step, "gradient-explosion spike", True)
            if e.kind == "spike_classified" and e.type == "gradient_explosion":
                spike = int(e.metrics.get("spike_step", e.step))
                return self._rollback(point, events, spike, "gradient explosion confirmed", True)
            if e.kind in ("divergence",) or (
                e.kind == "spike_classified" and e.type == "architecture"
            ):
                self.architecture_rollbacks += 1
                if self.architecture_rollbacks > self.recovery.architecture_rollbacks:
                    return self._halt(
                        point,
                        events,
                        f"{e.kind} survived {self.recovery.architecture_rollbacks} rollbacks: "
                        f"{e.message}; this looks like an architecture or initialisation fault "
                        "(normalisation, residual scaling), not bad data or a bad step",
                    )
                start = e.step - (int(e.metrics.get("window", 0)) if e.kind == "divergence" else 0)
                if e.kind == "spike_classified":
                    start = int(e.metrics.get("spike_step", e.step))
                return self._rollback(point, events, start, e.kind, True)
        return None

    def _rollback(
        self, point: MetricPoint, events: list[Event], incident: int, why: str, explosion: bool
    ) -> Decision:
        rec = self.recovery
        step = point.step
        recent = [s for s in self.rollback_steps if step - s < rec.rollback_window]
        if len(recent) >= rec.max_rollbacks:
            return self._halt(
                point,
                events,
                f"{len(recent) + 1} rollbacks within {rec.rollback_window} steps and the "
                f"incidents continue ({why}); nothing the guard can do helps: check the data "
                "around these steps, the LR schedule and the model's numerics",
            )
        self.rollback_steps.append(step)
        target = incident - rec.rollback_margin
        if self.last_target is not None and abs(target - self.last_target) <= (
            SAME_REGION * rec.snapshot_every
        ):
            self.region_repeats += 1
        else:
            self.region_repeats = 0
        self.last_target = target
        base = rec.skip_after_explosion if explosion else rec.skip_after_toxicity
        decision = self._decide(point, events, "rollback", why)
        decision.rollback_to = target
        decision.incident_step = incident
        decision.skip_after = base * 2 ** min(self.region_repeats, MAX_WIDENING)
        decision.lr_factor = self._next_lr_factor()
        self.consecutive_skips = 0
        self.consecutive_nonfinite = 0
        return decision

    def _next_lr_factor(self) -> float:
        """The seed's schedule: max(0.1, 0.5 ** (1 + 0.1 * cuts so far)), compounding."""
        factor = float(max(0.1, 0.5 ** (1 + 0.1 * self.lr_cuts)))
        self.lr_cuts += 1
        return factor

    def _halt(self, point: MetricPoint, events: list[Event], reason: str) -> Decision:
        return self._decide(point, events, "halt", reason)

    @staticmethod
    def _decide(point: MetricPoint, events: list[Event], action: Action, reason: str) -> Decision:
        for event in events:
            event.action = action
        return Decision(step=point.step, action=action, events=events, reason=reason)

    def state_dict(self) -> dict[str, Any]:
        return {
            "consecutive_skips": self.consecutive_skips,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "nonfinite_steps": list(self.nonfinite_steps),
            "rollback_steps": list(self.rollback_steps),
            "lr_cuts": self.lr_cuts,
            "architecture_rollbacks": self.architecture_rollbacks,
            "last_target": self.last_target,
            "region_repeats": self.region_repeats,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_skips = int(state["consecutive_skips"])
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])
        self.nonfinite_steps.clear()
        self.nonfinite_steps.extend(state.get("nonfinite_steps", []))
        self.rollback_steps.clear()
        self.rollback_steps.extend(state.get("rollback_steps", []))
        self.lr_cuts = int(state.get("lr_cuts", 0))
        self.architecture_rollbacks = int(state.get("architecture_rollbacks", 0))
        self.last_target = state.get("last_target")
        self.region_repeats = int(state.get("region_repeats", 0))
