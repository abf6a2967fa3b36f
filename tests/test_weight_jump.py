"""Weight jumps: a layer group's weights moving in one step far past their own steps (an LR burst
hidden inside the optimizer, a write outside it), seen where the loss says nothing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

import trainguard as tg
from trainguard.config import WeightJumpConfig
from trainguard.detectors import DetectorSuite, MetricPoint
from trainguard.detectors.weights import WeightJumpDetector


def stream(steps: int, jumps: dict[int, float], seed: int = 0) -> list[MetricPoint]:
    """Two groups drifting by ~0.1% a step; at the steps in `jumps`, group "head" x factor."""
    rng = torch.Generator().manual_seed(seed)
    norms = {"body": 10.0, "head": 2.0}
    points = []
    for step in range(steps):
        for name in norms:
            norms[name] *= 1 + 1e-3 * float(torch.randn((), generator=rng))
        if step in jumps:
            norms["head"] *= jumps[step]
        points.append(MetricPoint(step=step, loss=1.0, group_param_norms=dict(norms)))
    return points


def run(detector: WeightJumpDetector, points: list[MetricPoint]) -> list[tg.Event]:
    return [e for p in points for e in detector.update(p)]


def test_a_steady_drift_is_left_alone() -> None:
    assert run(WeightJumpDetector(), stream(2000, {})) == []


def test_a_write_outside_the_optimizer_is_named_at_its_step() -> None:
    events = run(WeightJumpDetector(), stream(400, {150: 1000.0, 300: 0.01}))
    assert [(e.step, e.kind, e.severity) for e in events] == [
        (150, "weight_jump", "warning"),
        (300, "weight_jump", "warning"),  # learned: a second write as bad warns again
    ]
    assert events[0].metrics["group"] == "head"
    assert math.isclose(events[0].metrics["ratio"], 1000.0, rel_tol=0.01)
    assert "the weights of layer group head moved x" in events[0].message


def test_shrinking_weights_warn_too_and_a_burst_is_one_incident() -> None:
    events = run(WeightJumpDetector(), stream(300, {100: 0.01}))
    assert [e.step for e in events] == [100] and "shrank 100-fold" in events[0].message
    burst = {s: 3.0 for s in range(200, 205)}  # five steps of an LR far over its schedule
    events = run(WeightJumpDetector(), stream(400, burst))
    assert [e.step for e in events] == [200]


def test_the_run_own_moves_set_the_limit() -> None:
    """A group that moves 1.6x now and then is flagged at its first 1.6x only, and at 10x again;
    nothing is judged during the warm-up, when the first updates move fresh weights most."""
    wobbly = {s: 1.6 if s % 40 == 0 else 1.0 for s in range(1, 600)}
    assert [e.step for e in run(WeightJumpDetector(), stream(600, wobbly))] == [40]
    events = run(WeightJumpDetector(), stream(600, {**wobbly, 500: 10.0}))
    assert [e.step for e in events] == [40, 500]
    early = {s: 5.0 for s in range(1, 10)}
    assert run(WeightJumpDetector(WeightJumpConfig(warmup=20)), stream(100, early)) == []


def test_a_small_burst_on_a_fitted_model_is_named_though_fresh_weights_moved_more() -> None:
    """A fitted model's weights creep (~1e-5 a step); an LR x100 moves them ~0.4% a step, under
    what the fresh weights moved in the first steps of training and growing step by step as
    Adam's moments follow. The early moves are forgotten; the burst warns at its first step,
    once; the same run without it is left alone."""
    rng = torch.Generator().manual_seed(3)

    def fitted(burst: bool) -> list[MetricPoint]:
        norm, points = 5.0, []
        for step in range(400):
            early = 0.01 * math.exp(-step / 15)  # fresh weights: 1% a step, settling
            move = early + 1e-5 * (1 + abs(float(torch.randn((), generator=rng))))
            if burst and 250 <= step < 255:
                move = 0.004 * (1 + 0.4 * (step - 250))  # x1.004, then larger each step
            norm *= 1 + move
            points.append(MetricPoint(step=step, loss=1e-4, group_param_norms={"head": norm}))
        return points

    events = run(WeightJumpDetector(), fitted(burst=True))
    assert [(e.step, e.kind) for e in events] == [(250, "weight_jump")]
    assert 1.003 < events[0].metrics["ratio"] < 1.005
    assert run(WeightJumpDetector(), fitted(burst=False)) == []


def test_a_warm_restart_of_the_lr_explains_the_jump_it_makes() -> None:
    """The LR the run gives jumping x10 (a warm restart) moves the weights x10 further: no
    warning; the same jump with the LR unchanged (a burst inside the optimizer) warns."""
    points = stream(400, {s: 1.02 for s in range(300, 303)})
    for p in points:
        p.lr = 1e-3 if 300 <= p.step < 350 else 1e-4
    assert run(WeightJumpDetector(), points) == []
    for p in points:
        p.lr = 1e-4
    assert [e.step for e in run(WeightJumpDetector(), points)] == [300]


def test_zero_and_non_finite_norms_give_no_ratio() -> None:
    detector = WeightJumpDetector()
    points = stream(100, {})
    for p in points[:50]:  # a zero-initialised group that starts to grow at step 50
        assert p.group_param_norms is not None
        p.group_param_norms["lora_b"] = 0.0
    for i, p in enumerate(points[50:]):
        assert p.group_param_norms is not None
        p.group_param_norms["lora_b"] = 1e-6 * (i + 1) if i != 10 else math.nan
    assert run(detector, points) == []


def test_a_scalar_crossing_zero_is_not_a_jump_but_a_write_to_it_is() -> None:
    """A lone scalar bias drifting across zero (|b| from 0.03 through 1e-5 and back) changes its
    norm x1000 in ratio, but little against its own size: no warning; a x1000 write to it warns."""
    rng = torch.Generator().manual_seed(5)

    def scalar(write_at: int | None) -> list[MetricPoint]:
        points = []
        for step in range(600):
            bias = 0.03 * math.cos(step / 40) + 1e-4 * float(torch.randn((), generator=rng))
            if step == 317:
                bias = 1e-5  # passes close to zero
            if write_at is not None and step >= write_at:
                bias *= 1000
            norms = {"body": 10.0 * (1 + 1e-4 * step), "scale": abs(bias)}
            points.append(MetricPoint(step=step, loss=1.0, group_param_norms=norms))
        return points

    assert run(WeightJumpDetector(), scalar(None)) == []
    events = run(WeightJumpDetector(), scalar(write_at=450))
    assert [(e.step, e.metrics["group"]) for e in events] == [(450, "scale")]


def test_state_round_trips_mid_stream() -> None:
    points = stream(300, {250: 50.0})
    first = WeightJumpDetector()
    run(first, points[:200])
    second = WeightJumpDetector()
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [e.step for e in run(second, points[200:])] == [250]


def test_the_suite_skips_logs_without_weight_norms() -> None:
    """A log (no weight norms) passes through the bulk path untouched; a guarded run's points
    (with them) raise the same events in bulk as step by step."""
    from trainguard.detectors.series import MetricSeries

    points = stream(300, {250: 50.0})
    series = MetricSeries(
        steps=torch.arange(300).numpy(),
        loss=torch.ones(300, dtype=torch.float64).numpy(),
        group_param_norms=[p.group_param_norms for p in points],
    )
    bulk = [e for e in DetectorSuite().run(series) if e.kind == "weight_jump"]
    assert [e.step for e in bulk] == [250]
    plain = MetricSeries(steps=series.steps, loss=series.loss)
    assert WeightJumpDetector().advance(plain, 0) == 300


# -- a guarded run ------------------------------------------------------------------------------


def fitted_classifier(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
    """An MLP that fits separable data: its loss is near 0 and a x1000 write barely moves it."""
    torch.manual_seed(seed)
    x = torch.randn(64 * 40, 8)
    y = (x[:, 0] > 0).long()
    x[:, 0] += 3 * (2 * y - 1)  # a wide margin: the fit is confident and stays right at x1000
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, len(x), 64)]
    return model, opt, batches * 4


def train(
    tmp_path: Path, fault: str | None, at: int = 100, steps: int = 140
) -> tuple[list[dict[str, Any]], list[str]]:
    model, opt, batches = fitted_classifier(0)
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False), run_dir=tmp_path)
    factor = {"now": 1.0}

    def burst_on(*_: Any) -> None:  # an LR x100 inside the optimizer's step: the guard never
        for g in opt.param_groups:  # reads it (a bug in a fused optimizer, corrupted state)
            g["lr"] *= factor["now"]

    def burst_off(*_: Any) -> None:
        for g in opt.param_groups:
            g["lr"] /= factor["now"]

    opt.register_step_pre_hook(burst_on)
    opt.register_step_post_hook(burst_off)
    actions = []
    for step, (x, y) in enumerate(batches[:steps]):
        if fault == "write" and step == at:
            with torch.no_grad():
                model[2].weight.mul_(1000)
        factor["now"] = 100.0 if fault == "burst" and at <= step < at + 3 else 1.0
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        actions.append(guard.step(loss).action)
        opt.zero_grad(set_to_none=True)
    guard.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["severity"] != "info"], actions


def test_a_guarded_fitted_model_names_a_write_to_its_last_layer(tmp_path: Path) -> None:
    events, actions = train(tmp_path, "write")
    jumps = [e for e in events if e["kind"] == "weight_jump"]
    assert [(e["step"], e["metrics"]["group"]) for e in jumps] == [(100, "2")]
    assert jumps[0]["metrics"]["ratio"] > 500
    assert set(actions) == {"step"}  # a warning: the loss did not move, nothing is undone


def test_a_guarded_run_sees_an_lr_burst_the_loss_does_not_show(tmp_path: Path) -> None:
    events, _ = train(tmp_path, "burst")
    assert [e["step"] for e in events if e["kind"] == "weight_jump"] == [101]


def test_a_clean_guarded_run_has_no_weight_jump(tmp_path: Path) -> None:
    events, actions = train(tmp_path, None, steps=160)
    assert events == [] and set(actions) == {"step"}
