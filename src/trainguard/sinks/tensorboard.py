"""`TensorBoardSink`: scalars, layer-group grad-norm histograms and incidents as text."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainguard.events import SEVERITY_RANK, Event, TrainguardError
from trainguard.sinks.base import Sink

SCALARS = ("loss", "grad_norm", "lr", "loss_scale", "update_ratio", "param_norm")


class TensorBoardSink(Sink):
    """Writes `train/<figure>` scalars, a `grad_norm/groups` histogram and one scalar per layer
    group, and each incident as `incidents` text, to TensorBoard event files in `log_dir`."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrainguardError(
                "the TensorBoard sink needs the tensorboard package: "
                "pip install 'trainguard[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(str(log_dir))

    def on_metrics(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        for key in SCALARS:
            value = record.get(key)
            if _finite_number(value):
                self.writer.add_scalar(f"train/{key}", float(value or 0.0), step)
        groups = record.get("group_grad_norms")
        if isinstance(groups, dict) and groups:
            values = [float(v) for v in groups.values() if isinstance(v, (int, float))]
            finite = [v for v in values if math.isfinite(v)]
            if finite:
                import numpy as np

                self.writer.add_histogram("grad_norm/groups", np.asarray(finite), step)
            for name, value in groups.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"grad_norm_group/{name}", float(value), step)

    def on_event(self, event: Event) -> None:
        if SEVERITY_RANK[event.severity] < SEVERITY_RANK["warning"]:
            return
        kind = event.kind + (f" ({event.type})" if event.type else "")
        text = f"**{event.severity}** {kind}: {event.message}"
        if event.action:
            text += f" -> {event.action}"
        self.writer.add_text("incidents", text, event.step)

    def close(self) -> None:
        self.writer.close()


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
