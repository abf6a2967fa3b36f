"""`StepPolicy`: step, skip or halt, from the events of one step and the policy's own history."""

from __future__ import annotations

from typing import Any

from trainguard.config import PolicyConfig
from trainguard.detectors.base import MetricPoint
from trainguard.events import Decision, Event


class StepPolicy:
    """Non-finite gradients or loss are always skipped, and halt the run after
    `max_consecutive_nonfinite` in a row; an fp16 overflow is skipped (the scaler's own skip);
    kinds in `halt_on` halt; kinds in `skip_on` skip, at most `max_consecutive_skips` in a row."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.consecutive_skips = 0
        self.consecutive_nonfinite = 0

    def decide(self, point: MetricPoint, events: list[Event]) -> Decision:
        cfg = self.config
        kinds = {e.kind for e in events}
        nonfinite = (
            "nonfinite" in kinds
            or not point.loss_finite
            or (not point.grads_finite and not point.overflow)
        )
        if nonfinite:
            self.consecutive_nonfinite += 1
            if self.consecutive_nonfinite >= cfg.max_consecutive_nonfinite:
                return self._decide(
                    point,
                    events,
                    "halt",
                    f"non-finite loss or gradients on {self.consecutive_nonfinite} steps in a row: "
                    "the weights or the data give NaN/Inf every step; resume from a checkpoint "
                    "before the incident with a lower LR, or trace the first module that made it",
                )
            return self._decide(point, events, "skip", "non-finite loss or gradients")
        self.consecutive_nonfinite = 0
        if point.overflow:
            return self._decide(point, events, "skip", "fp16 overflow: the scaler skipped it")
        halting = [e for e in events if e.kind in cfg.halt_on]
        if halting:
            first = halting[0]
            return self._decide(point, events, "halt", f"{first.kind}: {first.message}")
        skipping = [e for e in events if e.kind in cfg.skip_on]
        if skipping:
            if self.consecutive_skips < cfg.max_consecutive_skips:
                self.consecutive_skips += 1
                reasons = ", ".join(sorted({e.kind for e in skipping}))
                return self._decide(point, events, "skip", f"skipped for {reasons}")
            return self._decide(
                point,
                events,
                "step",
                f"{self.consecutive_skips} skips in a row already: stepping, since skipping "
                "more batches does not repair the model",
            )
        self.consecutive_skips = 0
        return self._decide(point, events, "step", "")

    @staticmethod
    def _decide(point: MetricPoint, events: list[Event], action: Any, reason: str) -> Decision:
        for event in events:
            event.action = action
        return Decision(step=point.step, action=action, events=events, reason=reason)

    def state_dict(self) -> dict[str, Any]:
        return {
            "consecutive_skips": self.consecutive_skips,
            "consecutive_nonfinite": self.consecutive_nonfinite,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_skips = int(state["consecutive_skips"])
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])
