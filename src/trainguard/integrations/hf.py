"""`TrainguardCallback` for the Hugging Face `Trainer`: the guard decides every optimizer step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import has_length

from trainguard._torch_private import mark_optimizer_stepped, mark_step_wrapped
from trainguard.config import ConfigInput, GuardConfig
from trainguard.events import TrainguardError, TrainingHalted
from trainguard.guard import Guard
from trainguard.integrations.evaluations import evaluation_results
from trainguard.integrations.schedules import ScheduleHistory
from trainguard.run_files import make_folder


class TrainguardCallback(TrainerCallback):
    """Puts a `Guard` between the Trainer and its optimizer: each optimizer step is measured,
    judged and taken, skipped (non-finite gradients, spikes) or rolled back (model and
    optimizer state; the Trainer's data order goes on), with `events.jsonl` and
    `metrics.jsonl` in `run_dir` (default `<output_dir>/trainguard`); a halt stops training
    with the diagnosis in `halted`.

    Clipping: with `take_over_clipping` (the default) the guard clips at the Trainer's
    `max_grad_norm` and the Trainer's own clipping is turned off, so the guard sees the
    gradient norm before clipping; otherwise the Trainer clips first and the guard only
    watches the clipped norm. The Trainer's planned steps (`max_steps`) size the recovery
    (snapshot interval) unless `diagnosis.total_steps` is set.

    A rollback's lost steps are made up: the LR schedule is put back to the step the guard
    rolled back to (from the scheduler's `state_dict`, kept each step), and the Trainer's
    `max_steps` grows by the steps lost, so the run still takes its planned number of good
    steps as far as its data reaches (a run bounded by epochs ends with its data; data without
    a length, which the Trainer would start over, is not extended). A skipped step counts as a
    step, as in the plain loop. On resume from a checkpoint the steps lost before it are read
    back from the schedule, which is that many steps behind the Trainer's count. Each
    evaluation's results (`eval_*`) are fed to `guard.evaluate`, which watches them for
    forgetting (`eval_decline`).

    A Trainer given a DeepSpeed config (`TrainingArguments(deepspeed=...)`, ZeRO 1-3) is
    guarded by a `DeepSpeedGuard` on its engine: the engine's `step()`, which Accelerate calls
    at each accumulation boundary, goes through the guard; the engine clips."""

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
        self._losses: list[torch.Tensor] = []
        self._model: torch.nn.Module | None = None
        # each micro-batch's forward inputs of this optimizer step, to replay a NaN step
        self._inputs: list[tuple[Any, dict[str, Any]]] = []
        self._replaying = False
        self._hook: Any = None
        self._scheduler: Any = None
        self._schedules = ScheduleHistory([])
        self._planned: int | None = None  # the Trainer's max_steps at the start, if extensible
        self.lost_steps = 0  # steps undone by rollbacks, made up for at the end
        self._engine: Any = None  # the DeepSpeed engine when the Trainer runs DeepSpeed

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if model is None or optimizer is None:
            raise TrainguardError("TrainguardCallback needs the Trainer's model and optimizer")
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps the optimizer
        self._engine = _deepspeed_engine(args, inner)
        config = self.config
        if self.take_over_clipping and self._engine is None:  # under DeepSpeed the engine clips
            norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
            config = config.model_copy(update={"max_grad_norm": norm})
            args.max_grad_norm = 0.0  # the guard clips, after measuring
        planned = state.max_steps if state.max_steps and state.max_steps > 0 else None
        if config.diagnosis.total_steps is None and planned is not None:  # sizes the recovery
            diagnosis = config.diagnosis.model_copy(update={"total_steps": int(planned)})
            config = config.model_copy(update={"diagnosis": diagnosis})
        run_dir = (
            self.run_dir if self.run_dir is not None else Path(args.output_dir or ".", "trainguard")
        )
        if self.run_dir is None:  # trainguard's own folder in output_dir: never a link followed
            make_folder(Path(run_dir))
        else:  # the user's choice, a link or not
            Path(run_dir).mkdir(parents=True, exist_ok=True)
        if self.guard is not None:  # a fit that ended in an error left it open
            self.guard.close()
        self._scheduler = kwargs.get("lr_scheduler")
        schedule = getattr(self._scheduler, "scheduler", None)  # inside Accelerate's wrapper
        if not isinstance(schedule, torch.optim.lr_scheduler.LRScheduler):
            schedule = self._scheduler
        if self._engine is not None:
            from trainguard.integrations.deepspeed import DeepSpeedGuard

            self.guard = DeepSpeedGuard(self._engine, config=config, run_dir=run_dir)
        else:  # the lint traces the schedule the Trainer steps (the guard does not step it)
            self.guard = Guard(
                model, inner, config=config, run_dir=run_dir, lint_scheduler=schedule
            )
        self._model = model
        self._hook = model.register_forward_hook(self._capture, with_kwargs=True)
        # only data with a length is taken on past max_steps: a stream would start over
        loader = kwargs.get("train_dataloader")
        sized = loader is not None and has_length(loader)
        self._planned = int(planned) if planned is not None and sized else None
        last = getattr(self._scheduler, "last_epoch", None)
        counts = isinstance(self._scheduler, torch.optim.lr_scheduler.LRScheduler)
        # resumed: the checkpoint's schedule is behind the Trainer's count by the steps lost
        behind = state.global_step - last if counts and isinstance(last, int) else 0
        self.lost_steps = max(0, behind)
        self._schedules = ScheduleHistory([] if self._scheduler is None else [self._scheduler])
        self._schedules.keep(self.guard)
        callback = self

        def guarded_step(*step_args: Any, **step_kwargs: Any) -> None:
            callback._step()
            for opt in (optimizer, inner):  # what torch's LR scheduler checks was stepped
                mark_optimizer_stepped(opt)

        if self._engine is not None:
            # under DeepSpeed, Accelerate's backward calls engine.step() at each accumulation
            # boundary (the optimizer's step is a no-op): the guard takes that call, and steps
            # the engine itself (through the engine's class, past this instance attribute)
            self._engine.step = lambda *a, **k: callback._step()
            return
        # torch's LR scheduler checks that optimizer.step is still its counting wrapper: it is
        # replaced on purpose, and the real step is taken inside the guard
        mark_step_wrapped(guarded_step)
        optimizer.step = guarded_step  # the Trainer calls this once per optimizer step

    def _capture(
        self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any
    ) -> None:
        if not module.training or self._replaying:
            return
        self._inputs.append((args, kwargs))
        loss = _loss_of(output)
        if loss is not None and loss.numel() == 1:
            self._losses.append(loss.detach())

    def _step(self) -> None:
        assert self.guard is not None
        if self.halted is not None:
            return
        if not self._losses:
            raise TrainguardError(
                "TrainguardCallback saw no loss: the model's forward must return one "
                "(an output with .loss, as Hugging Face models do when given labels)"
            )
        loss = torch.stack(self._losses).mean()  # the micro-batches of this optimizer step
        self._losses = []
        inputs, self._inputs = self._inputs, []
        before = self.guard.global_step
        try:
            if self._engine is not None:  # DeepSpeed: no replay of a partitioned model's step
                self.guard.step(loss)
            else:
                self.guard.step(loss, replay=lambda: self._replay(inputs))
        except TrainingHalted as exc:
            self.halted = exc
            return
        self.lost_steps += self._schedules.follow(self.guard, before)

    def _replay(self, inputs: list[tuple[Any, dict[str, Any]]]) -> torch.Tensor:
        """This optimizer step's micro-batches run again (the guard traces a NaN's origin with
        it): the mean of their losses."""
        assert self._model is not None
        self._replaying = True
        try:
            losses = [_loss_of(self._model(*args, **kwargs)) for args, kwargs in inputs]
        finally:
            self._replaying = False
        if any(loss is None for loss in losses):
            raise TrainguardError("the replayed forward returned no loss")
        return torch.stack([loss for loss in losses if loss is not None]).mean()

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.halted is not None:
            control.should_training_stop = True
        elif self._planned is not None:  # the Trainer stops at max_steps: the lost ones made up
            state.max_steps = self._planned + self.lost_steps

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """The Trainer's evaluation results (`eval_loss`, `eval_accuracy`, ...; not its runtime
        or throughput) go to `guard.evaluate` at the Trainer's step, under the names its
        trainer_state.json keeps, so that `trainguard analyze` of that file judges the same."""
        if self.guard is None or self.halted is not None or not metrics:
            return
        values = evaluation_results(metrics)
        if values:
            self.guard.evaluate(state.global_step, values)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._engine is not None and "step" in vars(self._engine):
            del self._engine.step  # the engine's own step again
        if self.guard is not None and self.halted is None:
            self.guard.close()


def _deepspeed_engine(args: TrainingArguments, optimizer: Any) -> Any:
    """The DeepSpeed engine the Trainer runs (`deepspeed` in its arguments), else None."""
    if not getattr(args, "deepspeed", None):
        return None
    from trainguard.integrations import _deepspeed_private as private

    engine = private.engine_of(optimizer)
    if engine is None:
        raise TrainguardError(
            "the Trainer runs DeepSpeed but its engine was not found from the optimizer: "
            "use trainguard.integrations.deepspeed.DeepSpeedGuard in your own loop"
        )
    return engine


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss a Hugging Face model's forward returned (given labels); None without one."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None
