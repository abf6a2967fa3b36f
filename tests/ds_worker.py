"""Workers for the DeepSpeed tests: each process builds small DeepSpeed engines on the CPU
(`DS_ACCELERATOR=cpu`, gloo) and runs several guarded scenarios in one launch, writing what it
saw to a JSON file per rank."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import trainguard as tg
from dist_worker import model_and_data
from trainguard.integrations.deepspeed import DeepSpeedGuard

os.environ.setdefault("DS_ACCELERATOR", "cpu")

Fault = Callable[[int, int, torch.Tensor], torch.Tensor]


def allow_fp16_on_cpu() -> None:
    """DeepSpeed refuses fp16 where the CPU's oneDNN has no fp16 kernels; its fp16 path (loss
    scaler, overflow checks) runs in plain torch on the CPU all the same."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def build_engine(
    stage: int,
    dtype: str,
    lr: float = 0.01,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    accumulation: int = 1,
) -> Any:
    import deepspeed

    model, _ = model_and_data(0, 0)  # the same weights on every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler(optimizer) if scheduler is not None else None,
        config=config,
    )
    return engine


def weights(engine: Any) -> list[float]:
    """The sum of each parameter as the model holds it (gathered under ZeRO-3)."""
    import deepspeed

    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            return [float(p.detach().double().sum()) for p in params]
    return [float(p.detach().double().sum()) for p in params]


def private_names_missing(engine: Any) -> list[str]:
    """The DeepSpeed internals the integration reads that this engine's optimizer lacks."""
    from trainguard.integrations import _deepspeed_private as private

    optimizer = engine.optimizer
    wanted = [private.GRADIENT_PARTITIONS, private.DP_GROUP]
    stage = engine.zero_optimization_stage()
    wanted.append(private.PARTITION_PARAMS[0] if stage == 3 else private.PARTITION_PARAMS[1])
    wanted.append(private.OFFLOAD_FLAGS[1] if stage == 3 else private.OFFLOAD_FLAGS[0])
    if stage != 3:
        wanted.append(private.REGATHER)
    missing = [name for name in wanted if not hasattr(optimizer, name)]
    if not hasattr(engine, private.CHECKPOINT_ENGINE):
        missing.append(private.CHECKPOINT_ENGINE)
    try:
        private.checkpoint_globals()
    except (ImportError, AttributeError) as exc:
        missing.append(str(exc))
    return missing


