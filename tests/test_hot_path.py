"""The lagged hot path: the skip decided on the device through a fused optimizer's `found_inf`,
the host judging each step one call later. On the CPU (whose fused AdamW honours `found_inf`)
it is forced and held to the synchronous path: the same action at every step and the same
weights bit for bit, through the planted faults."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.demo.scenarios import scaled_step
from trainguard.detectors import DetectorSuite
from trainguard.detectors.base import MetricPoint
from trainguard.detectors.gradients import GradSpikeDetector
from trainguard.detectors.loss_spike import LossSpikeDetector
from trainguard.signals.gradients import GradientStats

from helpers import read_jsonl

CURVES = Path(__file__).resolve().parents[1] / "data" / "curves"


@dataclass(frozen=True)
class Fault:
    """Planted by data position (`toxic`, `nan`) or by attempt (a call that is not undone by
    the lagged path's rollback: both paths count them alike)."""

    name: str
    toxic: tuple[int, ...] = ()
    nan: tuple[int, ...] = ()
    burst: tuple[int, ...] = ()  # attempts whose update lands at 100x the LR
    corrupt_at: int | None = None  # attempt at which the last layer's weights become 1000x


FAULTS = [
    Fault("clean"),
    Fault("toxic batch", toxic=(150,)),
    Fault("LR x100 burst", burst=tuple(range(150, 156))),
    Fault("NaN batch", nan=(150,)),
    Fault("corrupted weights", corrupt_at=150),
]


@dataclass
class Run:
    actions: list[tuple[int, str]] = field(default_factory=list)  # (step, action), not plain steps
    weights: torch.Tensor | None = None
    guard: tg.Guard | None = None
    returned: list[tg.Decision] = field(default_factory=list)


def batches(n: int, fault: Fault) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=gen)
    out = []
    for i in range(n):
        x = torch.randn(32, 16, generator=gen)
        y = x @ w + 0.1 * torch.randn(32, 1, generator=gen)
        if i in fault.toxic:
            y = y * 30 + 20
        if i in fault.nan:
            x = x * math.nan
        out.append((i, x, y))
    return out


