"""`Guard`: one call per optimizer step that measures, detects, decides and acts."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainguard.actions import OptimizerActions
from trainguard.config import GuardConfig
from trainguard.detectors import DetectorSuite, MetricPoint
from trainguard.events import Decision, Event, TrainguardError, TrainingHalted, _json_number
from trainguard.policy import StepPolicy
from trainguard.signals import GradientStats, StepSignals
from trainguard.sinks import ConsoleSink, EventLog, MetricsLog, Sink

MAX_BATCH_IDS = 64


class Guard:
    """Watches every step of a training loop and steps, skips or halts it.

    `step(loss)` replaces `clip_grad_norm_` + `optimizer.step()` + `scheduler.step()`;
    `observe(step, loss=...)` only watches numbers, for logging-only use and offline analysis.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        config: GuardConfig | None = None,
        run_dir: str | Path | None = None,
        sinks: Sequence[Sink] = (),
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TrainguardError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TrainguardError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.config = config if config is not None else GuardConfig()
        self.model = model
        self.optimizer = optimizer
        self.detectors = DetectorSuite(self.config)
        self.policy = StepPolicy(self.config.policy)
        self.stats: GradientStats | None = None
        self.actions: OptimizerActions | None = None
        if optimizer is not None:
            self.stats = GradientStats(
                model, optimizer, self.config.group_patterns, self.config.stats_every
            )
            self.actions = OptimizerActions(optimizer, scheduler, scaler, self.config.max_grad_norm)
        self.scaler = scaler
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.sinks: list[Sink] = []
        if self.run_dir is not None:
            self.sinks += [
                EventLog(self.run_dir / "events.jsonl"),
                MetricsLog(self.run_dir / "metrics.jsonl"),
            ]
            (self.run_dir / "config.json").write_text(self.config.to_json() + "\n")
        if self.config.console:
            self.sinks.append(ConsoleSink())
        self.sinks.extend(sinks)
        self.global_step = 0
        self.event_counts: dict[str, int] = {}
        self.action_counts: dict[str, int] = {"step": 0, "skip": 0, "halt": 0}
        self._started = time.perf_counter()
        self._last_step_time: float | None = None
        self._closed = False

    # -- the training loop ------------------------------------------------------------------
    def step(self, loss: torch.Tensor | float, batch_ids: Iterable[Any] | None = None) -> Decision:
        """Measure this step's gradients after `loss.backward()`, run the detectors, and step,
        skip or halt (raising `TrainingHalted`); with a GradScaler pass the unscaled loss."""
        if self.stats is None or self.actions is None or self.optimizer is None:
            raise TrainguardError(
                "guard.step needs an optimizer: build Guard(model, optimizer, ...), "
                "or use guard.observe(step, loss=...) to only watch numbers"
            )
        step = self.global_step
        self.actions.unscale()
        measurement = self.stats.measure(loss, self.optimizer, self.scaler)
        self.actions.clip(measurement.grads, measurement.total_norm)
        signals = self.stats.resolve(measurement)
        point = _point_from_signals(step, signals)
        decision = self._decide(point, batch_ids)
        if decision.action == "step":
            self.stats.before_optimizer_step(step)
            self.actions.step(signals.loss)
            self.stats.after_optimizer_step(step)
        else:
            self.stats.discard_update()
            self.actions.skip()
        self._record(point, decision, signals)
        self.global_step += 1
        if decision.action == "halt":
            self._halt(decision, raise_error=True)
        return decision

    def observe(
        self,
        step: int,
        loss: float,
        grad_norm: float | None = None,
        lr: float | None = None,
        loss_scale: float | None = None,
        group_grad_norms: dict[str, float] | None = None,
        batch_ids: Iterable[Any] | None = None,
    ) -> Decision:
        """Feed the detectors from plain numbers without touching a model.

        The decision is advisory: nothing is stepped or skipped, and a halt is logged and
        returned, not raised.
        """
        point = MetricPoint(
            step=int(step),
            loss=float(loss),
            grad_norm=None if grad_norm is None else float(grad_norm),
            lr=None if lr is None else float(lr),
            loss_scale=None if loss_scale is None else float(loss_scale),
            group_grad_norms=group_grad_norms,
        )
        decision = self._decide(point, batch_ids)
        self._record(point, decision, None)
        self.global_step = point.step + 1
        if decision.action == "halt":
            self._halt(decision, raise_error=False)
        return decision

    # -- internals ----------------------------------------------------------------------------
    def _decide(self, point: MetricPoint, batch_ids: Iterable[Any] | None) -> Decision:
        events = self.detectors.update(point)
        decision = self.policy.decide(point, events)
        if batch_ids is not None:
            ids = list(batch_ids)
            shown: list[Any] = [_plain(i) for i in ids[:MAX_BATCH_IDS]]
            for event in events:
                event.metrics["batch_ids"] = shown
                if len(ids) > MAX_BATCH_IDS:
                    event.metrics["batch_ids_total"] = len(ids)
        for event in events:
            self.event_counts[event.kind] = self.event_counts.get(event.kind, 0) + 1
            for sink in self.sinks:
                sink.on_event(event)
        self.action_counts[decision.action] += 1
        return decision

    def _record(self, point: MetricPoint, decision: Decision, signals: StepSignals | None) -> None:
        now = time.perf_counter()
        record: dict[str, Any] = {
            "step": point.step,
            "elapsed_s": round(now - self._started, 6),
            "step_time_s": (
                None if self._last_step_time is None else round(now - self._last_step_time, 6)
            ),
            "loss": point.loss,
            "grad_norm": point.grad_norm,
            "lr": point.lr,
            "loss_scale": point.loss_scale,
            "action": decision.action,
        }
        self._last_step_time = now
        if signals is not None:
            if len(signals.lrs) > 1:
                record["lrs"] = signals.lrs
            record["overflow"] = signals.overflow
            record["nonfinite_grads"] = signals.nonfinite_grads
            record["group_grad_norms"] = signals.group_grad_norms
            if signals.update_step is not None:
                record["param_norm"] = signals.param_norm
                record["update_norm"] = signals.update_norm
                record["update_ratio"] = signals.update_ratio
                record["update_step"] = signals.update_step
                record["group_update_ratios"] = signals.group_update_ratios
        elif point.group_grad_norms:
            record["group_grad_norms"] = point.group_grad_norms
        if decision.events:
            record["events"] = [e.kind for e in decision.events]
        record = _json_number(record)
        decision.metrics = record
        if point.step % self.config.log_every == 0 or decision.events:
            for sink in self.sinks:
                sink.on_metrics(record)

    def _halt(self, decision: Decision, raise_error: bool) -> None:
        diagnosis = f"trainguard halted the run at step {decision.step}: {decision.reason}"
        event = Event(
            step=decision.step,
            kind="halt",
            severity="critical",
            message=diagnosis,
            metrics={"events": [e.kind for e in decision.events]},
            action="halt",
        )
        decision.events.append(event)
        self.event_counts["halt"] = self.event_counts.get("halt", 0) + 1
        for sink in self.sinks:
            sink.on_event(event)
        if raise_error:
            self.close()
            raise TrainingHalted(diagnosis, decision)

    # -- state and lifetime -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Detector and policy state with the step counter: plain data, safe to checkpoint."""
        return {
            "global_step": self.global_step,
            "detectors": self.detectors.state_dict(),
            "policy": self.policy.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.detectors.load_state_dict(state["detectors"])
        self.policy.load_state_dict(state["policy"])

    def close(self) -> None:
        """Flush and close every sink; the guard stays usable for `state_dict`."""
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _point_from_signals(step: int, s: StepSignals) -> MetricPoint:
    return MetricPoint(
        step=step,
        loss=s.loss,
        grad_norm=s.grad_norm,
        lr=s.lrs[0] if s.lrs else None,
        loss_scale=s.loss_scale,
        overflow=s.overflow,
        nonfinite_grads=s.nonfinite_grads,
        nonfinite_params=s.nonfinite_params,
        group_grad_norms=s.group_grad_norms,
        update_ratio=s.update_ratio,
    )


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() != 1 else value.item()
    if isinstance(value, (int, str, bool)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)
