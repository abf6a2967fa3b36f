"""The Guard's contract: step, skip and halt; clipping; GradScaler; files; errors."""

from __future__ import annotations

import json
import math
from typing import ClassVar

import jsonschema
import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.config import PolicyConfig
from trainguard.detectors import MetricPoint
from trainguard.events import Event
from trainguard.policy import StepPolicy
from trainguard.sinks import load_schema

from helpers import read_jsonl


def quiet(**kwargs) -> tg.GuardConfig:
    return tg.GuardConfig(console=False, **kwargs)


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def backward(model: nn.Module, x: torch.Tensor, poison: float | None = None) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    if poison is not None:
        loss = loss * poison
    loss.backward()
    return loss


def test_nan_gradient_leaves_weights_optimizer_state_and_scheduler_bitwise_unchanged():
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    guard = tg.Guard(model, opt, sched, config=quiet())
    x = torch.randn(4, 8)
    for _ in range(3):
        guard.step(backward(model, x))
        opt.zero_grad()
    weights = [p.detach().clone() for p in model.parameters()]
    state = {
        k: v.clone() for p in model.parameters() for k, v in opt.state[p].items() if k != "step"
    }
    steps = [opt.state[p]["step"].clone() for p in model.parameters()]
    exp_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    exp_avg_sq = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    lr, epoch = opt.param_groups[0]["lr"], sched.last_epoch

    loss = backward(model, x)
    model[0].weight.grad[0, 0] = math.nan
    decision = guard.step(loss)

    assert decision.action == "skip"
    assert [e.kind for e in decision.events] == ["nonfinite"]
    assert "0.weight" in decision.events[0].message
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p.detach(), w)
    for p, a, b, s in zip(model.parameters(), exp_avg, exp_avg_sq, steps, strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], a)
        assert torch.equal(opt.state[p]["exp_avg_sq"], b)
        assert torch.equal(opt.state[p]["step"], s)
    assert state and opt.param_groups[0]["lr"] == lr and sched.last_epoch == epoch
    assert all(p.grad is None for p in model.parameters())  # the poisoned gradient is gone


def test_clipping_matches_clip_grad_norm():
    x = torch.randn(16, 8) * 10
    ours, ref = small_model(), small_model()
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.1)
    guard = tg.Guard(ours, opt_a, config=quiet(max_grad_norm=0.25))
    for _ in range(5):
        decision = guard.step(backward(ours, x))
        opt_a.zero_grad()
        backward(ref, x)
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.25)
        opt_b.step()
        opt_b.zero_grad()
        assert decision.metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    assert float(norm) > 0.25  # clipping was active
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_clipping_off():
    x = torch.randn(16, 8) * 10
    ours, ref = small_model(), small_model()
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.01)
    guard = tg.Guard(ours, opt_a, config=quiet(max_grad_norm=None))
    guard.step(backward(ours, x))
    backward(ref, x)
    opt_b.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_persistent_nan_halts_with_diagnosis_after_flushing(tmp_path):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, config=quiet(), run_dir=tmp_path)
    x = torch.randn(4, 8)
    guard.step(backward(model, x))
    opt.zero_grad()
    actions = []
    with pytest.raises(tg.TrainingHalted) as info:
        for _ in range(10):
            actions.append(guard.step(backward(model, x, poison=math.nan)).action)
            opt.zero_grad()
    assert actions == ["skip"] * 4
    assert info.value.decision.action == "halt"
    assert "non-finite" in info.value.diagnosis and "step 5" in info.value.diagnosis
    events = [
        e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] not in ("lint", "snapshot")
    ]
    assert [e["kind"] for e in events] == ["nonfinite"] * 5 + ["halt", "run_closed"]
    assert events[-2]["message"] == info.value.diagnosis
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_policy_skip_budget_and_halt_on():
    policy = StepPolicy(PolicyConfig(max_consecutive_skips=2))
    actions = []
    for step in range(4):
        event = Event(step=step, kind="loss_spike", severity="warning", message="spike")
        actions.append(policy.decide(MetricPoint(step=step, loss=9.0), [event]).action)
    assert actions == ["skip", "skip", "step", "step"]
    assert policy.decide(MetricPoint(step=4, loss=1.0), []).action == "step"
    event = Event(step=5, kind="loss_spike", severity="warning", message="spike")
    assert policy.decide(MetricPoint(step=5, loss=9.0), [event]).action == "skip"

    policy = StepPolicy(PolicyConfig(halt_on=["divergence"]))
    event = Event(step=0, kind="divergence", severity="critical", message="rising")
    decision = policy.decide(MetricPoint(step=0, loss=3.0), [event])
    assert decision.action == "halt" and "rising" in decision.reason
    assert decision.events[0].action == "halt"
    assert event.action is None  # the policy does not edit the events it is given


