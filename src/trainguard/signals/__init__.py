"""Signals: per-step statistics measured on the device, crossing to the host once per step."""

from trainguard.signals.gradients import GradientStats, StepSignals
from trainguard.signals.layer_groups import LayerGroups

__all__ = ["GradientStats", "LayerGroups", "StepSignals"]
