"""`TrainguardCallback` for Lightning 2.x: the guard decides every optimizer step, and its
state travels in Lightning's checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from trainguard.config import GuardConfig
from trainguard.events import TrainguardError, TrainingHalted
from trainguard.guard import Guard


class TrainguardCallback(pl.Callback):
    """Wraps the optimizer's step: Lightning's closure (forward, backward, its hooks) runs
    first, then the guard measures, judges and steps, skips or rolls back. Its detector and
    policy state is saved in Lightning checkpoints and restored on resume. With
    `take_over_clipping` the guard clips at the Trainer's `gradient_clip_val` (norm clipping)
    after measuring, and Lightning's clipping is turned off. A halt stops the fit; the
    diagnosis is in `halted`. The fit's planned steps (`max_steps`, or the estimated stepping
    batches) size the recovery unless `diagnosis.total_steps` is set."""

    def __init__(
        self,
        config: GuardConfig | None = None,
        run_dir: str | Path | None = None,
        take_over_clipping: bool = True,
    ) -> None:
        self.config = config or GuardConfig()
        self.run_dir = run_dir
        self.take_over_clipping = take_over_clipping
        self.guard: Guard | None = None
        self.halted: TrainingHalted | None = None
        self._restored: dict[str, Any] | None = None
        self._inside = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise TrainguardError("TrainguardCallback supports one optimizer")
        optimizer = trainer.optimizers[0]
        config = self.config
        if self.take_over_clipping:
            clip = trainer.gradient_clip_val
            config = config.model_copy(update={"max_grad_norm": float(clip) if clip else None})
            trainer.gradient_clip_val = None
        planned = _planned_steps(trainer)
        if config.diagnosis.total_steps is None and planned is not None:  # sizes the recovery
            diagnosis = config.diagnosis.model_copy(update={"total_steps": planned})
            config = config.model_copy(update={"diagnosis": diagnosis})
        run_dir = self.run_dir if self.run_dir is not None else Path(trainer.default_root_dir)
        Path(run_dir, "trainguard").mkdir(parents=True, exist_ok=True)
        if self.guard is not None:  # a fit that ended in an error left it open
            self.guard.close()
        self.guard = Guard(pl_module, optimizer, config=config, run_dir=Path(run_dir, "trainguard"))
        if self._restored is not None:
            self.guard.load_state_dict(self._restored)
            self._restored = None
        original = optimizer.step
        callback = self

        def guarded_step(closure: Any = None, **kwargs: Any) -> Any:
            if callback._inside:  # the guard's own call: the real step
                return original(**kwargs)
            loss = closure() if closure is not None else None
            if loss is None:
                return None  # training_step returned nothing: Lightning skips the step too
            callback._inside = True
            try:
                assert callback.guard is not None
                if callback.halted is None:
                    callback.guard.step(loss.detach())
            except TrainingHalted as exc:
                callback.halted = exc
                trainer.should_stop = True
            finally:
                callback._inside = False
            return loss

        setattr(optimizer, "step", guarded_step)  # noqa: B010 - the step, replaced on purpose

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict() if self.guard is not None else (self._restored or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.guard is not None:
            self.guard.load_state_dict(state_dict)
        else:
            self._restored = state_dict

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is not None and self.halted is None:
            self.guard.close()


def _planned_steps(trainer: pl.Trainer) -> int | None:
    """The optimizer steps the fit plans, when Lightning knows them (finite and positive)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    try:
        estimated = float(trainer.estimated_stepping_batches)
    except Exception:  # an iterable without a length, or a fit not yet set up
        return None
    return int(estimated) if estimated != float("inf") and estimated > 0 else None
