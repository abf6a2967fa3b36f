"""Planted-fault training runs of TinyGPT or RecurrentLM, guarded or not: the harness behind the
demo and the recovery tests and benchmarks. Faults sit in the data (by position) or in time (by
iteration)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import trainguard as tg
from trainguard.demo.data import Batch, MarkovCorpus, TextCorpus, corrupted
from trainguard.demo.model import Block, RecurrentLM, TinyGPT

LR = 3e-3
FAMILIES: dict[str, type[TinyGPT] | type[RecurrentLM]] = {
    "TinyGPT": TinyGPT,
    "RecurrentLM": RecurrentLM,
}


@dataclass(frozen=True)
class Fault:
    """What goes wrong: `toxic`, `nan_batch` and `shard` by data position, the rest by loop
    iteration."""

    name: str = "clean"
    toxic: tuple[int, ...] = ()
    blowup: tuple[int, ...] = ()  # iterations whose update lands at 100x the LR
    corrupt_at: int | None = None  # iteration at which the LM head's weights become 1000x
    log0_at: int | None = None  # iteration at which a module adds log(0) = -inf to its output
    persistent_from: int | None = None  # iteration from which ever-growing logit noise is added
    overflow: tuple[int, ...] = ()  # iterations whose gradients overflow to Inf (as in fp16)
    moments_lost_at: int | None = None  # iteration at which Adam's second moments are zeroed
    nan_batch: int | None = None  # a batch whose inputs are NaN
    shard: tuple[int, ...] = ()  # batches of a shard that decays into noise (5% to 100%)


# The bursts of bad data end 30 steps before the end of a 400-step run, so the run has no time to
# outgrow them; placed at mid-run, an unguarded small model outgrows them (see MIDRUN).
FAULTS = {
    "clean": Fault(),
    "toxic batch": Fault("toxic batch", toxic=(180,)),
    "LR x100 for 10 steps": Fault("LR x100 for 10 steps", blowup=tuple(range(250, 260))),
    "20 toxic batches": Fault("20 toxic batches", toxic=tuple(range(350, 370))),
    "corrupted weights": Fault("corrupted weights", corrupt_at=260),
    "log(0) in a module": Fault("log(0) in a module", log0_at=220),
    "Inf gradients for 3 steps": Fault("Inf gradients for 3 steps", overflow=(230, 231, 232)),
    "optimizer state lost": Fault("optimizer state lost", moments_lost_at=240),
    "NaN batch": Fault("NaN batch", nan_batch=210),
    "decaying shard": Fault("decaying shard", shard=tuple(range(340, 370))),
    "persistent fault": Fault("persistent fault", persistent_from=200),
}
MIDRUN = {
    "20 toxic batches": Fault("20 toxic batches", toxic=tuple(range(200, 220))),
    "decaying shard": Fault("decaying shard", shard=tuple(range(240, 270))),
}
RECOVERABLE = [name for name in FAULTS if name not in ("clean", "persistent fault")]


@dataclass
class ScenarioResult:
    eval_loss: float
    halted: tg.TrainingHalted | None
    decisions: list[tg.Decision] = field(default_factory=list)
    guard: tg.Guard | None = None
    model: TinyGPT | RecurrentLM | None = None
    losses: list[float] = field(default_factory=list)  # the training loss of each iteration

    @property
    def events(self) -> list[tg.Event]:
        """Every event of the run, the halt's included."""
        events = [e for d in self.decisions for e in d.events]
        if self.halted is not None:
            events += self.halted.decision.events
        return events


_CORPUS: dict[int, MarkovCorpus] = {}


def corpus(seed: int = 0) -> MarkovCorpus:
    if seed not in _CORPUS:
        _CORPUS[seed] = MarkovCorpus(length=100_000, seed=seed)
    return _CORPUS[seed]


def run_scenario(
    fault: Fault,
    *,
    guarded: bool = True,
    steps: int = 400,
    run_dir: str | Path | None = None,
    config: tg.GuardConfig | None = None,
    family: str = "TinyGPT",
) -> ScenarioResult:
    """Train a model of `family` through `fault` until `steps` optimizer steps are made (a
    rollback replays some), then evaluate on held-out batches."""
    data = corpus()
    batches = planted(list(data.batches(16, 32, steps + 4000, seed=1)), fault, data)
    torch.manual_seed(0)
    model = FAMILIES[family]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    guard = None
    if guarded:
        guard = tg.Guard(
            model, opt, config=config or tg.GuardConfig(console=False), run_dir=run_dir
        )
    result = ScenarioResult(float("nan"), None, guard=guard, model=model)
    try:
        for step in train(model, opt, batches, steps, fault, guard=guard):
            result.losses.append(step.loss)
            if step.decision is not None:
                result.decisions.append(step.decision)
    except tg.TrainingHalted as exc:
        result.halted = exc
    finally:
        if guard is not None:
            guard.close()
    with torch.no_grad():
        evals = list(data.batches(32, 32, 8, seed=999))
        held_out = [float(model.loss(model(b.x), b.y)) for b in evals]
    result.eval_loss = sum(held_out) / len(held_out)
    return result


