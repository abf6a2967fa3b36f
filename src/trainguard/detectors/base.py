"""The detectors' input (`MetricPoint`) and base class: a pure, streaming function of metrics."""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from trainguard.events import Event, Severity, SpikeType

if TYPE_CHECKING:
    from trainguard.detectors.series import MetricSeries


@dataclass
class RankMetric:
    """A per-rank figure (a loss, an own grad norm) of a distributed step as the `reduce`
    exchange gives it: summaries over every rank, the worst rank, and the ranks a reduction
    pointed at; `own` is this rank's alone (what it learns its normal line from)."""

    world: int
    mean_log: float  # mean over the ranks of log(value), where every value is finite and > 0
    positive: bool  # every rank's value finite and over 0: log-ratios are defined
    nonfinite: int  # ranks whose value is not finite
    worst: float  # the largest rank's robust z (inf: over the warm-up ratio; -inf: none)
    worst_rank: int
    reach: float  # the furthest any rank reached in its window, in its robust deviations
    high: float  # the largest finite value, and its rank
    high_rank: int
    low: float
    low_rank: int
    own: float  # this rank's log-ratio to the others' centre
    # the ranks out of line (or non-finite): (rank, value, z), the worst first, `MAX_NAMED` at most
    named: list[tuple[int, float, float]] = field(default_factory=list)
    more: bool = False  # more ranks than named were out of line

    def others_centre(self, value: float) -> float:
        """The geometric mean of the other ranks' values, against a rank's `value`."""
        if self.world < 2 or not value > 0:
            return math.nan
        return math.exp((self.mean_log * self.world - math.log(value)) / (self.world - 1))


@dataclass
class RankTiming:
    """The ranks' step times of a distributed step as the `reduce` exchange gives them."""

    world: int
    mean: float  # over the ranks (NaN where any rank's is unknown)
    high: float  # the slowest rank's, and its rank
    high_rank: int
    mean_wait: float
    own: float  # this rank's step time and data wait
    own_wait: float
    own_slow: bool  # at a window's end: whether this rank's window was slow
    # stragglers to report at this window's end: (rank, mean step time, mean data wait, windows)
    named: list[tuple[int, float, float, int]] = field(default_factory=list)


@dataclass
class MetricPoint:
    """The figures of one step that detectors read; any of them may be missing."""

    step: int
    loss: float
    grad_norm: float | None = None
    lr: float | None = None
    loss_scale: float | None = None
    overflow: bool = False
    nonfinite_grads: int = 0
    nonfinite_params: list[str] = field(default_factory=list)
    group_grad_norms: dict[str, float] | None = None
    update_ratio: float | None = None
    group_param_norms: dict[str, float] | None = None  # the weights' norm a layer group
    # distributed runs: one value per rank, measured before the gradient reduction
    rank_losses: list[float] | None = None
    rank_grad_norms: list[float] | None = None
    rank_step_times: list[float] | None = None  # data wait + compute up to the first reduction
    rank_data_waits: list[float] | None = None
    # the same figures as the `reduce` exchange gives them: summaries and the ranks pointed at
    rank_metrics: dict[str, RankMetric] | None = None
    rank_timing: RankTiming | None = None
    routing: dict[str, float] | None = None  # a MoE router's health (`RoutingStats.to_point`)
    # a replica check's outcome: None where none was made, {} where every replica agreed, else
    # per layer group where they differ each rank's class (ranks of one class hold equal weights)
    replica_classes: dict[str, list[int]] | None = None
    # the guard itself rewrote weights since the last step (a preemptive QK rescale): their
    # norms moved by design, which `weight_jump` does not judge
    weights_rewritten: bool = False
    # the share of tokens whose argmax is the target: on a sampled step, or passed in
    token_accuracy: float | None = None
    # on a sampled step (`precursors.every`), the precursors of divergence: signal -> layer ->
    # value; signals "max_logit", "attn_entropy", "block_rms", "adam_eps_ratio" (per layer) and
    # "log_z" (layer "output")
    precursors: dict[str, dict[str, float]] | None = None

    @property
    def loss_finite(self) -> bool:
        return math.isfinite(self.loss)

    @property
    def grads_finite(self) -> bool:
        return self.nonfinite_grads == 0 and (
            self.grad_norm is None or math.isfinite(self.grad_norm)
        )


LOWER_IS_BETTER = frozenset(
    ("loss", "losses", "perplexity", "ppl", "error", "err", "wer", "cer", "nll", "bpb", "bpc")
)


