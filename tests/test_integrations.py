"""Integrations: the Hugging Face Trainer callback and Accelerate, on tiny random models with a
planted NaN and a planted toxic batch: the same outcomes as the plain loop."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.demo import MarkovCorpus

NAN_CALL, TOXIC_CALL = 30, 45  # forward calls (one per optimizer step here)


class Faults:
    """A forward hook (registered with kwargs) that makes the loss NaN on one batch and 20x on
    another; batches are counted by their input tensor, so a replay of a step's batch (the
    guard tracing a NaN) meets the same fault."""

    def __init__(self) -> None:
        self.calls = 0
        self.last: object = None

    def count(self, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        batch = kwargs.get("input_ids", args[0] if args else None)
        if batch is not self.last:
            self.calls += 1
            self.last = batch

    def __call__(
        self, module: nn.Module, args: tuple[object, ...], kwargs: dict, output: object
    ) -> object:
        if not module.training:
            return output
        self.count(args, kwargs)
        loss = output.loss  # type: ignore[attr-defined]
        if self.calls == NAN_CALL:
            output.loss = loss * float("nan")  # type: ignore[attr-defined]
        elif self.calls == TOXIC_CALL:
            output.loss = loss * 20.0  # type: ignore[attr-defined]
        return output


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def samples(n: int) -> list[dict[str, torch.Tensor]]:
    corpus = MarkovCorpus(vocab_size=64, length=50_000)
    out = []
    for batch in corpus.batches(1, 24, n, seed=3):
        ids = batch.x[0]
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def hf_train(tmp_path, model: nn.Module, callback, batches: int = 70, extra=(), **overrides):
    """A 70-step Trainer run on the CPU with the callback, over `batches` batches of data; its
    Trainer."""
    from transformers import Trainer, TrainingArguments

    settings = {
        "output_dir": str(tmp_path),
        "max_steps": 70,
        "per_device_train_batch_size": 8,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "logging_steps": 1000,
        **overrides,
    }
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**settings),
        train_dataset=samples(batches * 8),
        callbacks=[callback, *extra],
    )
    trainer.train()
    return trainer


def events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_hf_trainer_callback_skips_the_nan_and_the_toxic_step(tmp_path):
    from trainguard.integrations.hf import TrainguardCallback

    model = tiny_gpt2()
    model.register_forward_hook(Faults(), with_kwargs=True)
    callback = TrainguardCallback(tg.GuardConfig(console=False))
    trainer = hf_train(tmp_path, model, callback, learning_rate=3e-3, max_grad_norm=1.0, seed=0)
    args = trainer.args
    guard = callback.guard
    assert guard is not None and trainer.state.global_step == 70
    assert args.max_grad_norm == 0.0 and guard.config.max_grad_norm == 1.0  # taken over
    found = events(tmp_path / "trainguard" / "events.jsonl")
    nonfinite = [e for e in found if e["kind"] == "nonfinite"]
    spikes = [e for e in found if e["kind"] == "loss_spike"]
    assert [e["step"] for e in nonfinite] == [NAN_CALL - 1]
    assert [e["step"] for e in spikes] == [TOXIC_CALL - 1]
    assert nonfinite[0]["action"] == "skip" and spikes[0]["action"] == "skip"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    metrics = (tmp_path / "trainguard" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 70 and math.isfinite(json.loads(metrics[-1])["loss"])


WARMUP_LINT = ["the warmup lasts 20 steps, 0.50% of 4000: under 1%"]
"""What the lint says of a 20-step warmup from LR 0, in a run said to take 4000 steps."""


def warmup_findings(guard: tg.Guard | None) -> list[str]:
    assert guard is not None
    return [f.message for f in guard.findings if f.code in ("no-warmup", "short-warmup")]


def test_the_hf_callback_lints_the_trainers_schedule(tmp_path):
    """The lint traces the Trainer's scheduler from the LR it sets for step 0 (0, with
    `warmup_steps=20`): a 20-step warmup, not 'no warmup'."""
    from trainguard.integrations.hf import TrainguardCallback

    config = tg.GuardConfig(console=False, diagnosis={"total_steps": 4000})
    callback = TrainguardCallback(config)
    hf_train(
        tmp_path,
        tiny_gpt2(),
        callback,
        max_steps=3,
        warmup_steps=20,
        lr_scheduler_type="constant_with_warmup",
        learning_rate=1e-3,
    )
    assert warmup_findings(callback.guard) == WARMUP_LINT


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_the_lightning_callback_lints_the_fits_schedule(tmp_path, interval):
    """The lint traces the fit's configured scheduler from the LR it set for step 0, a step-
    interval one every step, an epoch-interval one every epoch of steps (5 here)."""
    from trainguard.integrations.lightning import TrainguardCallback

    every = 1 if interval == "step" else 5
    module = lightning_module(
        lr=1e-3, schedule=lambda s: min(1.0, s * every / 20), interval=interval
    )
    config = tg.GuardConfig(console=False, diagnosis={"total_steps": 4000})
    callback = TrainguardCallback(config)
    lightning_fit(module, tmp_path, 3, callback, batches=5)
    assert warmup_findings(callback.guard) == WARMUP_LINT


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_the_plain_guard_works_with_an_accelerate_prepared_model(tmp_path, precision):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerator per test
    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = accelerator.prepare(model, opt)
    model.register_forward_hook(Faults(), with_kwargs=True)
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False), run_dir=tmp_path)
    data = samples(70 * 8)
    for step in range(70):
        batch = data[step * 8 : (step + 1) * 8]
        ids = torch.stack([b["input_ids"] for b in batch])
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        guard.step(loss)
        opt.zero_grad()
    guard.close()
    found = events(tmp_path / "events.jsonl")
    assert [e["step"] for e in found if e["kind"] == "nonfinite"] == [NAN_CALL - 1]
    assert [e["step"] for e in found if e["kind"] == "loss_spike"] == [TOXIC_CALL - 1]
    assert guard.action_counts["skip"] == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def lightning_module(
    faults: Faults | None = None,
    lr: float = 3e-3,
    schedule: Callable[[int], float] | None = None,
    interval: str = "step",
):
    """A tiny GPT-2 LightningModule with AdamW at `lr`, the `faults` hook on its forward, and a
    LambdaLR of `schedule` stepped every `interval` when given."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()
            if faults is not None:
                self.model.register_forward_hook(faults, with_kwargs=True)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=lr)
            if schedule is None:
                return opt
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": scheduler, "interval": interval},
            }

    return Module()