def train(
    fault: Fault, hot_path: str, steps: int = 220, run_dir: Path | None = None, **config: Any
) -> Run:
    """An MLP regression with fused AdamW through `fault`, until `steps` steps are made."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    guard = tg.Guard(
        model,
        opt,
        config=tg.GuardConfig(console=False, hot_path=hot_path, **config),
        run_dir=run_dir,
    )
    run = Run(guard=guard)
    original, attempt = opt.step, 0
    try:
        for position, x, y in guard.batches(batches(steps + 200, fault)):
            if guard.global_step >= steps:
                break
            burst = attempt in fault.burst
            opt.step = functools.partial(scaled_step, opt, original, 100.0) if burst else original
            if attempt == fault.corrupt_at:
                with torch.no_grad():
                    model[2].weight.mul_(1e3)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            decision = guard.step(loss, batch_ids=[position])
            run.returned.append(decision)
            if decision.reason != "judged at the next call" and decision.action != "step":
                run.actions.append((decision.step, decision.action))
            if not (hot_path == "lagged" and decision.action == "rollback"):
                attempt += 1  # the lagged path's rollback undoes this call's step unmade
            opt.zero_grad(set_to_none=True)
        last = guard.judge_pending()  # the step still pending on the lagged path
        if last is not None and last.action != "step":
            run.actions.append((last.step, last.action))
    finally:
        opt.step = original  # type: ignore[method-assign]
        guard.close()
    run.weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return run


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_lagged_path_acts_as_the_synchronous_one_bit_for_bit(fault):
    sync = train(fault, "sync")
    lagged = train(fault, "lagged")
    assert lagged.actions == sync.actions, "the lagged path acted differently"
    assert sync.weights is not None and lagged.weights is not None
    assert torch.equal(lagged.weights, sync.weights), "the weights differ"
    assert lagged.guard is not None and sync.guard is not None
    assert lagged.guard.action_counts == sync.guard.action_counts
    if fault.name == "clean":
        assert not sync.actions, "a clean run was acted on"
    else:  # each fault is acted on: the test compares paths that both did something
        assert sync.actions, f"{fault.name} was not acted on"
    if fault.corrupt_at is not None:
        assert "rollback" in dict(sync.actions).values(), sync.actions
    # the lagged path returns the step before's decision, and says which step is pending
    assert lagged.returned[0].pending_step == 0 and lagged.returned[1].step == 0
    for d in lagged.returned[1:]:  # after a rollback, nothing is pending: the first call says so
        first = d.reason == "judged at the next call"
        assert d.action == "rollback" or d.pending_step == (d.step if first else d.step + 1)


def test_lagged_path_writes_the_same_files(tmp_path):
    fault = FAULTS[1]
    train(fault, "sync", run_dir=tmp_path / "sync", recovery={"checkpoint_every": 50})
    train(fault, "lagged", run_dir=tmp_path / "lagged", recovery={"checkpoint_every": 50})

    def lines(name: str, which: str) -> list[dict[str, Any]]:
        rows = read_jsonl(tmp_path / which / name)
        for row in rows:
            for key in ("time", "step_time_s", "wall_time", "data_wait_s", "ts"):
                row.pop(key, None)
        return rows

    sync_metrics, lagged_metrics = lines("metrics.jsonl", "sync"), lines("metrics.jsonl", "lagged")
    assert [r["step"] for r in lagged_metrics] == [r["step"] for r in sync_metrics]
    assert [r.get("loss") for r in lagged_metrics] == [r.get("loss") for r in sync_metrics]
    assert [r.get("action") for r in lagged_metrics] == [r.get("action") for r in sync_metrics]
    kinds = [(e["step"], e["kind"]) for e in lines("events.jsonl", "sync")]
    assert [(e["step"], e["kind"]) for e in lines("events.jsonl", "lagged")] == kinds
    sync_ckpt = sorted(p.name for p in (tmp_path / "sync" / "checkpoints").iterdir())
    assert sorted(p.name for p in (tmp_path / "lagged" / "checkpoints").iterdir()) == sync_ckpt


def test_a_halt_comes_one_call_later_or_at_close(tmp_path):
    halting = {"policy": {"halt_on": ["loss_spike"]}}
    with pytest.raises(tg.TrainingHalted) as raised:
        train(FAULTS[1], "lagged", **halting)
    assert raised.value.decision.step == 150  # decided on the spike's own figures
    # a halt on the last step launched is recorded when the guard closes, and close() returns
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = tg.Guard(model, opt, config={"console": False, "hot_path": "lagged"}, run_dir=tmp_path)
    x = torch.randn(8, 4)
    loss = (model(x) * math.nan).mean()
    loss.backward()
    assert guard.step(loss).pending_step == 0
    guard.config.policy.max_consecutive_nonfinite = 1
    guard.policy.config.max_consecutive_nonfinite = 1
    guard.close()
    events = read_jsonl(tmp_path / "events.jsonl")
    assert any(e["kind"] == "halt" for e in events), "the pending step's halt was not recorded"
    assert guard.action_counts["halt"] == 1


def test_judge_pending_judges_the_pending_step():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = tg.Guard(model, opt, config={"console": False, "hot_path": "lagged"})
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    guard.step(loss)
    decision = guard.judge_pending()
    assert decision is not None and decision.step == 0 and decision.action == "step"
    assert decision.pending_step is None and guard.judge_pending() is None
    guard.close()


def test_lagged_path_reads_nothing_blocking_and_syncs_no_device(monkeypatch):
    """Every figure reaches the host through the pinned copy one call later: no `resolve` that
    reads the device itself, and no device-wide or stream synchronize."""
    blocking: list[int] = []
    resolve = GradientStats.resolve

    def counted(self: GradientStats, m: Any, values: list[float] | None = None) -> Any:
        if values is None:
            blocking.append(1)
        return resolve(self, m, values)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a device-wide or stream sync on the step path")

    monkeypatch.setattr(GradientStats, "resolve", counted)
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", refuse)
    run = train(FAULTS[4], "lagged", steps=200)
    assert not blocking, f"{len(blocking)} blocking reads on the lagged path"
    assert "rollback" in dict(run.actions).values()
    sync_reads: list[int] = []
    monkeypatch.setattr(
        GradientStats, "resolve", lambda s, m, v=None: (sync_reads.append(1), resolve(s, m, v))[1]
    )
    train(FAULTS[0], "sync", steps=20)
    assert len(sync_reads) == 20, "the synchronous path reads once a step"


def test_hot_path_auto_keeps_the_cpu_synchronous_and_lagged_says_what_it_needs():
    model = nn.Linear(4, 1)
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    guard = tg.Guard(model, fused, config={"console": False})
    assert guard._lagged is None, "auto chose the lagged path off a GPU"
    guard.close()
    foreach = torch.optim.AdamW(model.parameters(), foreach=True)
    with pytest.raises(tg.TrainguardError, match="fused=True"):
        tg.Guard(model, foreach, config={"console": False, "hot_path": "lagged"})
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(tg.TrainguardError, match="GradScaler"):
        tg.Guard(model, fused, scaler=scaler, config={"console": False, "hot_path": "lagged"})
    with pytest.raises(tg.TrainguardError, match="skip_on names loss_above_ema"):
        tg.Guard(
            model,
            fused,
            config={
                "console": False,
                "hot_path": "lagged",
                "policy": {"skip_on": ["loss_above_ema"]},
            },
        )


def _streams() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Loss and grad-norm streams: noisy decays with spikes, bursts and a rising stretch."""
    out = []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        t = np.arange(2500)
        loss = 3 * np.exp(-t / 700) + 1 + 0.02 * rng.standard_normal(len(t))
        grad = np.exp(0.3 * rng.standard_normal(len(t)))
        hit = rng.random(len(t)) < 0.01
        loss[hit] *= rng.uniform(1.01, 3, hit.sum())
        burst = rng.random(len(t)) < 0.01
        grad[burst] *= rng.uniform(2, 50, burst.sum())
        loss[1000:1030] += np.linspace(0, 0.3, 30)
        out.append((f"synthetic-{seed}", loss, grad))
    for path in sorted(CURVES.glob("*.csv"))[:4]:
        table = np.genfromtxt(path, delimiter=",", names=True)
        names = table.dtype.names or ()
        if "loss" not in names:
            continue
        loss = np.asarray(table["loss"], dtype=float)
        grad = np.asarray(table["grad_norm"], dtype=float) if "grad_norm" in names else None
        out.append((path.stem, loss, grad if grad is not None else np.ones(len(loss))))
    return out