def planted(batches: list[Batch], fault: Fault, data: MarkovCorpus | TextCorpus) -> list[Batch]:
    """`batches` with the data faults of `fault` in place: its toxic batches, its NaN batch and
    its shard, whose batches decay from 5% to 100% random tokens."""
    out = list(batches)
    for position in fault.toxic:
        out[position] = data.make_toxic(out[position], seed=position)
    for k, position in enumerate(fault.shard):
        fraction = 0.05 + 0.95 * k / max(len(fault.shard) - 1, 1)
        out[position] = corrupted(out[position], data.vocab_size, fraction, position)
    if fault.nan_batch is not None:
        out[fault.nan_batch] = dataclasses.replace(out[fault.nan_batch], input_scale=float("nan"))
    return out


@dataclass(frozen=True)
class Step:
    """One loop iteration: its batch and loss, what the guard decided (None unguarded), and the
    optimizer steps made so far."""

    iteration: int
    batch: Batch
    loss: float
    decision: tg.Decision | None
    done: int


def train(
    model: TinyGPT | RecurrentLM,
    opt: torch.optim.Optimizer,
    batches: list[Batch],
    steps: int,
    fault: Fault,
    *,
    guard: tg.Guard | None = None,
    module: torch.nn.Module | None = None,
) -> Iterator[Step]:
    """Train until `steps` optimizer steps are made, planting the time faults of `fault` by
    iteration (log(0) into `module`, by default `fault_module(model)`). Guarded runs take their
    batches through `guard.batches` and give it a replay; unguarded runs clip at 1.0 and step
    each of the first `steps` batches, as a plain loop does. A halt raises `TrainingHalted`."""
    original_step = opt.step
    log0 = LogZero(module if module is not None else fault_module(model))
    source: Any = guard.batches(batches) if guard is not None else iter(batches[:steps])
    try:
        for iteration, batch in enumerate(source):
            if guard is not None and guard.global_step >= steps:
                break
            opt.step = (  # type: ignore[method-assign]
                functools.partial(scaled_step, opt, original_step, 100.0)
                if iteration in fault.blowup
                else original_step
            )
            log0.armed = iteration == fault.log0_at
            if iteration == fault.corrupt_at:
                with torch.no_grad():
                    model.head.weight.mul_(1e3)
            if iteration == fault.moments_lost_at:
                for state in opt.state.values():
                    state["exp_avg_sq"].zero_()

            def forward(batch: Batch = batch, iteration: int = iteration) -> torch.Tensor:
                logits = model(batch.x, batch.input_scale)
                if fault.persistent_from is not None and iteration >= fault.persistent_from:
                    noise = 0.05 * (iteration - fault.persistent_from)
                    logits = logits + noise * torch.randn_like(logits)
                return model.loss(logits, batch.y)

            loss = forward()
            loss.backward()  # type: ignore[no-untyped-call]
            if iteration in fault.overflow:
                with torch.no_grad():
                    model.head.weight.grad.fill_(float("inf"))  # type: ignore[union-attr]
            decision = None
            if guard is not None:
                decision = guard.step(loss, batch_ids=batch.ids, replay=forward)
                done = guard.global_step
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                done = iteration + 1
            opt.zero_grad(set_to_none=True)
            yield Step(iteration, batch, float(loss.detach()), decision, done)
    finally:
        log0.remove()
        opt.step = original_step  # type: ignore[method-assign]


def fault_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a planted log(0) goes into: the first block's MLP, or the LSTM's MLP."""
    if isinstance(model, TinyGPT):
        block = model.blocks[0]
        assert isinstance(block, Block)
        return block.mlp
    assert isinstance(model, RecurrentLM)
    return model.mlp


class LogZero:
    """A forward hook on `module` that adds log(0) = -inf to its output while `armed`."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.armed = False
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out + torch.log(torch.zeros_like(out[..., :1])) if self.armed else out

    def remove(self) -> None:
        self.handle.remove()


def scaled_step(opt: torch.optim.Optimizer, original: Any, factor: float) -> Any:
    """`original()` (the optimizer's step) with every group's LR `factor` times as large."""
    for group in opt.param_groups:
        group["lr"] *= factor
    try:
        return original()
    finally:
        for group in opt.param_groups:
            group["lr"] /= factor
