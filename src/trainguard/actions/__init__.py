"""Actions: the only code that touches the model's gradients, the optimizer and the scheduler."""

from trainguard.actions.optimizer_step import OptimizerActions

__all__ = ["OptimizerActions"]
