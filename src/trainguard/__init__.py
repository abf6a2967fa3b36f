"""trainguard: keeps neural-network training stable.

guard = trainguard.Guard(model, optimizer, scheduler, config=trainguard.GuardConfig(),
                         run_dir="runs/exp1")
loss.backward(); decision = guard.step(loss, batch_ids=ids)
"""

from trainguard.config import GuardConfig
from trainguard.detectors import DetectorSuite, MetricPoint
from trainguard.diagnosis import NonFiniteReport, ScanResult, scan, trace_nonfinite
from trainguard.diagnosis.lint import Finding, lint
from trainguard.events import (
    ConfigError,
    Decision,
    Event,
    TrainguardError,
    TrainingHalted,
)
from trainguard.guard import Guard

__version__ = "0.1.0"

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
