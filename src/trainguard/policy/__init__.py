"""Policy: the one place where events become an action."""

from trainguard.policy.step_policy import StepPolicy

__all__ = ["StepPolicy"]