@pytest.mark.parametrize(
    "name,loss,grad", _streams(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_gate_bounds_agree_with_the_detectors_at_every_step(name, loss, grad):
    """A figure over a detector's bound is exactly a figure that raises its event."""
    spikes, grads = LossSpikeDetector(), GradSpikeDetector()
    fired = 0
    for step, (value, g) in enumerate(zip(loss.tolist(), grad.tolist(), strict=True)):
        loss_bound, grad_bound = spikes.gate_bound(), grads.gate_bound()
        point = MetricPoint(step=step, loss=value, grad_norm=g)
        raised = any(e.kind == "loss_spike" for e in spikes.update(point))
        assert raised == (value > loss_bound) or not math.isfinite(value), (name, step)
        raised_g = any(e.kind == "grad_spike" for e in grads.update(point))
        assert raised_g == (g > grad_bound) or not math.isfinite(g), (name, step)
        fired += raised + raised_g
    if name.startswith("synthetic"):
        assert fired >= 10, "the streams raise too little to test the bounds"


def test_the_policy_composes_the_bounds_and_stops_skipping_at_its_limit():
    suite = DetectorSuite(tg.GuardConfig())
    policy = tg.GuardConfig().policy
    from trainguard.policy import StepPolicy

    p = StepPolicy(policy)
    for step in range(300):
        suite.update(MetricPoint(step=step, loss=2.0 + 0.01 * math.sin(step), grad_norm=1.0))
    bounds = p.gate_bounds(suite.detectors)
    assert 2.0 < bounds["loss"] < math.inf and 1.0 < bounds["grad_norm"] < math.inf
    p.consecutive_skips = policy.max_consecutive_skips
    assert p.gate_bounds(suite.detectors) == {"loss": math.inf, "grad_norm": math.inf}


def test_lint_suggests_a_fused_optimizer_on_a_gpu(monkeypatch):
    from trainguard.diagnosis import lint as lint_module

    model = nn.Linear(4, 1)
    foreach = torch.optim.AdamW(model.parameters(), foreach=True)
    codes = [f.code for f in lint_module.lint(model, foreach)]
    assert "unfused-optimizer" not in codes, "said off a GPU, where a read costs no idle time"
    monkeypatch.setattr(lint_module, "on_gpu", lambda optimizer: True)
    codes = [f.code for f in lint_module.lint(model, foreach)]
    assert "unfused-optimizer" in codes
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    assert "unfused-optimizer" not in [f.code for f in lint_module.lint(model, fused)]


def test_an_ordinary_lagged_step_reads_nothing_from_the_device():
    """On a CPU standing in for a device (`fake_device`): an ordinary lagged step reads only
    the host buffer the last step's copy landed in, uploads nothing and syncs nothing."""
    from fake_device import (
        count_host_reads,
        count_uploads,
        forbid_syncs,
        mark_host,
        mark_optimizer_steps,
    )
    from trainguard.signals.host_reads import reads_counted

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = tg.Guard(model, opt, config={"console": False, "hot_path": "lagged"})
    assert guard._lagged is not None
    x = torch.randn(4, 8)
    seen: list[tuple[Any, ...]] = []
    for step in range(12):
        loss = model(x).pow(2).mean()
        loss.backward()
        for buffer in guard._lagged.buffers:
            mark_host(buffer)
        with (
            count_host_reads(stacks=True) as reads,
            reads_counted() as counted,
            count_uploads(raise_on_upload=True),
            forbid_syncs(),
        ):
            guard.step(loss)
        opt.zero_grad()
        if step < 2:  # the step counts exist after the first update; buffers after the first copy
            mark_optimizer_steps(opt)
            continue
        seen.append((reads.total, counted["now"], counted["lagged"]))
        assert reads.total == 0, reads.stacks
    guard.close()
    assert seen == [(0, 0, 1)] * 10, "an ordinary lagged step: one read of a landed copy only"


def _nan_traced(hot_path: str, tmp_path: Path) -> tuple[list[tuple[int, str]], list[str], Any]:
    """An MLP whose Tanh's output takes log(0) with the batch of attempt 40, traced by a
    replay."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    armed = {"on": False}

    def poison(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out + torch.log(torch.zeros_like(out[..., :1])) if armed["on"] else out

    model[1].register_forward_hook(poison)
    guard = tg.Guard(
        model,
        opt,
        config={"console": False, "hot_path": hot_path},
        run_dir=tmp_path / hot_path,
    )
    gen = torch.Generator().manual_seed(1)
    actions: list[tuple[int, str]] = []
    for attempt in range(60):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)

        def forward(x: torch.Tensor = x, y: torch.Tensor = y, bad: bool = attempt == 40) -> Any:
            armed["on"] = bad  # the fault comes with this batch: a replay meets it again
            try:
                return nn.functional.mse_loss(model(x), y)
            finally:
                armed["on"] = False

        loss = forward()
        loss.backward()
        decision = guard.step(loss, replay=forward)
        if decision.action != "step":
            actions.append((decision.step, decision.action))
        opt.zero_grad(set_to_none=True)
    guard.close()
    origins = [
        e["message"]
        for e in read_jsonl(tmp_path / hot_path / "events.jsonl")
        if e["kind"] == "nan_origin"
    ]
    return actions, origins, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_nan_is_traced_the_same_on_the_lagged_path(tmp_path):
    """The replay of a NaN step comes a call later, from the weights the gated step left, and
    keeps the gradients of the step measured since."""
    sync = _nan_traced("sync", tmp_path)
    lagged = _nan_traced("lagged", tmp_path)
    assert sync[0] == [(40, "skip")] and lagged[0] == sync[0]
    assert len(sync[1]) == 1 and lagged[1] == sync[1], "the trace named another origin"
    assert "1" in sync[1][0]  # the poisoned module
    assert torch.equal(lagged[2], sync[2])


def _resumable(run_dir: Path, steps: int, resume: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    config = tg.GuardConfig(
        console=False, hot_path="lagged", recovery={"checkpoint_every": 40, "snapshot_every": 15}
    )
    guard = (
        tg.Guard.resume(run_dir, model, opt, config=config)
        if resume
        else tg.Guard(model, opt, config=config, run_dir=run_dir)
    )
    gen = torch.Generator().manual_seed(2)
    data = [
        (torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(200)
    ]
    for x, y in guard.batches(data):
        if guard.global_step >= steps:
            break
        loss = nn.functional.mse_loss(model(x) + 0.01 * torch.randn(16, 1), y)  # RNG in the step
        loss.backward()
        guard.step(loss)
        opt.zero_grad(set_to_none=True)
    guard.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_run_resumed_from_a_lagged_checkpoint_follows_the_same_trajectory(tmp_path):
    """A checkpoint taken when its step is judged (after the next forward) holds the data
    position and RNGs from before that forward: a resumed run goes on bit for bit."""
    straight = _resumable(tmp_path / "straight", 100, resume=False)
    _resumable(tmp_path / "killed", 60, resume=False)  # its newest checkpoint: step 40
    resumed = _resumable(tmp_path / "killed", 100, resume=True)
    assert torch.equal(resumed, straight)