def lightning_fit(
    module, tmp_path, steps: int, callback, ckpt_path=None, extra=(), batches=None, clip=1.0
):
    """A fit of `steps` steps over `batches` batches of data (default: `steps`)."""
    import lightning.pytorch as pl

    data = torch.stack([s["input_ids"] for s in samples((batches or steps) * 8)])
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=clip,
        default_root_dir=str(tmp_path),
        callbacks=[*extra, callback],
    )
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def test_the_lightning_callback_skips_the_nan_and_the_toxic_step(tmp_path):
    from trainguard.integrations.lightning import TrainguardCallback

    module = lightning_module(Faults())
    callback = TrainguardCallback(tg.GuardConfig(console=False))
    trainer = lightning_fit(module, tmp_path, 70, callback)
    assert trainer.global_step == 70 and trainer.gradient_clip_val is None
    assert callback.guard is not None and callback.guard.config.max_grad_norm == 1.0
    found = events(tmp_path / "trainguard" / "events.jsonl")
    assert [e["step"] for e in found if e["kind"] == "nonfinite"] == [NAN_CALL - 1]
    assert [e["step"] for e in found if e["kind"] == "loss_spike"] == [TOXIC_CALL - 1]
    assert callback.guard.action_counts["skip"] == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_the_lightning_callback_state_survives_a_checkpoint_and_resume(tmp_path):
    from trainguard.integrations.lightning import TrainguardCallback

    first = TrainguardCallback(tg.GuardConfig(console=False))
    trainer = lightning_fit(lightning_module(Faults()), tmp_path, 40, first)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    window = first.guard.detectors.state_dict()["loss_spike"]["window"]
    assert len(window) > 0 and first.guard.global_step == 40
    second = TrainguardCallback(tg.GuardConfig(console=False))
    lightning_fit(lightning_module(Faults()), tmp_path, 50, second, tmp_path / "last.ckpt")
    restored = second.guard
    assert restored is not None and restored.global_step == 50
    assert restored.action_counts["skip"] == 1  # the NaN before the checkpoint, carried over