def test_halt_on_divergence_raises_from_step():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = quiet(policy=PolicyConfig(halt_on=["grad_spike"]))
    guard = tg.Guard(model, opt, config=cfg)
    x = torch.randn(4, 8)
    for _ in range(25):
        guard.step(backward(model, x))
        opt.zero_grad()
    with pytest.raises(tg.TrainingHalted, match="grad_spike"):
        guard.step(backward(model, x * 100))


def test_observe_detects_from_plain_numbers_and_never_raises(tmp_path):
    guard = tg.Guard(config=quiet(policy=PolicyConfig(halt_on=["loss_spike"])), run_dir=tmp_path)
    decisions = [guard.observe(step, loss=3.0 - step * 0.001, grad_norm=1.0) for step in range(50)]
    assert all(d.action == "step" and not d.events for d in decisions)
    spike = guard.observe(50, loss=9.0, grad_norm=1.0, lr=1e-3)
    assert spike.action == "halt" and spike.events[0].kind == "loss_spike"
    logged = [(e["kind"], e["severity"]) for e in read_jsonl(tmp_path / "events.jsonl")]
    assert logged == [("loss_spike", "critical"), ("loss_above_ema", "info"), ("halt", "critical")]
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 51
    with pytest.raises(tg.TrainguardError, match="needs an optimizer"):
        guard.step(torch.tensor(1.0))


def test_grad_scaler_overflow_is_fp16_overflow_not_nan(tmp_path):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = tg.Guard(model, opt, scaler=scaler, config=quiet(), run_dir=tmp_path)
    x = torch.randn(4, 8)
    for step in range(6):
        loss = model(x).pow(2).mean()
        scaled = scaler.scale(loss * (math.inf if step == 3 else 1.0))
        scaled.backward()
        if step == 3:
            weights = [p.detach().clone() for p in model.parameters()]
        decision = guard.step(loss)
        if step == 3:
            assert decision.action == "skip"
            assert [e.kind for e in decision.events] == ["fp16_overflow"]
            assert decision.metrics["overflow"] is True
            assert decision.metrics["loss_scale"] == 2.0**10
            assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
        else:
            assert decision.action == "step" and not decision.events
        opt.zero_grad()
    assert scaler.get_scale() == 2.0**9  # halved once by the overflow
    assert not any(e["kind"] == "nonfinite" for e in read_jsonl(tmp_path / "events.jsonl"))


def test_grad_scaler_collapse_becomes_nonfinite_and_halts():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    cfg = quiet(overflow=tg.config.OverflowConfig(min_loss_scale=1.0))
    guard = tg.Guard(model, opt, scaler=scaler, config=cfg)
    x = torch.randn(4, 8)
    kinds = []
    with pytest.raises(tg.TrainingHalted):
        for _ in range(20):
            loss = model(x).pow(2).mean()
            scaler.scale(loss * math.inf).backward()
            kinds.append([e.kind for e in guard.step(loss).events])
            opt.zero_grad()
    assert kinds[:2] == [["fp16_overflow"], ["fp16_overflow"]]  # scale 4, then 2
    assert kinds[2] == ["nonfinite"]  # scale 1: collapsed


def test_user_already_unscaled_for_their_own_clipping():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    guard = tg.Guard(model, opt, scaler=scaler, config=quiet())
    loss = model(torch.randn(4, 8)).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    assert guard.step(loss).action == "step"


def test_files_follow_their_schemas(tmp_path):
    model = small_model()
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 1e-3},
            {"params": model[2].parameters(), "lr": 1e-4},
        ]
    )
    guard = tg.Guard(model, opt, config=quiet(stats_every=3), run_dir=tmp_path)
    x = torch.randn(4, 8)
    for step in range(30):
        poison = math.nan if step == 25 else (50.0 if step == 22 else None)
        guard.step(backward(model, x, poison=poison), batch_ids=[step * 10, step * 10 + 1])
        opt.zero_grad()
    guard.close()
    events = read_jsonl(tmp_path / "events.jsonl")
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert {e["kind"] for e in events} >= {"nonfinite", "loss_spike"}
    assert len(metrics) == 30
    for record in events:
        jsonschema.validate(record, load_schema("events"))
    for record in metrics:
        jsonschema.validate(record, load_schema("metrics"))
    nan_line = metrics[25]
    assert nan_line["loss"] == "nan" and nan_line["action"] == "skip"
    assert metrics[0]["lrs"] == [1e-3, 1e-4]
    assert any("update_ratio" in m for m in metrics)
    assert next(e for e in events if e["kind"] == "nonfinite")["metrics"]["batch_ids"] == [250, 251]
    config = json.loads((tmp_path / "config.json").read_text())
    assert tg.GuardConfig.model_validate(config) == guard.config


def test_schema_rejects_a_malformed_event():
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"step": 1, "kind": "nope"}, load_schema("events"))


