"""trainguard: keeps neural-network training stable.

guard = trainguard.Guard(model, optimizer, scheduler, config=trainguard.GuardConfig(),
                         run_dir="runs/exp1")
loss.backward(); decision = guard.step(loss, batch_ids=ids)
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from trainguard.config import GuardConfig
from trainguard.detectors import (
    Detector,
    DetectorSuite,
    EvalPoint,
    MetricPoint,
    register_detector,
)
from trainguard.events import (
    ConfigError,
    Decision,
    Event,
    EventKind,
    TrainguardError,
    TrainingHalted,
    register_event_kind,
)

if TYPE_CHECKING:
    from trainguard.actions.user_actions import ActionTarget, GuardAction, register_action
    from trainguard.diagnosis import NonFiniteReport, ScanResult, scan, trace_nonfinite
    from trainguard.diagnosis.lint import Finding, lint
    from trainguard.guard import Guard
    from trainguard.monitor import Monitor

__version__ = "0.1.0"

# The parts that need torch load on first use, so `trainguard analyze` and `report` start fast.
_LAZY = {
    "Guard": "trainguard.guard",
    "Monitor": "trainguard.monitor",
    "ActionTarget": "trainguard.actions.user_actions",
    "GuardAction": "trainguard.actions.user_actions",
    "register_action": "trainguard.actions.user_actions",
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
    "ActionTarget",
    "ConfigError",
    "Decision",
    "Detector",
    "DetectorSuite",
    "EvalPoint",
    "Event",
    "EventKind",
    "Finding",
    "Guard",
    "GuardAction",
    "GuardConfig",
    "MetricPoint",
    "Monitor",
    "NonFiniteReport",
    "ScanResult",
    "TrainguardError",
    "TrainingHalted",
    "__version__",
    "lint",
    "register_action",
    "register_detector",
    "register_event_kind",
    "scan",
    "trace_nonfinite",
]
