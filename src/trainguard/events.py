"""Events, decisions and the errors a run can end with."""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]
Action = Literal["step", "skip", "rollback", "halt"]
SpikeType = Literal["gradient_explosion", "data_toxicity", "optimizer", "architecture"]

EVENT_KINDS: tuple[str, ...] = (
    "loss_spike",
    "spike_classified",
    "spike_samples",
    "grad_spike",
    "nonfinite",
    "nan_origin",
    "fp16_overflow",
    "grad_explosion",
    "vanishing_gradients",
    "weight_jump",
    "stall",
    "divergence",
    "oscillation",
    "health",
    "rank_outlier",
    "straggler",
    "routing_collapse",
    "lint",
    "rollback",
    "lr_reduced",
    "rollback_unavailable",
    "data_skipped",
    "data_exhausted",
    "quarantine",
    "checkpoint",
    "resume",
    "halt",
    "run_closed",
)
SPIKE_TYPES: tuple[str, ...] = ("gradient_explosion", "data_toxicity", "optimizer", "architecture")
SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def _json_number(value: Any) -> Any:
    """Map non-finite floats to strings so every event stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _json_number(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_number(v) for v in value]
    return value


@dataclass
class Event:
    """One thing a detector saw at one step; the policy fills in `action`."""

    step: int
    kind: str
    severity: Severity
    message: str
    metrics: dict[str, Any] = field(default_factory=dict)
    type: SpikeType | None = None
    confidence: float | None = None
    action: Action | None = None
    time: str = field(default_factory=_utc_now)
    rank: int | None = None  # in a distributed run, the rank the event is about

    def to_dict(self) -> dict[str, Any]:
        """The event as one JSON-ready object, in the schema of `events.jsonl`."""
        return {
            "step": self.step,
            "time": self.time,
            "kind": self.kind,
            "severity": self.severity,
            "type": self.type,
            "confidence": self.confidence,
            "message": self.message,
            "metrics": _json_number(self.metrics),
            "action": self.action,
            "rank": self.rank,
        }

    def revised_type(self, later: Iterable[Event]) -> SpikeType | None:
        """This spike's type as its `spike_classified` follow-up among `later` left it (its
        first guess when there is none)."""
        for e in later:
            if e.kind == "spike_classified" and e.metrics.get("spike_step") == self.step:
                return e.type
        return self.type


@dataclass
class Decision:
    """What the guard did at one step, with the events raised there and the step's figures."""

    step: int
    action: Action
    events: list[Event] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    rollback_to: int | None = None  # roll back to a snapshot at or before this step
    incident_step: int | None = None  # the step whose data fed the incident
    skip_after: int = 0  # batches skipped after the incident batch
    skip_widening: int = 1  # repeats in one region widen the skip and its share of the data
    replay_incident: bool = False  # skip nothing: the incident's batches are fed again
    lr_factor: float | None = None  # multiply the LR by this
    rewarm_steps: int = 0  # steps over which that cut climbs back to the schedule; 0 keeps it
    suspect: bool = False  # this step's batch is skipped as toxic until its spike's follow-up
    quarantine_step: int | None = None  # the follow-up confirmed this step's batch: quarantine
    release_step: int | None = None  # this step's spike was re-typed: its batch is released
    unrolled_incident: int | None = None  # no snapshot before this incident: LR cut instead

    @property
    def quarantine(self) -> bool:
        """Whether a batch is quarantined for good at this step (`quarantine_step`'s)."""
        return self.quarantine_step is not None

    @property
    def skipped(self) -> bool:
        return self.action == "skip"


class TrainguardError(Exception):
    """A usage or input error, with a one-line message that says what to do."""


class ConfigError(TrainguardError):
    """A configuration file or value that cannot be used."""


class TrainingHalted(RuntimeError):
    """Raised by `Guard.step` when the policy halts the run; carries the diagnosis."""

    def __init__(self, diagnosis: str, decision: Decision) -> None:
        super().__init__(diagnosis)
        self.diagnosis = diagnosis
        self.decision = decision
