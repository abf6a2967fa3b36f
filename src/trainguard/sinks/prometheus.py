"""`PrometheusSink`: the run's figures as Prometheus gauges and counters on an HTTP endpoint."""

from __future__ import annotations

import contextlib
import math
from typing import Any

from trainguard.events import SEVERITY_RANK, ConfigError, Event
from trainguard.sinks.base import Sink

DEFAULT_ADDR = "127.0.0.1"  # this host only; "0.0.0.0" serves a scraper on another host


class PrometheusSink(Sink):
    """Serves `/metrics` on `addr`:`port` (0 picks a free one; see `.port`): gauges for loss,
    grad norm, LR, loss scale, step and steps per second; counters of incidents by kind, skips
    and rollbacks. Raises the OSError of an address that cannot be bound (a busy port), and a
    ConfigError without prometheus-client (the `prometheus` extra)."""

    def __init__(self, port: int, addr: str = DEFAULT_ADDR) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
        except ImportError:
            raise ConfigError(
                "Prometheus metrics (alerts.prometheus_port) need prometheus-client: "
                "pip install 'trainguard[prometheus]'"
            ) from None
        self.registry = CollectorRegistry()
        r = self.registry
        self.gauges = {
            "loss": Gauge("trainguard_loss", "Training loss at the last logged step.", registry=r),
            "grad_norm": Gauge(
                "trainguard_grad_norm", "Global gradient norm before clipping.", registry=r
            ),
            "lr": Gauge("trainguard_lr", "Learning rate of the first param group.", registry=r),
            "loss_scale": Gauge("trainguard_loss_scale", "GradScaler loss scale.", registry=r),
            "step": Gauge("trainguard_step", "The last logged step.", registry=r),
        }
        self.steps_per_second = Gauge(
            "trainguard_steps_per_second", "Steps per second between logged steps.", registry=r
        )
        self.evals = Gauge(
            "trainguard_eval", "The last value of each evaluation.", ["name"], registry=r
        )
        self.incidents = Counter(
            "trainguard_incidents", "Events at warning or above.", ["kind"], registry=r
        )
        self.skips = Counter("trainguard_skips", "Steps skipped by the guard.", registry=r)
        self.rollbacks = Counter("trainguard_rollbacks", "Rollbacks by the guard.", registry=r)
        self.server, self._thread = start_http_server(port, addr=addr, registry=r)
        self.addr = addr
        self.port = int(self.server.server_port)
        self._last: tuple[int, float] | None = None

    def on_metrics(self, record: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.set(float(value))
        step, elapsed = record.get("step"), record.get("elapsed_s")
        if isinstance(step, int) and isinstance(elapsed, (int, float)):
            if self._last is not None and elapsed > self._last[1] and step > self._last[0]:
                rate = (step - self._last[0]) / (elapsed - self._last[1])
                if math.isfinite(rate):
                    self.steps_per_second.set(rate)
            self._last = (step, float(elapsed))
        action = record.get("action")
        if action == "skip":
            self.skips.inc()
        elif action == "rollback":
            self.rollbacks.inc()

    def on_evaluation(self, record: dict[str, Any]) -> None:
        for name, value in (record.get("values") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.evals.labels(name=name).set(float(value))

    def on_event(self, event: Event) -> None:
        if SEVERITY_RANK[event.severity] >= SEVERITY_RANK["warning"]:
            self.incidents.labels(kind=event.kind).inc()

    def close(self) -> None:
        self.server.shutdown()
        with contextlib.suppress(OSError):
            self.server.server_close()