def test_log_every_keeps_steps_with_events(tmp_path):
    guard = tg.Guard(config=quiet(log_every=10), run_dir=tmp_path)
    for step in range(40):
        guard.observe(step, loss=9.0 if step == 33 else 2.0)
    guard.close()
    steps = [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert steps == [0, 10, 20, 30, 33, 38]  # 33: the spike; 38: its follow-up classification


def test_reduce_lr_on_plateau_gets_the_loss():
    class Recording(torch.optim.lr_scheduler.ReduceLROnPlateau):
        seen: ClassVar[list[float]] = []

        def step(self, metrics, epoch=None):  # type: ignore[override]
            self.seen.append(float(metrics))
            super().step(metrics)

    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = Recording(opt)
    guard = tg.Guard(model, opt, sched, config=quiet())
    losses = []
    for _ in range(3):
        losses.append(guard.step(backward(model, torch.randn(4, 8))).metrics["loss"])
        opt.zero_grad()
    assert sched.seen == pytest.approx(losses)


def test_guard_state_dict_round_trip():
    guard = tg.Guard(config=quiet())
    for step in range(300):
        guard.observe(step, loss=2.0 + 0.01 * math.sin(step), grad_norm=1.0)
    state = json.loads(json.dumps(guard.state_dict()))
    other = tg.Guard(config=quiet())
    other.load_state_dict(state)
    assert other.global_step == 300
    a = guard.observe(300, loss=9.0)
    b = other.observe(300, loss=9.0)
    assert [(e.kind, e.message) for e in a.events] == [(e.kind, e.message) for e in b.events]


def test_clear_errors_for_bad_use():
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, config=quiet())
    with pytest.raises(tg.TrainguardError, match=r"call loss.backward\(\) before guard.step"):
        guard.step(torch.tensor(1.0))
    backward(model, torch.randn(2, 8))
    with pytest.raises(tg.TrainguardError, match="scalar loss"):
        guard.step(torch.ones(3))
    with pytest.raises(tg.TrainguardError, match=r"torch\.optim\.Optimizer"):
        tg.Guard(model, "adam")  # type: ignore[arg-type]
    with pytest.raises(tg.TrainguardError, match=r"nn\.Module"):
        tg.Guard(object(), opt)  # type: ignore[arg-type]
    with pytest.raises(tg.TrainguardError, match="no parameters"):
        tg.Guard(model, torch.optim.SGD([{"params": []}], lr=0.1))


def test_a_nan_that_does_not_come_back_on_replay_is_reported_transient(tmp_path):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, config=quiet(), run_dir=tmp_path)
    x = torch.randn(4, 8)

    def clean_loss() -> torch.Tensor:
        return model(x).pow(2).mean()

    guard.step(backward(model, x), replay=clean_loss)
    opt.zero_grad()
    decision = guard.step(backward(model, x, poison=math.nan), replay=clean_loss)  # a bit flip
    kinds = [e.kind for e in decision.events]
    assert kinds == ["nonfinite", "nan_origin"] and decision.action == "skip"
    origin = decision.events[1]
    assert origin.metrics["transient"] is True and "transient" in origin.message
    assert all(p.grad is None for p in model.parameters())  # the replay left no gradients
    logged = [
        e["kind"]
        for e in read_jsonl(tmp_path / "events.jsonl")
        if e["kind"] not in ("lint", "snapshot")
    ]
    assert logged == ["nonfinite", "nan_origin"]


def test_grad_spike_event_carries_a_per_group_gradient_report(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = tg.Guard(model, opt, config=quiet(), run_dir=tmp_path)
    x = torch.randn(4, 8)
    for _ in range(25):
        guard.step(backward(model, x))
        opt.zero_grad()
    decision = guard.step(backward(model, x * 100))
    (spike,) = [e for e in decision.events if e.kind == "grad_spike"]
    report = spike.metrics["group_report"]
    assert set(report) == {"0", "2"}
    assert decision.action == "skip"
    assert report["0"]["n"] == 2 and report["0"]["max"] >= report["0"]["mean"] > 0
    assert report["0"]["p99"] <= report["0"]["max"]
    logged = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "grad_spike")
    assert logged["metrics"]["group_report"]["2"]["n"] == 2


def test_console_prints_the_nan_origin_as_a_block():
    from io import StringIO

    from rich.console import Console

    from trainguard.sinks import ConsoleSink

    out = StringIO()
    sink = ConsoleSink(Console(file=out, width=200))
    sink.on_event(
        Event(
            step=3,
            kind="nan_origin",
            severity="critical",
            message="NaN/Inf first appeared in forward of blocks.0.mlp (Sequential)",
            metrics={"frames": ["model.py:10 in forward: return torch.log(x)"]},
            action="skip",
        )
    )
    sink.on_event(Event(step=4, kind="stall", severity="info", message="quiet"))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("trainguard step 3 CRITICAL nan_origin")
    assert lines[1].strip() == "model.py:10 in forward: return torch.log(x)"
    assert len(lines) == 2  # info events stay off the console
