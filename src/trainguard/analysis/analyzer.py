"""`analyze`: run the detectors over a log offline and judge it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainguard.analysis.logs import LogData
from trainguard.config import GuardConfig
from trainguard.detectors import DetectorSuite
from trainguard.events import SEVERITY_RANK, Event

SPIKE_WINDOW = 128
SPIKE_SIGMAS = 6.0
RECENT_STEPS = 10_000


def spike_score(
    values: np.ndarray, window: int = SPIKE_WINDOW, sigmas: float = SPIKE_SIGMAS
) -> float:
    """OLMo-core's spike score: the fraction of points more than `sigmas` standard deviations
    above the mean of the `window` points before them."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) <= window:
        return 0.0
    hits = 0
    for s in range(window, len(v), 1 << 16):  # running sums per chunk, centred to stay exact
        part = v[s - window : s + (1 << 16)]
        centred = part - part.mean()
        sums = np.concatenate(([0.0], np.cumsum(centred)))
        squares = np.concatenate(([0.0], np.cumsum(centred * centred)))
        mean = (sums[window:-1] - sums[: -window - 1]) / window
        var = (squares[window:-1] - squares[: -window - 1]) / window - mean * mean
        std = np.sqrt(np.maximum(var, 0.0))
        hits += int(np.count_nonzero(centred[window:] > mean + sigmas * std))
    return hits / (len(v) - window)


@dataclass
class Analysis:
    """The events the detectors raised over a log, and a summary of the run."""

    events: list[Event]
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def incidents(self) -> list[Event]:
        return [e for e in self.events if SEVERITY_RANK[e.severity] >= SEVERITY_RANK["warning"]]

    def to_dict(self) -> dict[str, Any]:
        keys = ("step", "kind", "severity", "type", "message", "metrics")
        return {
            "events": [{k: e.to_dict()[k] for k in keys} for e in self.events],
            "summary": self.summary,
        }


def analyze(data: LogData, config: GuardConfig | None = None) -> Analysis:
    """The same detectors as a live run over the logged steps; quiet stretches are taken in
    bulk (`DetectorSuite.run`), with the same events as step by step."""
    suite = DetectorSuite(config or GuardConfig())
    events = suite.run(data.series())
    grad = data.extra.get("grad_norm")
    summary: dict[str, Any] = {
        "steps": len(data.steps),
        "first_step": int(data.steps[0]),
        "last_step": int(data.steps[-1]),
        "by_kind": dict(Counter(e.kind for e in events)),
        "spike_score": {
            "loss": spike_score(data.loss),
            "loss_last_10k": spike_score(data.loss[-RECENT_STEPS:]),
        },
        "final_loss": float(data.loss[-1]),
        "warnings": data.warnings,
    }
    if grad is not None:
        finite = grad[np.isfinite(grad)]
        summary["spike_score"]["grad_norm"] = spike_score(finite)
        summary["spike_score"]["grad_norm_last_10k"] = spike_score(finite[-RECENT_STEPS:])
    result = Analysis(events, summary)
    summary["incidents"] = len(result.incidents)
    return result