def train(
    engine: Any,
    rank: int,
    steps: int,
    out: Path | None,
    fault: Fault | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`steps` optimizer steps over this rank's data, guarded when `out` is a run folder (else
    plain `engine.step()`); the actions, losses and the weights at the start of each step."""
    _, data = model_and_data(rank, steps * engine.gradient_accumulation_steps() + 60)
    dtype = next(engine.module.parameters()).dtype
    missing = private_names_missing(engine)
    guard = None
    if out is not None:
        cfg = tg.GuardConfig.from_dict({"console": False, **(config or {})})
        guard = DeepSpeedGuard(engine, config=cfg, run_dir=out)
    actions: list[list[Any]] = []
    losses: list[float] = []
    at_start: list[list[Any]] = []  # [step, weights], again for a step replayed
    scales: list[float] = []
    norms: list[list[float]] = []
    source = guard.batches(data) if guard is not None else iter(data)
    step = 0
    accumulation = engine.gradient_accumulation_steps()
    for i, (x, y) in enumerate(source):
        step = guard.global_step if guard is not None else i // accumulation
        if step >= steps:
            break
        at_start.append([step, weights(engine)])
        loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        if fault is not None:
            loss = fault(rank, step, loss)
        engine.backward(loss)
        losses.append(float(loss.detach()))
        if guard is None:
            engine.step()
            actions.append([step, "step"])
            continue
        decision = guard.step(loss, batch_ids=[f"r{rank}-b{i}"])
        actions.append([decision.step, decision.action])
        if "grad_norm" in decision.metrics:  # the guard's norm; the one the engine clipped by
            norms.append([decision.metrics["grad_norm"], float(engine.get_global_grad_norm())])
        if engine.fp16_enabled():
            scales.append(float(engine.optimizer.loss_scale))
    if guard is not None:
        guard.close()
    return {
        "actions": actions,
        "losses": losses,
        "weights": weights(engine),
        "at_start": at_start,
        "scales": scales,
        "norms": norms,
        "private_missing": missing,
        "exchange_calls": guard.exchange.calls if guard is not None and guard.exchange else 0,
        "exchange_rounds": getattr(guard.exchange, "rounds", 0) if guard is not None else 0,
        "replica_checks": guard.replicas.calls if guard is not None and guard.replicas else 0,
        "engine_steps": engine.global_steps,
    }


def nan_on_rank1(rank: int, out: Path) -> dict[str, Any]:
    """ZeRO-2, bf16: rank 1's loss is NaN at step 12 alone."""

    def fault(r: int, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if (r == 1 and step == 12) else loss

    return train(build_engine(2, "bf16"), rank, 20, out, fault)


def fp16_overflow(rank: int, out: Path) -> dict[str, Any]:
    """ZeRO-2, fp16: rank 0's gradients overflow at step 8 (the engine's scaler skips it)."""

    def fault(r: int, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * 1e6 if (r == 0 and step == 8) else loss  # x scale 256: over fp16's max

    allow_fp16_on_cpu()
    return train(build_engine(2, "fp16"), rank, 14, out, fault)


def toxic_on_rank0(rank: int, out: Path) -> dict[str, Any]:
    """ZeRO-1, bf16: rank 0's batch of step 30 is toxic (loss x400)."""

    def fault(r: int, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * 400.0 if (r == 0 and step == 30) else loss

    return train(build_engine(1, "bf16"), rank, 40, out, fault)


def lr_burst(rank: int, out: Path) -> dict[str, Any]:
    """ZeRO-2 in bf16, then ZeRO-3 in fp32: the schedule multiplies the LR by 100 for the 43rd
    to 47th batch (in the run's time: a rollback does not bring the burst back)."""
    runs = {}
    for stage, dtype in ((2, "bf16"), (3, "fp32")):
        batch = {"i": 0}

        def schedule(optimizer: torch.optim.Optimizer, batch: dict[str, int] = batch) -> Any:
            return torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s: 100.0 if 43 <= batch["i"] < 48 else 1.0
            )

        def count(
            r: int, step: int, loss: torch.Tensor, batch: dict[str, int] = batch
        ) -> torch.Tensor:
            batch["i"] += 1
            return loss

        config = {"recovery": {"snapshot_every": 10, "rollback_margin": 5}}
        engine = build_engine(stage, dtype, scheduler=schedule)
        runs[f"stage{stage}"] = train(engine, rank, 70, out / f"stage{stage}", count, config)
    return runs


def clean(rank: int, out: Path) -> dict[str, Any]:
    """ZeRO-3, ZeRO-1 (through the all-gather exchange) and ZeRO-2 with 2 micro-batches a step,
    fp32, the replicas checked every 5 steps: a guarded clean run and the same run on
    `engine.step()`."""
    setups = {"1": (1, 1), "3": (3, 1), "2-accumulating": (2, 2)}
    guarded, plain = {}, {}
    for name, (stage, accumulation) in setups.items():
        engine = build_engine(stage, "fp32", accumulation=accumulation)
        config: dict[str, Any] = {"replicas": {"every": 5}}
        if stage == 1:
            config["ranks"] = {"exchange": "gather"}
        guarded[name] = train(engine, rank, 30, out / f"stage{name}", config=config)
        plain[name] = train(build_engine(stage, "fp32", accumulation=accumulation), rank, 30, None)
    return {"guarded": guarded, "plain": plain}


def replica_nudge(rank: int, out: Path) -> dict[str, Any]:
    """ZeRO-2, fp32, the replicas checked every 5 steps: after step 9's engine step gathered
    the weights, rank 1's copy of one is nudged by 1e-6 (2 ranks: no majority, a halt). Then
    the guard's regather, given a decision that names rank 1, after another nudge."""
    engine = build_engine(2, "fp32")
    cfg = tg.GuardConfig.from_dict({"console": False, "replicas": {"every": 5}})
    guard = DeepSpeedGuard(engine, config=cfg, run_dir=out)
    assert guard.replicas is not None and guard._resync is not None
    _, data = model_and_data(rank, 20)
    first = next(iter(engine.module.parameters()))

    def nudge() -> None:
        if rank == 1:
            with torch.no_grad():
                first.view(-1)[0] += 1e-6

    actions: list[list[Any]] = []
    halted = None
    try:
        for x, y in guard.batches(data):
            if guard.global_step == 10:  # after step 9's gather, before the check at 10
                nudge()
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            decision = guard.step(loss)
            actions.append([decision.step, decision.action])
    except tg.TrainingHalted as exc:
        halted = exc.diagnosis
    nudge()
    before = guard.replicas.compare()
    regathered = guard._resync.apply(
        tg.Decision(step=guard.global_step, action="skip", resync_from=0, resync_ranks=[1]), []
    )
    after = guard.replicas.compare()
    guard.close()
    return {
        "private_missing": private_names_missing(engine),
        "actions": actions,
        "halted": halted,
        "differ_before": before,
        "differ_after": after,
        "regathered": [e.message for e in regathered],
        "checks": guard.replicas.calls,
    }


def replica_three(rank: int, out: Path) -> dict[str, Any]:
    """3 ranks, ZeRO-2, bf16, the replicas checked every 5 steps: after step 9's engine step
    gathered the weights, rank 2's copy of one is moved by one bf16 step (a majority of 2)."""
    engine = build_engine(2, "bf16")
    cfg = tg.GuardConfig.from_dict({"console": False, "replicas": {"every": 5}})
    guard = DeepSpeedGuard(engine, config=cfg, run_dir=out)
    assert guard.replicas is not None
    _, data = model_and_data(rank, 20)
    first = next(iter(engine.module.parameters()))
    actions: list[list[Any]] = []
    for x, y in guard.batches(data):
        if guard.global_step == 15:
            break
        if guard.global_step == 10 and rank == 2:
            with torch.no_grad():
                first.view(-1)[0] = torch.nextafter(first.view(-1)[0], first.new_tensor(1.0))
        loss = nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), y)
        engine.backward(loss)
        decision = guard.step(loss)
        actions.append([decision.step, decision.action])
    guard.close()
    return {
        "actions": actions,
        "weights": weights(engine),
        "checks": guard.replicas.calls,
        "engine_steps": engine.global_steps,
    }