def higher_is_better(name: str) -> bool:
    """Whether a larger value of the evaluation called `name` is better: a loss, perplexity,
    error rate, NLL or bits per byte is lower-is-better (a word of the name says so, as in
    `val_loss`, `eval/perplexity`), anything else (accuracy, MMLU, BLEU, ROUGE, F1, exact match,
    a benchmark's score) higher-is-better."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    return not any(w in LOWER_IS_BETTER or w.startswith(("loss", "perplexity")) for w in words)


@dataclass
class EvalPoint:
    """One evaluation of the model: its name (`val_loss`, `mmlu`), its value at `step`, and
    which way is better (inferred from the name by `higher_is_better`)."""

    step: int
    name: str
    value: float
    higher_is_better: bool

    @classmethod
    def of(cls, step: int, name: str, value: float) -> EvalPoint:
        """An evaluation whose direction is inferred from its name."""
        return cls(step, name, value, higher_is_better(name))


class Detector:
    """A detector reads one `MetricPoint` at a time and returns the events it raises there.

    Its state is plain data (numbers, lists, dicts) so `state_dict` is JSON- and
    `weights_only`-safe; `_state` names the attributes that form it.
    """

    name: ClassVar[str] = "detector"
    _state: ClassVar[tuple[str, ...]] = ()
    # the one figure whose value decides whether the next `update` raises this detector's event
    # ("loss" or "grad_norm"): the device gate skips on it; None where no such bound exists
    gate_figure: ClassVar[str | None] = None
    needs_ranks: ClassVar[bool] = False  # raises events only from a distributed run's ranks

    def update(self, point: MetricPoint) -> list[Event]:
        raise NotImplementedError

    def gate_bound(self) -> float:
        """The value of `gate_figure` over which the next `update` raises this detector's
        event, from the state alone (inf where none can); read before the step is measured."""
        return math.inf

    def evaluate(self, point: EvalPoint) -> list[Event]:
        """The events an evaluation of the model raises (`guard.evaluate`); called between the
        training steps, after every step up to the evaluation's own. The default raises none."""
        return []

    def advance(self, series: MetricSeries, start: int) -> int:
        """Take the steps of `series` from `start` in bulk while they raise nothing, leaving the
        state exactly as `update` would; returns where `update` must take over. The default
        takes none. A detector computes the figures its rules judge once, on a chunk of steps:
        `update` on a chunk of one, `advance` on a long one up to the first step where a
        decision is due, which `update` then takes."""
        return start

    def state_dict(self) -> dict[str, Any]:
        return {key: _export(getattr(self, key)) for key in self._state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a `state_dict`; a key that a state saved by an earlier version lacks keeps the
        value it has (a new detector's fresh one: load into a new detector)."""
        for key in self._state:
            if key not in state:
                continue
            current = getattr(self, key)
            value = state[key]
            if isinstance(current, StateParts):
                current.load_state_dict(value)
            elif isinstance(current, deque):
                setattr(self, key, deque(value, maxlen=current.maxlen))
            elif isinstance(current, np.ndarray):  # kept as a list in the state
                setattr(self, key, np.asarray(value, dtype=current.dtype))
            elif isinstance(current, dict) and isinstance(value, dict):
                setattr(self, key, _import_dict(value))
            else:
                setattr(self, key, value)

    def event(
        self,
        point: MetricPoint,
        severity: Severity,
        message: str,
        metrics: dict[str, Any],
        *,
        kind: str | None = None,
        type: SpikeType | None = None,
        confidence: float | None = None,
    ) -> Event:
        return Event(
            step=point.step,
            kind=kind or self.name,
            severity=severity,
            message=message,
            metrics=metrics,
            type=type,
            confidence=confidence,
        )


class StateParts:
    """A piece of detector state with its own plain-data `state_dict`."""

    def state_dict(self) -> dict[str, Any]:
        return {k: _export(v) for k, v in vars(self).items() if not k.startswith("_")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            current = getattr(self, key)
            setattr(
                self,
                key,
                deque(value, maxlen=current.maxlen) if isinstance(current, deque) else value,
            )


class SpikeRun(StateParts):
    """Consecutive steps outside the baseline, one incident; after `limit` of them their values
    are the new baseline (the level has shifted)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = False
        self.length = 0
        self.values: deque[float] = deque(maxlen=limit)

    def start(self, value: float) -> None:
        self.active = True
        self.length = 1
        self.values.clear()
        self.values.append(value)

    def extend(self, value: float) -> list[float] | None:
        """Count one more step of the incident; the values to rebaseline on once it lasted."""
        self.length += 1
        self.values.append(value)
        return list(self.values) if self.length >= self.limit else None

    def end(self) -> None:
        self.active = False
        self.length = 0


class Blocks(StateParts):
    """Collects a stream into blocks of `size` values."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: list[float] = []

    def add(self, value: float) -> list[float] | None:
        """Add a value; the completed block when this value fills it."""
        self.values.append(value)
        if len(self.values) < self.size:
            return None
        block, self.values = self.values, []
        return block


def _export(value: Any) -> Any:
    if isinstance(value, StateParts):
        return value.state_dict()
    if isinstance(value, deque):
        return list(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _export(v) for k, v in value.items()}
    if isinstance(value, list):
        if all(type(v) in _PLAIN for v in value):  # the common case, copied in one go
            return value.copy()
        return [_export(v) for v in value]
    return value


_PLAIN = (float, int, bool, str, type(None))


def _import_dict(value: dict[str, Any]) -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in value.items()}


def fmt(x: float | None) -> str:
    """A figure for a message: 4 significant digits."""
    if x is None:
        return "n/a"
    return f"{x:.4g}"
