"""Events, decisions and the errors a run can end with."""

from __future__ import annotations

import datetime as _dt
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]
Action = Literal["step", "skip", "rollback", "halt"]
SpikeType = Literal["gradient_explosion", "data_toxicity", "optimizer", "architecture"]
PreemptAction = Literal["lr_cut", "qk_rescale", "z_loss"]


class EventKind(str, Enum):
    """Every kind of event trainguard writes: the one registry of kinds (the events schema's
    `kind` enum is generated from it). A member compares equal to its string."""

    LOSS_SPIKE = "loss_spike"
    SPIKE_CLASSIFIED = "spike_classified"
    SPIKE_SAMPLES = "spike_samples"
    GRAD_SPIKE = "grad_spike"
    GRAD_RESPONSE = "grad_response"
    NONFINITE = "nonfinite"
    NAN_ORIGIN = "nan_origin"
    FP16_OVERFLOW = "fp16_overflow"
    GRAD_EXPLOSION = "grad_explosion"
    VANISHING_GRADIENTS = "vanishing_gradients"
    WEIGHT_JUMP = "weight_jump"
    STALL = "stall"
    DIVERGENCE = "divergence"
    OSCILLATION = "oscillation"
    LEVEL_SHIFT = "level_shift"
    HEALTH = "health"
    RANK_OUTLIER = "rank_outlier"
    STRAGGLER = "straggler"
    REPLICA_DIVERGENCE = "replica_divergence"
    ROUTING_COLLAPSE = "routing_collapse"
    LOSS_ABOVE_EMA = "loss_above_ema"
    EVAL_DECLINE = "eval_decline"
    TOKEN_ACCURACY = "token_accuracy"
    PRECURSOR = "precursor"
    LINT = "lint"
    ROLLBACK = "rollback"
    LR_REDUCED = "lr_reduced"
    ROLLBACK_UNAVAILABLE = "rollback_unavailable"
    REPLICA_RESYNC = "replica_resync"
    PREEMPTION = "preemption"
    DATA_SKIPPED = "data_skipped"
    DATA_EXHAUSTED = "data_exhausted"
    QUARANTINE = "quarantine"
    SNAPSHOT = "snapshot"
    CHECKPOINT = "checkpoint"
    RESUME = "resume"
    HALT = "halt"
    RUN_CLOSED = "run_closed"

    def __str__(self) -> str:
        return str(self.value)


EVENT_KINDS: tuple[str, ...] = tuple(kind.value for kind in EventKind)
_builtin_kinds = frozenset(EVENT_KINDS)
CUSTOM_KIND = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")  # "mylab.loss_plateau"
_custom_kinds: dict[str, str] = {}


def register_event_kind(name: str, description: str) -> str:
    """Register the kind of event a user's detector or action raises; it must be a dotted name
    (`"mylab.loss_plateau"`), so it never clashes with a built-in `EventKind`."""
    if not CUSTOM_KIND.match(name):
        raise TrainguardError(
            f"event kind {name!r} must be a dotted lower-case name, such as 'mylab.{name}', so "
            "it cannot clash with trainguard's own kinds"
        )
    _custom_kinds[name] = description
    return name


def check_kind(kind: str) -> None:
    """Raise a one-line `TrainguardError` for an event kind nobody registered."""
    if kind not in _builtin_kinds and kind not in _custom_kinds:
        name = kind if CUSTOM_KIND.match(kind) else f"mylab.{kind}"
        raise TrainguardError(
            f"event kind {kind!r} is neither trainguard's nor registered: a detector or action of "
            f"yours raised it; register it first with trainguard.register_event_kind({name!r}, "
            "'what it means')"
        )


def known_kinds() -> tuple[str, ...]:
    """The built-in kinds, then those registered with `register_event_kind`."""
    return EVENT_KINDS + tuple(_custom_kinds)


def events_schema_kind() -> dict[str, Any]:
    """The `kind` property of the events schema: a built-in kind, or a registered dotted one."""
    return {
        "anyOf": [
            {"enum": list(EVENT_KINDS)},
            {"type": "string", "pattern": CUSTOM_KIND.pattern},
        ],
        "description": "An EventKind, or a kind registered with trainguard.register_event_kind.",
    }


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

    def __post_init__(self) -> None:
        self.kind = str(self.kind)  # an `EventKind` member is kept as its plain string

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
class PreemptCall:
    """A preemptive action the policy chose on a `precursor` warning, for the actions to take
    after the optimizer step."""

    action: PreemptAction
    layer: str  # the layer acted on ("output" for z-loss)
    signal: str  # the precursor whose warning called for it
    value: float  # that layer's precursor at the warning
    factor: float | None = None  # lr_cut: the LR factor; qk_rescale: the max logit's factor
    warning_step: int = 0  # the step of the warning


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
    resync_from: int | None = None  # the rank whose replica the divergent ranks are given
    resync_ranks: list[int] = field(default_factory=list)  # the ranks whose replicas diverged
    agreed_step: int | None = None  # the last check where every replica agreed
    preempt: list[PreemptCall] = field(default_factory=list)  # on a precursor warning
    pending_step: int | None = None  # lagged path: the step launched since, judged next call

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