def timed_checkpoint(rank: int, out: Path) -> dict[str, Any]:
    """ZeRO-1, fp32, DeepSpeed checkpoints every 60 s of wall time and never by steps, on
    injected clocks: rank 1's moves 25 s a step, rank 0's stands still."""
    engine = build_engine(1, "fp32")
    recovery = {"checkpoint_every": 0, "checkpoint_every_s": 60.0, "keep_checkpoints": 10}
    cfg = tg.GuardConfig.from_dict({"console": False, "recovery": recovery})
    guard = DeepSpeedGuard(engine, config=cfg, run_dir=out)
    clock = {"now": 0.0}
    guard.checkpoint_clock = lambda: clock["now"]
    saved_at: list[int] = []
    save = guard.save_checkpoint

    def recorded() -> None:
        saved_at.append(guard.global_step)
        save()

    guard.save_checkpoint = recorded  # type: ignore[method-assign]
    _, data = model_and_data(rank, 10)
    for x, y in guard.batches(data):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        guard.step(loss)
        clock["now"] += 25.0 if rank == 1 else 0.0
    guard.close()
    return {"saved_at": saved_at}


class Payload:
    """Pickled as a call of `exec` that writes `marker`: what an attacker plants in a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def plant_payload(folder: Path, marker: Path) -> None:
    """Rewrite the tag's module states as the real state plus a key whose unpickling runs code."""
    path = folder / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)  # the file this test's own run wrote
    state["extra"] = Payload(marker)
    torch.save(state, path)


