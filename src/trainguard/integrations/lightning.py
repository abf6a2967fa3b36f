"""`TrainguardCallback` for Lightning 2.x: the guard decides every optimizer step, and its
state travels in Lightning's checkpoints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from trainguard._torch_private import mark_optimizer_stepped, mark_step_wrapped
from trainguard.config import ConfigInput, GuardConfig
from trainguard.events import TrainguardError, TrainingHalted
from trainguard.guard import Guard
from trainguard.integrations.evaluations import evaluation_results
from trainguard.integrations.schedules import PerStepSchedule, ScheduleHistory
from trainguard.run_files import make_folder


class TrainguardCallback(pl.Callback):
    """Wraps the optimizer's step: Lightning's closure (forward, backward, its hooks) runs
    first, then the guard measures, judges and steps, skips or rolls back. Its detector and
    policy state is saved in Lightning checkpoints and restored on resume. With
    `take_over_clipping` the guard clips at the Trainer's `gradient_clip_val` (norm clipping)
    after measuring, and Lightning's clipping is turned off. A halt stops the fit; the
    diagnosis is in `halted`. The fit's planned steps (`max_steps`, or the estimated stepping
    batches) size the recovery unless `diagnosis.total_steps` is set.

    A rollback's lost steps are made up, as in the HF callback: the step-interval LR schedulers
    are put back with the weights, and a fit bounded by `max_steps` over data with a length
    runs that many steps longer (the fit loop's step limit is raised; Lightning has no public
    setter for it, so where the loop lacks it the steps stay lost and `lost_steps` says how
    many). The validation metrics logged (`val*`) are fed to `guard.evaluate` after each
    validation, which watches them for forgetting (`eval_decline`)."""

    def __init__(
        self,
        config: ConfigInput = None,
        run_dir: str | Path | None = None,
        take_over_clipping: bool = True,
    ) -> None:
        self.config = GuardConfig.of(config)
        self.run_dir = run_dir
        self.take_over_clipping = take_over_clipping
        self.guard: Guard | None = None
        self.halted: TrainingHalted | None = None
        self._restored: dict[str, Any] | None = None
        self._inside = False
        self._schedules = ScheduleHistory([])
        self._planned: int | None = None  # max_steps at the start, where it can be raised
        self.lost_steps = 0  # steps undone by rollbacks, made up for at the end
        self._batch: tuple[Any, int] | None = None  # this step's batch, to replay a NaN step

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
        make_folder(Path(run_dir, "trainguard"))  # trainguard's own: never a link followed
        if self.guard is not None:  # a fit that ended in an error left it open
            self.guard.close()
        self.guard = Guard(
            pl_module,
            optimizer,
            config=config,
            run_dir=Path(run_dir, "trainguard"),
            lint_scheduler=_lint_schedule(trainer),  # the fit steps its schedulers, not the guard
        )
        if self._restored is not None:
            self._load(self._restored)
            self._restored = None
        self._schedules = ScheduleHistory(
            [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"]
        )
        self._schedules.keep(self.guard)
        # only data with a length is taken on past max_steps: a stream would start over
        sized = trainer.num_training_batches != float("inf")
        limited = trainer.max_steps is not None and trainer.max_steps > 0
        self._planned = int(trainer.max_steps) if limited and sized else None
        self._make_up(trainer)
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
                    callback._step(trainer, pl_module, loss.detach())
            except TrainingHalted as exc:
                callback.halted = exc
                trainer.should_stop = True
            finally:
                callback._inside = False
            mark_optimizer_stepped(optimizer)  # torch's LR scheduler asks
            return loss

        # torch's LR scheduler checks that optimizer.step is still its counting wrapper: it is
        # replaced on purpose, and the real step is taken inside the guard
        mark_step_wrapped(guarded_step)
        setattr(optimizer, "step", guarded_step)  # noqa: B010 - the step, replaced on purpose

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch = (batch, batch_idx)

    def _step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        """The guard's step (it may replay the batch's training_step to trace a NaN's origin);
        after a rollback, the schedule goes back and the fit grows by the steps lost."""
        assert self.guard is not None
        before = self.guard.global_step
        batch = self._batch

        def replay() -> Any:
            assert batch is not None
            with trainer.precision_plugin.train_step_context():
                out = pl_module.training_step(batch[0], batch[1])
            return out["loss"] if isinstance(out, dict) else out

        self.guard.step(loss, replay=replay if batch is not None else None)
        lost = self._schedules.follow(self.guard, before)
        if lost:
            self.lost_steps += lost
            self._make_up(trainer)

    def _make_up(self, trainer: pl.Trainer) -> None:
        """Raise the fit's step limit by the steps lost, where the fit is bounded by max_steps
        over data with a length. Lightning offers no public setter: the fit loop's epoch loop
        holds the limit that `trainer.max_steps` reads."""
        if self._planned is None or not self.lost_steps:
            return
        epoch_loop = getattr(trainer.fit_loop, "epoch_loop", None)
        if isinstance(getattr(epoch_loop, "max_steps", None), int):
            epoch_loop.max_steps = self._planned + self.lost_steps  # type: ignore[union-attr]

    def state_dict(self) -> dict[str, Any]:
        if self.guard is None:
            return self._restored or {}
        return {"guard": self.guard.state_dict(), "lost_steps": self.lost_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.guard is not None:
            self._load(state_dict)
        else:
            self._restored = state_dict

    def _load(self, state: dict[str, Any]) -> None:
        """A checkpoint's guard state and lost steps (a checkpoint from before lost steps were
        kept holds the guard's state alone)."""
        assert self.guard is not None
        if "guard" in state and "lost_steps" in state:
            self.guard.load_state_dict(state["guard"])
            self.lost_steps = int(state["lost_steps"])
        else:
            self.guard.load_state_dict(state)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The validation metrics logged (`val_loss`, `val_acc`, ...) go to `guard.evaluate`
        at the step and under the names a CSVLogger's metrics.csv gives them; the sanity check
        before training is not an evaluation of the trained model."""
        if self.guard is None or self.halted is not None or trainer.sanity_checking:
            return
        values = evaluation_results(dict(trainer.callback_metrics))
        if values:  # at the step of the last training row: Lightning's loggers count from 0
            self.guard.evaluate(max(trainer.global_step - 1, 0), values)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is not None and self.halted is None:
            self.guard.close()


def _lint_schedule(trainer: pl.Trainer) -> PerStepSchedule | None:
    """The fit's LR schedulers (ReduceLROnPlateau aside), configured by now, each stepped every
    `frequency` optimizer steps or epochs (an epoch's steps where its batches are counted)."""
    batches = trainer.num_training_batches
    per_epoch = (
        math.ceil(batches / trainer.accumulate_grad_batches) if batches != float("inf") else None
    )
    cadence = []
    for config in trainer.lr_scheduler_configs:
        if config.reduce_on_plateau:
            continue
        if config.interval == "step":
            cadence.append((config.scheduler, config.frequency))
        elif per_epoch:
            cadence.append((config.scheduler, config.frequency * per_epoch))
    return PerStepSchedule(cadence) if cadence else None


def _planned_steps(trainer: pl.Trainer) -> int | None:
    """The optimizer steps the fit plans, when Lightning knows them (finite and positive)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    try:
        estimated = float(trainer.estimated_stepping_batches)
    except Exception:  # an iterable without a length, or a fit not yet set up
        return None
    return int(estimated) if estimated != float("inf") and estimated > 0 else None
