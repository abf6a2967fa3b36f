"""`HealthThresholdDetector`: the original absolute health levels, an opt-in preset."""

from __future__ import annotations

import math

from trainguard.config import HealthConfig
from trainguard.detectors.base import Detector, MetricPoint, fmt
from trainguard.events import Event, Severity

_LEVELS: tuple[Severity, ...] = ("info", "warning", "critical")


class HealthThresholdDetector(Detector):
    """Finite loss, grad norm and the count of fp16 overflow steps against fixed warn and danger
    levels; one event each time a signal enters a worse level."""

    name = "health"
    _state = ("levels", "overflows")

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self.levels: dict[str, int] = {"loss": 0, "grad_norm": 0, "overflow": 0}
        self.overflows = 0

    def update(self, point: MetricPoint) -> list[Event]:
        cfg = self.config
        if point.overflow:
            self.overflows += 1
        grad = point.grad_norm  # non-finite values are the NonFiniteDetector's
        checks: list[tuple[str, float | None, float, float]] = [
            ("loss", point.loss if point.loss_finite else None, cfg.loss_warn, cfg.loss_danger),
            (
                "grad_norm",
                grad if grad is not None and math.isfinite(grad) else None,
                cfg.grad_norm_warn,
                cfg.grad_norm_danger,
            ),
            ("overflow", float(self.overflows), cfg.overflow_warn, cfg.overflow_danger),
        ]
        events: list[Event] = []
        for signal, value, warn, danger in checks:
            if value is None:
                continue
            level = 2 if value > danger else 1 if value > warn else 0
            if level > self.levels[signal]:
                severity = _LEVELS[level]
                limit = danger if level == 2 else warn
                label = "fp16 overflow steps" if signal == "overflow" else signal.replace("_", " ")
                events.append(
                    self.event(
                        point,
                        severity,
                        f"{label} {fmt(value)} is over the {severity} level {fmt(limit)}",
                        {"signal": signal, "value": value, "limit": limit},
                    )
                )
            self.levels[signal] = level
        return events