def checkpoint_attacks(rank: int, out: Path) -> dict[str, Any]:
    """ZeRO-2, bf16. Run A checkpoints steps 2-8 in `run`; run B, a new DeepSpeedGuard in the
    same folder, checkpoints 2, 4 and 6 (keeping 3). Then rank 0 copies B's step-6 outside the
    run folder and points `latest` at it (`../../elsewhere/step-6`), plants a code payload in
    step-6 with a manifest recomputed to match, and in step-4 with the manifest as it was; a
    resume must run neither, load nothing outside, and fall back to step-2."""
    from trainguard.integrations import _deepspeed_private as private
    from trainguard.integrations.deepspeed import tag_manifest

    run_dir, marker = out / "run", out / "payload-ran"
    checkpoints = run_dir / "checkpoints"
    found: dict[str, Any] = {}
    for name, steps, keep in (("a", 8, 10), ("b", 6, 3)):
        recovery = {"checkpoint_every": 2, "keep_checkpoints": keep}
        found[name] = train(
            build_engine(2, "bf16"), rank, steps, run_dir, config={"recovery": recovery}
        )
    found["earlier"] = sorted(
        sorted(q.name for q in p.iterdir()) for p in run_dir.glob("checkpoints-earlier-*")
    )
    found["b_kept"] = sorted(p.name for p in checkpoints.glob("step-*"))
    if rank == 0:
        shutil.copytree(checkpoints / "step-6", out / "elsewhere" / "step-6")
        (checkpoints / "latest").write_text("../../elsewhere/step-6")
        for step in (6, 4):
            plant_payload(checkpoints / f"step-{step}", marker)
        forged = tag_manifest(checkpoints / "step-6", 6, dist.get_world_size())
        (checkpoints / "step-6" / "manifest.json").write_text(json.dumps(forged))
    dist.barrier()
    engine = build_engine(2, "bf16")
    refused = None
    try:  # DeepSpeed's own reader, as the guard runs it, given the payload directly
        with private.weights_only_loads(engine):
            engine.checkpoint_engine.load(
                str(checkpoints / "step-6" / "mp_rank_00_model_states.pt")
            )
    except pickle.UnpicklingError as exc:
        refused = str(exc)
    cfg = tg.GuardConfig.from_dict({"console": False})
    guard = DeepSpeedGuard.resume(run_dir, engine, config=cfg)
    found["resumed_at"] = guard.global_step
    found["engine_steps"] = engine.global_steps
    guard.close()
    found["refused"] = refused
    found["payload_ran"] = marker.exists()
    return found


def unsupported(rank: int, out: Path) -> dict[str, Any]:
    """What the guard says of an engine without ZeRO (stage 0) and of a plain module."""
    said = {}
    for name, engine in (("stage0", build_engine(0, "fp32")), ("module", nn.Linear(2, 2))):
        try:
            DeepSpeedGuard(engine, run_dir=out / name)
        except tg.TrainguardError as exc:
            said[name] = str(exc)
    return said


def precursors(rank: int, out: Path) -> dict[str, Any]:
    """A TinyGPT under ZeRO-2 and ZeRO-3 with 2 micro-batches a step, precursors every 2 steps:
    the figures each rank's guard recorded, and the hooks left on the module after each step."""
    import deepspeed

    from trainguard.demo.model import TinyGPT, TinyGPTConfig

    found: dict[str, Any] = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = TinyGPT(TinyGPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=16))
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        cfg = tg.GuardConfig.from_dict({"console": False, "precursors": {"every": 2}})
        folder = out / f"stage{stage}"
        guard = DeepSpeedGuard(engine, config=cfg, run_dir=folder)
        g = torch.Generator().manual_seed(10 + rank)
        records: list[Any] = []
        hooked: list[bool] = []
        for _ in range(10):  # 5 optimizer steps of 2 micro-batches
            x = torch.randint(0, 32, (4, 16), generator=g)
            loss = nn.functional.cross_entropy(engine(x).flatten(0, 1), x.flatten())
            engine.backward(loss)
            decision = guard.step(loss, token_accuracy=0.5)
            if decision.metrics:
                records.append(decision.metrics.get("precursors"))
                assert guard.probe is not None  # DeepSpeed's ZeRO-3 has module hooks of its own
                hooked.append(guard.probe.hooked)
        guard.close()
        found[str(stage)] = {"records": records, "hooked": hooked}
    return found


SCENARIOS: dict[str, Callable[[int, Path], dict[str, Any]]] = {
    "nan_on_rank1": nan_on_rank1,
    "fp16_overflow": fp16_overflow,
    "toxic_on_rank0": toxic_on_rank0,
    "lr_burst": lr_burst,
    "clean": clean,
    "replica_nudge": replica_nudge,
    "replica_three": replica_three,
    "timed_checkpoint": timed_checkpoint,
    "unsupported": unsupported,
    "checkpoint_attacks": checkpoint_attacks,
    "precursors": precursors,
}


def run(rank: int, world: int, scenarios: list[str], out: str, port: int) -> None:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234 + rank)
    results: dict[str, Any] = {}
    try:
        for name in scenarios:
            folder = Path(out) / name
            folder.mkdir(parents=True, exist_ok=True)
            results[name] = SCENARIOS[name](rank, folder)
    finally:
        dist.destroy_process_group()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
