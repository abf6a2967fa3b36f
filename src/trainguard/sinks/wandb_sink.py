"""`WandbSink`: the run's figures and incidents in Weights & Biases (an optional extra)."""

from __future__ import annotations

import math
from typing import Any, Literal

from trainguard.events import SEVERITY_RANK, Event, TrainguardError
from trainguard.sinks.base import Sink

SCALARS = ("loss", "grad_norm", "lr", "loss_scale", "update_ratio", "param_norm")


class WandbSink(Sink):
    """Logs `train/<figure>` and per-group grad norms each logged step, counts incidents by kind
    (`incidents/<kind>`, also in the run summary) and records each one in an `incidents` table.
    `mode="offline"` writes locally for a later `wandb sync`."""

    def __init__(
        self,
        project: str = "trainguard",
        mode: Literal["online", "offline", "disabled"] = "online",
        directory: str | None = None,
        config: dict[str, Any] | None = None,
        **init: Any,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise TrainguardError(
                "the W&B sink needs the wandb package: pip install 'trainguard[wandb]'"
            ) from None
        self.wandb = wandb
        self.run = wandb.init(project=project, mode=mode, dir=directory, config=config, **init)
        self.counts: dict[str, int] = {}
        self.rows: list[list[Any]] = []

    def on_metrics(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        data: dict[str, float] = {}
        for key in SCALARS:
            value = record.get(key)
            if _finite_number(value):
                data[f"train/{key}"] = float(value or 0.0)
        for name, value in (record.get("group_grad_norms") or {}).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                data[f"grad_norm_group/{name}"] = float(value)
        if data:
            self.run.log(data, step=step)

    def on_event(self, event: Event) -> None:
        if SEVERITY_RANK[event.severity] < SEVERITY_RANK["warning"]:
            return
        self.counts[event.kind] = self.counts.get(event.kind, 0) + 1
        self.run.summary[f"incidents/{event.kind}"] = self.counts[event.kind]
        self.rows.append(
            [event.step, event.kind, event.type or "", event.severity, event.message, event.action]
        )

    def close(self) -> None:
        if self.rows:
            columns: list[str | int] = ["step", "kind", "type", "severity", "message", "action"]
            self.run.log({"incidents": self.wandb.Table(columns=columns, data=self.rows)})
        self.run.summary["incidents/total"] = sum(self.counts.values())
        self.run.finish()


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
