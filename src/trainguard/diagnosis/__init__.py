"""Diagnosis: tools that replay a failing step under full tracing to say where it went wrong."""

from trainguard.diagnosis.nonfinite_trace import (
    ModuleRecord,
    NonFiniteOrigin,
    NonFiniteReport,
    trace_nonfinite,
)

__all__ = ["ModuleRecord", "NonFiniteOrigin", "NonFiniteReport", "trace_nonfinite"]