def test_a_halt_stops_the_hf_trainer_with_the_diagnosis(tmp_path):
    from trainguard.integrations.hf import TrainguardCallback

    model = tiny_gpt2()
    model.register_forward_hook(Faults(), with_kwargs=True)
    config = tg.GuardConfig.from_dict({"console": False, "policy": {"halt_on": ["nonfinite"]}})
    callback = TrainguardCallback(config)
    trainer = hf_train(tmp_path, model, callback)
    assert callback.halted is not None and "halted the run at step 29" in str(callback.halted)
    assert trainer.state.global_step == NAN_CALL
    kinds = [e["kind"] for e in events(tmp_path / "trainguard" / "events.jsonl")]
    assert kinds[-2:] == ["halt", "run_closed"]


class Run(Faults):
    """A run of toxic batches: the loss 20x on batches 40 to 45."""

    def __call__(
        self, module: nn.Module, args: tuple[object, ...], kwargs: dict, output: object
    ) -> object:
        if module.training:
            self.count(args, kwargs)
            if 40 <= self.calls <= 45:
                output.loss = output.loss * 20.0  # type: ignore[attr-defined]
        return output


def test_the_hf_trainer_rolls_back_through_the_guard(tmp_path):
    from trainguard.integrations.hf import TrainguardCallback

    model = tiny_gpt2()
    model.register_forward_hook(Run(), with_kwargs=True)
    config = tg.GuardConfig.from_dict(
        {"console": False, "recovery": {"snapshot_every": 10, "rollback_margin": 2}}
    )
    callback = TrainguardCallback(config)
    trainer = hf_train(tmp_path, model, callback, learning_rate=3e-3)
    found = events(tmp_path / "trainguard" / "events.jsonl")
    rollbacks = [e for e in found if e["kind"] == "rollback"]
    assert rollbacks and all(r["metrics"]["to_step"] <= 38 for r in rollbacks)
    # a sudden jump: the first rollback undoes it with the LR kept; the repeat cuts it
    assert rollbacks[0]["metrics"]["lr_factor"] == 1.0
    assert len(rollbacks) > 1 and rollbacks[1]["metrics"]["lr_factor"] < 1
    # confirmed 2 steps after the jump (the Trainer's data cannot be rewound), the rollback finds
    # the 6-step fault still going on: a repeat within snapshot_every steps re-warms its cut
    assert all(r["metrics"]["rewarm_steps"] for r in rollbacks)
    assert all(r["metrics"]["lost_batches"] <= 12 for r in rollbacks)
    assert trainer.state.global_step == 70
    assert callback.guard.action_counts["rollback"] == len(rollbacks)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_hf_run_makes_up_the_steps_a_rollback_undid_with_its_schedule_put_back(tmp_path):
    """With data past max_steps, the steps a rollback undid are taken again: the guard ends at
    its 70 planned good steps, the Trainer at 70 plus those, and the replayed steps run at the
    LR they had (the schedule put back with the weights), so the linear schedule reaches 0
    after the last step, not before it."""
    from transformers import TrainerCallback

    from trainguard.integrations.hf import TrainguardCallback

    class Corrupt(TrainerCallback):  # a write of x1000 to a layer's weights before step 40
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 40:
                with torch.no_grad():
                    model.lm_head.weight.mul_(1000.0)  # tied to the embedding

    model = tiny_gpt2()
    config = tg.GuardConfig.from_dict({"console": False, "recovery": {"snapshot_every": 10}})
    callback = TrainguardCallback(config)
    trainer = hf_train(tmp_path, model, callback, 100, [Corrupt()], learning_rate=3e-3)
    found = events(tmp_path / "trainguard" / "events.jsonl")
    (rollback,) = [e for e in found if e["kind"] == "rollback"]
    lost = rollback["metrics"]["lost_batches"]
    assert callback.guard is not None and callback.guard.global_step == 70
    assert callback.lost_steps == lost and trainer.state.global_step == 70 + lost
    assert trainer.lr_scheduler.get_last_lr()[0] == 0.0  # the schedule ends at the last step
    rows = events(tmp_path / "trainguard" / "metrics.jsonl")
    assert rows[-1]["step"] == 69 and rows[-1]["lr"] > 0  # not run out before the last step
    to_step = rollback["metrics"]["to_step"]
    first, again = [r["lr"] for r in rows if r["step"] == to_step]
    assert again == first  # the LR kept (a sudden incident), the schedule put back to that step


