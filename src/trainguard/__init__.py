"""trainguard: keeps neural-network training stable.

guard = trainguard.Guard(model, optimizer, scheduler, config=trainguard.GuardConfig(),
                         run_dir="runs/exp1")
loss.backward(); decision = guard.step(loss, batch_ids=ids)
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from trainguard.config import GuardConfig
from trainguard.detectors import DetectorSuite, MetricPoint
from trainguard.events import (
    ConfigError,
    Decision,
    Event,
    TrainguardError,
    TrainingHalted,
)

if TYPE_CHECKING:
    from trainguard.diagnosis import NonFiniteReport, ScanResult, scan, trace_nonfinite
    from trainguard.diagnosis.lint import Finding, lint
    from trainguard.guard import Guard

__version__ = "0.1.0"

# The parts that need torch load on first use, so `trainguard analyze` and `report` start fast.
_LAZY = {
    "Guard": "trainguard.guard",
    "NonFiniteReport": "trainguard.diagnosis",
    "ScanResult": "trainguard.diagnosis",
    "scan": "trainguard.diagnosis",
    "trace_nonfinite": "trainguard.diagnosis",
    "Finding": "trainguard.diagnosis.lint",
    "lint": "trainguard.diagnosis.lint",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainguard' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "Decision",
    "DetectorSuite",
    "Event",
    "Finding",
    "Guard",
    "GuardConfig",
    "MetricPoint",
    "NonFiniteReport",
    "ScanResult",
    "TrainguardError",
    "TrainingHalted",
    "__version__",
    "lint",
    "scan",
    "trace_nonfinite",
]
