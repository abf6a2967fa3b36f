"""Diagnosis: tools that replay a failing step under full tracing to say where it went wrong."""

from trainguard.diagnosis.nonfinite_trace import (
    ModuleRecord,
    NonFiniteInput,
    NonFiniteOrigin,
    NonFiniteReport,
    TensorStats,
    trace_nonfinite,
)
from trainguard.diagnosis.scan import ScanResult, scan
from trainguard.diagnosis.spike_samples import SpikeSample, blame_samples, lm_cross_entropy

__all__ = [
    "ModuleRecord",
    "NonFiniteInput",
    "NonFiniteOrigin",
    "NonFiniteReport",
    "ScanResult",
    "SpikeSample",
    "TensorStats",
    "blame_samples",
    "lm_cross_entropy",
    "scan",
    "trace_nonfinite",
]