def test_the_hf_callback_reads_lost_steps_back_on_resume_and_leaves_streams_alone(tmp_path):
    """Resumed from a checkpoint whose schedule is 4 steps behind the Trainer's count (4 steps
    lost before it), the callback makes those up too; over data without a length (which the
    Trainer starts over past max_steps) it raises nothing."""
    from transformers import TrainerControl, TrainerState, TrainingArguments, get_scheduler

    from trainguard.integrations.hf import TrainguardCallback

    def begin(loader: object, name: str) -> tuple[TrainguardCallback, TrainerState]:
        model = tiny_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=70)
        for _ in range(56):
            optimizer.step()
            scheduler.step()
        state = TrainerState(global_step=60, max_steps=70)
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
        callback = TrainguardCallback(tg.GuardConfig(console=False), run_dir=tmp_path / name)
        callback.on_train_begin(
            args,
            state,
            TrainerControl(),
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            train_dataloader=loader,
        )
        callback.on_optimizer_step(args, state, TrainerControl())
        return callback, state

    resumed, state = begin([0] * 100, "resumed")
    assert resumed.lost_steps == 4 and state.max_steps == 74
    streamed, state = begin(iter(range(100)), "streamed")
    assert state.max_steps == 70
    for callback in (resumed, streamed):
        callback.on_train_end(None, None, None)  # type: ignore[arg-type]


def test_a_lightning_fit_makes_up_the_steps_a_rollback_undid_with_its_schedule_put_back(
    tmp_path,
):
    """As in the HF callback: over data past max_steps, the fit runs the steps a rollback undid
    again, at the LR they had (the step-interval schedule put back with the weights), so the
    guard ends at its 70 planned good steps and the linear schedule reaches 0 at the last."""
    import lightning.pytorch as pl

    from trainguard.integrations.lightning import TrainguardCallback

    class Corrupt(pl.Callback):  # a write of x1000 to a layer's weights before step 40
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 40:
                with torch.no_grad():
                    pl_module.model.lm_head.weight.mul_(1000.0)  # tied to the embedding

    config = tg.GuardConfig.from_dict({"console": False, "recovery": {"snapshot_every": 10}})
    callback = TrainguardCallback(config)
    trainer = lightning_fit(
        lightning_module(schedule=lambda s: max(0.0, 1 - s / 70)),
        tmp_path,
        70,
        callback,
        extra=[Corrupt()],
        batches=100,
        clip=None,
    )
    found = events(tmp_path / "trainguard" / "events.jsonl")
    (rollback,) = [e for e in found if e["kind"] == "rollback"]
    lost = rollback["metrics"]["lost_batches"]
    assert lost > 0 and callback.lost_steps == lost
    assert callback.guard is not None and callback.guard.global_step == 70
    assert trainer.global_step == 70 + lost
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == 0.0
    rows = events(tmp_path / "trainguard" / "metrics.jsonl")
    assert rows[-1]["step"] == 69 and rows[-1]["lr"] > 0  # not run out before the last step
    first, again = [r["lr"] for r in rows if r["step"] == rollback["metrics"]["to_step"]]
    assert again == first  # the schedule put back to that step (the LR kept: a sudden write)
    saved = callback.state_dict()
    assert saved["lost_steps"] == lost and "detectors" in saved["guard"]
    resumed = TrainguardCallback(config)
    resumed.load_state_dict(saved)
    assert resumed._restored == saved  # loaded with the guard at the fit's start
    callback.guard.close()


def test_a_halt_stops_the_lightning_fit_with_the_diagnosis(tmp_path):
    from trainguard.integrations.lightning import TrainguardCallback

    config = tg.GuardConfig.from_dict({"console": False, "policy": {"halt_on": ["nonfinite"]}})
    callback = TrainguardCallback(config)
    trainer = lightning_fit(lightning_module(Faults()), tmp_path, 70, callback)
    assert callback.halted is not None and "halted the run at step 29" in str(callback.halted)
    assert trainer.global_step <= NAN_CALL
    kinds = [e["kind"] for e in events(tmp_path / "trainguard" / "events.jsonl")]
    assert kinds[-2:] == ["halt", "run_closed"]


