"""Detectors: pure, streaming functions of a metric stream that raise events."""

from trainguard.detectors.base import Detector, EvalPoint, MetricPoint
from trainguard.detectors.gradients import (
    GradExplosionDetector,
    GradSpikeDetector,
    VanishingGradientDetector,
)
from trainguard.detectors.health import HealthThresholdDetector
from trainguard.detectors.loss_spike import LossSpikeDetector
from trainguard.detectors.nonfinite import NonFiniteDetector
from trainguard.detectors.suite import DetectorSuite, register_detector, unregister_detector
from trainguard.detectors.trends import DivergenceDetector, OscillationDetector, StallDetector
from trainguard.detectors.weights import WeightJumpDetector

__all__ = [
    "Detector",
    "DetectorSuite",
    "DivergenceDetector",
    "EvalPoint",
    "GradExplosionDetector",
    "GradSpikeDetector",
    "HealthThresholdDetector",
    "LossSpikeDetector",
    "MetricPoint",
    "NonFiniteDetector",
    "OscillationDetector",
    "StallDetector",
    "VanishingGradientDetector",
    "WeightJumpDetector",
    "register_detector",
    "unregister_detector",
]
