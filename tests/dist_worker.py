"""Workers for the distributed tests: each runs a small guarded DDP or FSDP2 job on the gloo
backend in its own process and writes what it saw to a JSON file per rank."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import trainguard as tg

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "broadcast",
    "barrier",
    "all_gather_object",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
)


def model_and_data(
    rank: int, steps: int
) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)  # the same weights on every rank
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    data = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        data.append((x, x @ w + 0.1 * torch.randn(32, 1, generator=g)))
    return model, data


class CollectiveCounter:
    """Counts torch.distributed collectives made while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.count = 0
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue

            def wrapped(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if self.active:
                    self.count += 1
                return _original(*args, **kwargs)

            setattr(dist, name, wrapped)


def run(rank: int, world: int, scenario: str | list[str], out: str, port: int) -> None:
    """One rank: a scenario writes its result to OUT/rank{rank}.json; a list of scenarios runs
    them one after another in this one world (each in OUT/NAME, seeded alike) and writes
    {name: result}."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    names = [scenario] if isinstance(scenario, str) else scenario
    results: dict[str, Any] = {}
    try:
        for name in names:
            folder = Path(out) if isinstance(scenario, str) else Path(out) / name
            folder.mkdir(parents=True, exist_ok=True)
            torch.manual_seed(1234 + rank)
            results[name] = SCENARIOS[name](rank, world, folder)
            # the scenario's guard, DDP and FSDP objects (in reference cycles) release their
            # groups and pending work now, not in the interpreter's finalization, where gloo can
            # abort; no rank goes on (or tears down) while a peer's last send is in flight
            gc.collect()
            dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()
    result = results[scenario] if isinstance(scenario, str) else results
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def ddp_job(
    rank: int,
    world: int,
    out: Path,
    steps: int,
    config: dict[str, Any],
    fault: Any = None,
    sleep: Any = None,
    poison: Any = None,
    corrupt: Any = None,
    skip_at: set[int] | None = None,
    no_replay_at: frozenset[int] = frozenset(),
) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, data = model_and_data(rank, steps + 50)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    cfg = tg.GuardConfig.from_dict({"console": False, **config})
    counter = CollectiveCounter()
    guard = tg.Guard(ddp, opt, config=cfg, run_dir=out)
    scale = {"by": 1.0}  # a silent corruption of this rank's gradients, before the all-reduce
    for p in model.parameters():
        p.register_hook(lambda g: g * scale["by"] if scale["by"] != 1.0 else g)
    actions, per_step, losses = [], [], []
    batches = guard.batches(data)
    for i, (x, y) in enumerate(batches):
        if i >= steps:
            break
        step = guard.global_step
        if sleep is not None:
            time.sleep(sleep(rank, step))
        if poison is not None:
            x = poison(rank, step, x)
        loss = nn.functional.mse_loss(ddp(x), y)
        if fault is not None:
            loss = fault(rank, step, loss)  # a fault that a replay does not see
        opt.zero_grad(set_to_none=True)
        scale["by"] = corrupt(rank, step, False) if corrupt is not None else 1.0
        loss.backward()
        scale["by"] = 1.0
        counter.active, counter.count = True, 0

        def replay(x: torch.Tensor = x, y: torch.Tensor = y, step: int = step) -> torch.Tensor:
            scale["by"] = corrupt(rank, step, True) if corrupt is not None else 1.0
            return nn.functional.mse_loss(ddp(x), y)

        losses.append(float(loss.detach()))
        if skip_at is not None:  # the reference: plain DDP steps, that one's update left out
            if step not in skip_at:
                opt.step()
            guard.global_step += 1
            actions.append([step, "skip" if step in skip_at else "step"])
            per_step.append(0)
            continue
        decision = guard.step(
            loss, batch_ids=[f"r{rank}-b{i}"], replay=None if step in no_replay_at else replay
        )
        scale["by"] = 1.0
        counter.active = False
        per_step.append(counter.count)
        actions.append([decision.step, decision.action])
    guard.close()
    return {
        "actions": actions,
        "collectives_per_step": per_step,
        "exchange_calls": guard.exchange.calls if guard.exchange else 0,
        "weights": [float(p.detach().sum()) for p in model.parameters()],
        "losses": losses,
    }


def nan_on_rank1(rank: int, world: int, out: Path) -> dict[str, Any]:
    def poison(r: int, step: int, x: torch.Tensor) -> torch.Tensor:
        if r == 1 and step == 30:  # bad data: it comes back when the step is replayed
            return x * 1e25  # finite, but its squared error overflows
        return x

    def fault(r: int, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if (r == 1 and step == 45) else loss  # a one-off

    config = {"diagnosis": {"trace_every": 1}}
    return ddp_job(rank, world, out, 60, config, fault=fault, poison=poison)


def toxic_on_rank2(rank: int, world: int, out: Path) -> dict[str, Any]:
    def fault(r: int, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * 50.0 if (r == 2 and 60 <= step < 66) else loss

    config = {"recovery": {"snapshot_every": 20, "rollback_margin": 5}}
    return ddp_job(rank, world, out, 110, config, fault=fault)


def clean_small_batches(rank: int, world: int, out: Path) -> dict[str, Any]:
    return ddp_job(rank, world, out, 150, {"diagnosis": {"trace_every": 1}})


SDC_STEPS = {40: "lasting", 60: "one-off", 80: "no replay"}


def sdc(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Rank 1's gradients x1000 before the all-reduce at each of SDC_STEPS: on the replay too
    at 40 (a lasting fault), not at 60 (a one-off); at 80 the step has no replay closure."""

    def corrupt(r: int, step: int, replaying: bool) -> float:
        hit = r == 1 and step in SDC_STEPS and not (replaying and SDC_STEPS[step] == "one-off")
        return 1000.0 if hit else 1.0

    # the global grad-norm spike is off: the per-rank check alone must skip the step
    config = {
        "max_grad_norm": None,
        "diagnosis": {"trace_every": 1},
        "grad_spike": {"enabled": False},
    }
    no_replay = frozenset(s for s, how in SDC_STEPS.items() if how == "no replay")
    return ddp_job(rank, world, out, 100, config, corrupt=corrupt, no_replay_at=no_replay)


def sdc_reference(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Plain DDP steps over the same data: with the updates of SDC_STEPS left out, and clean."""
    config = {"max_grad_norm": None}
    (out / "skipped").mkdir(exist_ok=True)
    (out / "clean").mkdir(exist_ok=True)
    skipped = ddp_job(rank, world, out / "skipped", 100, config, skip_at=set(SDC_STEPS))
    clean = ddp_job(rank, world, out / "clean", 100, config, skip_at=set())
    return {"skipped": skipped, "clean": clean}


def straggler(rank: int, world: int, out: Path) -> dict[str, Any]:
    config = {"straggler": {"every": 10, "windows": 2, "factor": 1.5}}
    return ddp_job(rank, world, out, 50, config, sleep=lambda r, s: 0.04 if r == 1 else 0.02)


def fsdp_norm(rank: int, world: int, out: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model, data = model_and_data(rank, 5)
    reference, _ = model_and_data(rank, 5)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = tg.GuardConfig.from_dict({"console": False, "max_grad_norm": None})
    guard = tg.Guard(model, opt, config=cfg)
    norms, expected = [], []
    everyone = [model_and_data(r, 5)[1] for r in range(world)]
    for step in range(3):
        x, y = data[step]
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(float(guard.step(loss).metrics["grad_norm"]))
        # the single-process reference: the same weights, the mean of every rank's loss
        reference.zero_grad(set_to_none=True)
        full = sum(nn.functional.mse_loss(reference(d[step][0]), d[step][1]) for d in everyone)
        (full / world).backward()
        expected.append(
            float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
        )
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.01 * p.grad
    return {"norms": norms, "expected": expected}


def fsdp_checkpoint(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Train 12 steps with checkpoints at 5 and 10; then resume fresh objects from the one at
    10 and train to 12 again: the same weights, shard for shard."""
    from torch.distributed.fsdp import fully_shard

    def build() -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
        model, data = model_and_data(rank, 20)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01), data

    def train(guard: tg.Guard, model: nn.Module, data: list[Any]) -> list[float]:
        for x, y in guard.batches(data):
            if guard.global_step >= 12:
                break
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            guard.step(loss)
            guard.optimizer.zero_grad(set_to_none=True)
        guard.checkpoints.wait()
        return [float(p.full_tensor().double().sum()) for p in model.parameters()]

    cfg = tg.GuardConfig.from_dict({"console": False, "recovery": {"checkpoint_every": 5}})
    model, opt, data = build()
    guard = tg.Guard(model, opt, config=cfg, run_dir=out)
    first = train(guard, model, data)
    written = guard.checkpoints.written.get("written", 0)  # this rank's blobs at step 10
    guard.close()
    model, opt, data = build()
    guard = tg.Guard.resume(out, model, opt, config=cfg)
    start = guard.global_step
    second = train(guard, model, data)
    return {"first": first, "second": second, "start": start, "written": written}


def replica_job(
    rank: int, world: int, out: Path, steps: int, tamper: list[tuple[int, int, str]]
) -> dict[str, Any]:
    """DDP with Adam, the replicas checked every 5 steps; for each (rank, step, what) of
    `tamper`, after that step that rank adds 1e-6 to one weight ("weight": a bit flip, a bad
    write) or 1e-4 to one of Adam's first moments ("state")."""
    import hashlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    model, data = model_and_data(rank, steps)
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    config = {"console": False, "replicas": {"every": 5}, "recovery": {"snapshot_every": 4}}
    guard = tg.Guard(ddp, opt, config=tg.GuardConfig.from_dict(config), run_dir=out)
    actions, halted = [], None
    try:
        for x, y in guard.batches(data):
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            decision = guard.step(loss)
            actions.append([decision.step, decision.action])
            for r, s, what in tamper:
                if (r, s) != (rank, decision.step):
                    continue
                with torch.no_grad():
                    if what == "weight":
                        model[0].weight[3, 5] += 1e-6
                    else:
                        opt.state[model[0].weight]["exp_avg"][3, 5] += 1e-4
    except tg.TrainingHalted as exc:
        halted = exc.diagnosis
    guard.close()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
        for value in opt.state[p].values():
            digest.update(value.numpy().tobytes())
    assert guard.replicas is not None
    return {
        "actions": actions,
        "halted": halted,
        "digest": digest.hexdigest(),
        "checks": guard.replicas.calls,
    }


def replicas_three(rank: int, world: int, out: Path) -> dict[str, Any]:
    return replica_job(rank, world, out, 30, tamper=[(2, 12, "weight"), (1, 17, "state")])


def replicas_two(rank: int, world: int, out: Path) -> dict[str, Any]:
    return replica_job(rank, world, out, 30, tamper=[(1, 7, "weight")])


def record_saves(guard: tg.Guard) -> list[int]:
    """The steps at which the guard saves a checkpoint, as it saves them."""
    saved_at: list[int] = []
    save = guard.save_checkpoint

    def recorded() -> None:
        saved_at.append(guard.global_step)
        save()

    guard.save_checkpoint = recorded  # type: ignore[method-assign]
    return saved_at


def timed_checkpoint(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Checkpoints every 60 s of wall time and never by steps, on injected clocks: rank 1's
    moves 25 s a step, rank 0's stands still; the steps each rank checkpointed."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, data = model_and_data(rank, 10)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    recovery = {"checkpoint_every": 0, "checkpoint_every_s": 60.0, "keep_checkpoints": 10}
    cfg = tg.GuardConfig.from_dict({"console": False, "recovery": recovery})
    guard = tg.Guard(ddp, opt, config=cfg, run_dir=out)
    clock = {"now": 0.0}
    guard.checkpoint_clock = lambda: clock["now"]
    saved_at = record_saves(guard)
    actions = []
    for x, y in guard.batches(data):
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        actions.append(guard.step(loss).action)
        clock["now"] += 25.0 if rank == 1 else 0.0
    guard.close()
    return {"saved_at": saved_at, "actions": actions}


def slow_writer(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Checkpoints every 2 steps, deferred as on a device; rank 0's write of step 2 (its finish:
    manifest, rename) is held until its step 6, while rank 1's part is written at once: the steps
    each rank saved, whether its own writer was busy at step 4, and the deferrals it was told of."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainguard.actions.checkpoints import CheckpointStore

    release = out / "release"
    original = CheckpointStore._finish

    def held(self: CheckpointStore, step: int, *args: Any) -> None:
        deadline = time.monotonic() + 60
        while step == 2 and not release.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        original(self, step, *args)

    CheckpointStore._finish = held  # type: ignore[method-assign]
    model, data = model_and_data(rank, 9)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    recovery = {"checkpoint_every": 2, "keep_checkpoints": 10}
    cfg = tg.GuardConfig.from_dict({"console": False, "recovery": recovery})
    guard = tg.Guard(ddp, opt, config=cfg, run_dir=out)
    assert guard.checkpointing is not None and guard.checkpoints is not None
    guard.checkpointing.defers = True  # as on a device
    saved_at = record_saves(guard)
    deferred, busy_at_4 = [], None
    for i, (x, y) in enumerate(guard.batches(data)):
        if i == 3:
            busy_at_4 = guard.checkpoints.writing
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        decision = guard.step(loss)
        deferred += [[e.step, e.severity] for e in decision.events if e.kind == "checkpoint"]
        if i == 1 and rank == 1:  # its part of step 2 written (rank 0's finish is not)
            guard.checkpoints.wait()
        if i == 5 and rank == 0:
            release.touch()
        if i >= 5:  # each write over before the next step: the steps saved are exact
            guard.checkpoints.wait()
    guard.close()
    CheckpointStore._finish = original  # type: ignore[method-assign]
    return {"saved_at": saved_at, "deferred": deferred, "busy_at_4": busy_at_4}


def exchange_compare(rank: int, world: int, out: Path) -> dict[str, Any]:
    """The same planted faults through the `gather` and the `reduce` exchange: a NaN loss on
    rank 1 at step 30 and on ranks 0 and 2 at step 45 (two named), rank 2's loss x50 at steps
    60-65 (rolled back), rank 1 a straggler over the first 40 steps; and a clean run of each."""

    def fault(r: int, step: int, loss: torch.Tensor) -> torch.Tensor:
        if (r == 1 and step == 30) or (r != 1 and step == 45):
            return loss * float("nan")
        return loss * 50.0 if (r == 2 and 60 <= step < 66) else loss

    def sleep(r: int, step: int) -> float:  # far over the noise of a busy 2-core machine
        return 0.12 if r == 1 and step < 40 else 0.0

    found: dict[str, Any] = {}
    for mode in ("gather", "reduce"):
        config = {
            "ranks": {"exchange": mode},
            "recovery": {"snapshot_every": 20, "rollback_margin": 5},
            "straggler": {"every": 10, "windows": 2, "factor": 1.5},
            "diagnosis": {"trace_every": 1},
        }
        (out / mode).mkdir(exist_ok=True)
        (out / f"{mode}-clean").mkdir(exist_ok=True)
        found[mode] = ddp_job(rank, world, out / mode, 90, config, fault=fault, sleep=sleep)
        clean = {"ranks": {"exchange": mode}, "diagnosis": {"trace_every": 1}}
        found[f"{mode}-clean"] = ddp_job(rank, world, out / f"{mode}-clean", 40, clean)
    return found


def precursors_agree(rank: int, world: int, out: Path) -> dict[str, Any]:
    """A DDP TinyGPT with Adam, each rank its own tokens, precursors every 4 steps: the guard's
    figures (agreed over the ranks) beside this rank's own (a second probe, not reduced)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainguard.demo.model import TinyGPT, TinyGPTConfig
    from trainguard.signals.gradients import precursor_dict
    from trainguard.signals.precursors import PrecursorProbe

    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=16))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    cfg = tg.GuardConfig.from_dict({"console": False, "precursors": {"every": 4}})
    counter = CollectiveCounter()
    guard = tg.Guard(ddp, opt, config=cfg)
    own = PrecursorProbe(model, cfg.precursors)  # this rank's figures, not agreed
    g = torch.Generator().manual_seed(100 + rank)
    agreed, local, per_step = {}, {}, []
    for step in range(9):
        own.arm(step)
        x = torch.randint(0, 32, (4, 16), generator=g) * (rank + 1) % 32
        loss = nn.functional.cross_entropy(ddp(x).flatten(0, 1), x.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        taken = own.take(step, torch.device("cpu"))
        if taken is not None:
            local[step] = precursor_dict(own.names, taken[0].tolist())
        counter.active, counter.count = True, 0
        decision = guard.step(loss)
        counter.active = False
        per_step.append(counter.count)
        if "precursors" in decision.metrics:
            agreed[step] = decision.metrics["precursors"]
    guard.close()
    return {"agreed": agreed, "local": local, "collectives_per_step": per_step}


def host_reads(rank: int, world: int, out: Path) -> dict[str, Any]:
    """A DDP TinyGPT with AdamW on the `reduce` exchange, precursors every 4 steps: per step the
    host reads (`fake_device`), the trainguard calls of `torch.tensor(..., device=...)` (a
    pageable copy on a GPU), the reads through `read_now`, and the figures sent through the
    exchange's `FigureUpload`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fake_device import count_host_reads, count_uploads, mark_optimizer_steps
    from trainguard.demo.model import TinyGPT, TinyGPTConfig
    from trainguard.distributed.upload import FigureUpload
    from trainguard.signals.host_reads import reads_counted

    sent = {"count": 0}
    send = FigureUpload.send

    def counted_send(self: FigureUpload, figures: Any) -> torch.Tensor:
        sent["count"] += 1
        return send(self, figures)

    FigureUpload.send = counted_send  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(vocab_size=32, seq_len=16, n_layer=2, n_head=2, d_model=16))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    config = {"console": False, "precursors": {"every": 4}, "ranks": {"exchange": "reduce"}}
    guard = tg.Guard(ddp, opt, config=tg.GuardConfig.from_dict(config))
    g = torch.Generator().manual_seed(100 + rank)
    steps: list[dict[str, Any]] = []
    for step in range(9):
        x = torch.randint(0, 32, (4, 16), generator=g) * (rank + 1) % 32
        loss = nn.functional.cross_entropy(ddp(x).flatten(0, 1), x.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sent["count"] = 0
        with count_host_reads() as reads, count_uploads() as uploads, reads_counted() as now:
            decision = guard.step(loss)
        mark_optimizer_steps(opt)  # AdamW's step counts: host state, read without a sync
        steps.append(
            {
                "step": step,
                "action": decision.action,
                "reads": dict(reads.by_kind),
                "uploads": uploads.calls,
                "read_now": now["now"],
                "sent": sent["count"],
                "precursors": "precursors" in decision.metrics,
            }
        )
    guard.close()
    FigureUpload.send = send  # type: ignore[method-assign]
    return {"steps": steps}


SCENARIOS = {
    "host_reads": host_reads,
    "precursors_agree": precursors_agree,
    "exchange_compare": exchange_compare,
    "timed_checkpoint": timed_checkpoint,
    "slow_writer": slow_writer,
    "fsdp_checkpoint": fsdp_checkpoint,
    "nan_on_rank1": nan_on_rank1,
    "toxic_on_rank2": toxic_on_rank2,
    "straggler": straggler,
    "clean_small_batches": clean_small_batches,
    "sdc": sdc,
    "sdc_reference": sdc_reference,
    "fsdp_norm": fsdp_norm,
    "replicas_three": replicas_three,
    "replicas_two": replicas_two,
}