class Burst:
    """The LR x100 on the Trainer's optimizer steps 50 to 54 (the inner optimizer's step is
    wrapped, so the guard's own step takes it), and a one-step false alarm: the loss 20x on
    forward call 23 of clean data."""

    def __init__(self) -> None:
        self.calls = 0
        self.step = 0

    def hook(self, module: nn.Module, inputs: object, output: object) -> object:
        if module.training:
            self.calls += 1
            if self.calls == 23:
                output.loss = output.loss * 20.0  # type: ignore[attr-defined]
        return output

    def callback(self):
        from transformers import TrainerCallback

        burst = self

        class Planted(TrainerCallback):
            def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
                inner = getattr(optimizer, "optimizer", optimizer)
                original = inner.step

                def step(*a, **k):
                    factor = 100.0 if 50 <= burst.step <= 54 else 1.0
                    for group in inner.param_groups:
                        group["lr"] *= factor
                    try:
                        return original(*a, **k)
                    finally:
                        for group in inner.param_groups:
                            group["lr"] /= factor

                inner.step = step

            def on_step_begin(self, args, state, control, **kwargs):
                burst.step = state.global_step

        return Planted()


def burst_run(tmp_path, guard_config: dict | None):
    """A 70-step Trainer run through the false alarm and the burst; the held-out loss and the
    guard's events (None unguarded)."""
    from transformers import Trainer, TrainingArguments

    from trainguard.integrations.hf import TrainguardCallback

    model = tiny_gpt2()
    burst = Burst()
    model.register_forward_hook(burst.hook)
    guard = None if guard_config is None else TrainguardCallback(tg.GuardConfig(**guard_config))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=70,
        per_device_train_batch_size=8,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1000,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        seed=0,
    )
    callbacks = [c for c in (guard, burst.callback()) if c is not None]  # the guard wraps first
    Trainer(model=model, args=args, train_dataset=samples(70 * 8), callbacks=callbacks).train()
    model.eval()
    with torch.no_grad():
        held = torch.stack([s["input_ids"] for s in samples(70 * 8 + 64)[-64:]])
        loss = float(model(input_ids=held, labels=held).loss)
    found = events(tmp_path / "trainguard" / "events.jsonl") if guard is not None else None
    return loss, found


def test_a_false_alarm_before_the_first_snapshot_leaves_the_hf_run_a_rollback_target(tmp_path):
    config = {"console": False, "recovery": {"snapshot_every": 50}}
    guarded, found = burst_run(tmp_path / "guarded", config)
    assert next(e["step"] for e in found if e["kind"] == "loss_spike") == 22  # a false alarm
    (rollback,) = [e for e in found if e["kind"] == "rollback"]
    assert rollback["metrics"]["to_step"] == 50  # the snapshot taken on schedule after it
    assert rollback["metrics"]["snapshot_after_warning"] == 22
    unguarded, _ = burst_run(tmp_path / "unguarded", None)
    assert guarded < unguarded


def test_an_hf_explosion_with_no_snapshot_before_it_says_so_and_cuts_the_lr(tmp_path):
    config = {"console": False, "recovery": {"snapshot_every": 60}}
    _, found = burst_run(tmp_path, config)
    kinds = [e["kind"] for e in found]
    assert "rollback" not in kinds and "rollback_unavailable" in kinds
    (unavailable,) = [e for e in found if e["kind"] == "rollback_unavailable"]
    assert 50 <= unavailable["metrics"]["incident_step"] <= 56
    assert any(e["kind"] == "lr_reduced" and e["step"] == unavailable["step"] for e in found)


class Poison:
    """A forward hook on one MLP that makes its output NaN while `on` (for one whole step)."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, module: nn.Module, inputs: object, output: torch.Tensor) -> torch.Tensor:
        return output * float("nan") if self.on else output


def nan_origins(path) -> list[dict]:
    return [e for e in events(path / "trainguard" / "events.jsonl") if e["kind"] == "nan_origin"]


def test_the_hf_callback_traces_a_nan_to_the_module_that_made_it(tmp_path):
    """The callback hands the guard a replay of the step's micro-batches: a NaN made inside
    transformer.h.1.mlp on step 30 is traced there, critical (it comes back on replay)."""
    from transformers import TrainerCallback

    from trainguard.integrations.hf import TrainguardCallback

    poison = Poison()

    class During(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            poison.on = state.global_step == 30

        def on_step_end(self, args, state, control, **kwargs):
            poison.on = False

    model = tiny_gpt2()
    model.transformer.h[1].mlp.register_forward_hook(poison)
    callback = TrainguardCallback(tg.GuardConfig(console=False))
    hf_train(tmp_path, model, callback, 70, [During()], learning_rate=3e-3, seed=0)
    (origin,) = nan_origins(tmp_path)
    assert origin["step"] == 30 and origin["severity"] == "critical"
    assert "transformer.h.1.mlp" in origin["message"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_lightning_callback_traces_a_nan_to_the_module_that_made_it(tmp_path):
    import lightning.pytorch as pl

    from trainguard.integrations.lightning import TrainguardCallback

    poison = Poison()

    class During(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            poison.on = batch_idx == 30

    module = lightning_module(lambda module, args, kwargs, output: output)  # no other fault
    module.model.transformer.h[1].mlp.register_forward_hook(poison)
    callback = TrainguardCallback(tg.GuardConfig(console=False))
    lightning_fit(module, tmp_path, 70, callback, extra=[During()], clip=None)
    (origin,) = nan_origins(tmp_path)
    assert origin["step"] == 30 and origin["severity"] == "critical"
    assert "transformer.h.1.mlp" in origin["message"]
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_the_hf_callback_feeds_each_evaluation_as_trainer_state_keeps_it(tmp_path):
    from transformers import Trainer, TrainingArguments

    from trainguard.analysis.logs import read_log
    from trainguard.integrations.hf import TrainguardCallback

    callback = TrainguardCallback(tg.GuardConfig(console=False))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=20,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        eval_strategy="steps",
        eval_steps=5,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=tiny_gpt2(),
        args=args,
        train_dataset=samples(160),
        eval_dataset=samples(16),
        callbacks=[callback],
    )
    trainer.train()
    fed = events(tmp_path / "trainguard" / "evals.jsonl")
    assert [r["step"] for r in fed] == [5, 10, 15, 20]
    assert all(set(r["values"]) == {"eval_loss"} for r in fed)  # not runtime, throughput
    trainer.state.save_to_json(str(tmp_path / "trainer_state.json"))
    logged = read_log(tmp_path / "trainer_state.json").evaluations["eval_loss"]
    assert logged[0].tolist() == [5, 10, 15, 20]
    assert logged[1].tolist() == pytest.approx([r["values"]["eval_loss"] for r in fed])


@pytest.mark.parametrize(
    "cadence",
    [
        {"max_steps": 20, "val_check_interval": 5},  # within the epoch
        {"max_epochs": 4, "limit_train_batches": 5},  # at each epoch's end
    ],
)
def test_the_lightning_callback_feeds_each_validation_as_the_csv_logger_keeps_it(tmp_path, cadence):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from trainguard.analysis.logs import read_log
    from trainguard.integrations.lightning import TrainguardCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.stack([s["input_ids"] for s in samples(160)])
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
    callback = TrainguardCallback(tg.GuardConfig(console=False))
    trainer = pl.Trainer(
        **cadence,
        limit_val_batches=2,
        accelerator="cpu",
        logger=CSVLogger(str(tmp_path), name="csv", version=0),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[callback],
    )
    trainer.fit(Module(), loader, loader)
    fed = events(tmp_path / "trainguard" / "evals.jsonl")
    assert len(fed) == 4  # every 5 steps; not the sanity check before training
    assert all(set(r["values"]) == {"val_loss"} for r in fed)
    logged = read_log(tmp_path / "csv" / "version_0" / "metrics.csv").evaluations["val_loss"]
    assert logged[0].tolist() == [r["step"] for r in fed]
    assert logged[1].tolist() == pytest.approx([r["values"]["val_loss"] for r in fed], rel=1e-6)
