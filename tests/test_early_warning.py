"""The `precursor` early warning on synthetic streams, and on a tiny transformer trained at too
high an LR; the preemptive actions, off by default, taken once when switched on."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

import trainguard as tg
from trainguard.actions.optimizer_step import OptimizerActions
from trainguard.actions.preempt import Preemption
from trainguard.actions.preemptive import PreemptiveActions
from trainguard.analysis.analyzer import analyze
from trainguard.analysis.logs import read_log
from trainguard.config import PrecursorWarningConfig, PreemptConfig
from trainguard.demo.data import TextCorpus
from trainguard.detectors.base import MetricPoint
from trainguard.detectors.precursors import PrecursorWarningDetector, theil_sen
from trainguard.detectors.series import MetricSeries
from trainguard.detectors.suite import DetectorSuite
from trainguard.events import ConfigError, Decision, Event, PreemptCall, TrainguardError
from trainguard.policy import StepPolicy

EVERY = 50  # steps between sampled steps, the probe's default


def _stream(values: list[float], signal: str = "max_logit", layer: str = "blocks.1") -> list[Event]:
    """The warnings a fresh detector raises over one sample per `EVERY` steps."""
    detector = PrecursorWarningDetector()
    events: list[Event] = []
    for i, value in enumerate(values):
        step = i * EVERY
        for s in range(step - EVERY + 1, step):  # the steps between samples carry none
            if s > 0:
                assert detector.update(MetricPoint(step=s, loss=2.0)) == []
        point = MetricPoint(step=step, loss=2.0, precursors={signal: {layer: value}})
        events.extend(detector.update(point))
    return events


def test_rising_logit_warns_once_with_a_sane_estimate_of_the_steps_left() -> None:
    rng = np.random.default_rng(0)
    # 5 % growth per sampled step (50 steps) from 10: reaches 100 at sample 47, step 2350
    values = [10.0 * 1.05**i * (1 + 0.01 * rng.standard_normal()) for i in range(60)]
    events = _stream(values)
    assert len(events) == 2  # heading there, then once more when it passes critical
    warning, passed = events
    crossing = next(i for i, v in enumerate(values) if v >= 100.0) * EVERY
    assert passed.step == crossing and passed.metrics["steps_left"] == 0
    assert "is past its critical level 100" in passed.message
    # the loss stays at 2.0 and the logit under 10x critical: weighed as info (issue 37)
    assert warning.kind == "precursor" and {warning.severity, passed.severity} == {"info"}
    m = warning.metrics
    assert m["layer"] == "blocks.1" and m["signal"] == "max_logit" and m["critical"] == 100.0
    assert 25.0 <= m["value"] < 100.0  # within 4x of critical
    actual_left = crossing - warning.step
    assert actual_left >= 100  # ahead of time
    # a linear extrapolation of an accelerating rise: too long, never too short, within 2x
    assert actual_left <= m["steps_left"] <= 2 * actual_left
    assert "blocks.1" in warning.message and "max_logit" in warning.message


def test_a_signal_that_shoots_past_critical_before_the_window_is_full_is_warned_of() -> None:
    """The first `window` samples hold no trend to read: a logit that goes from far under
    critical to past it there is warned of after `confirm` samples past it, not after the
    window."""
    values = [0.1, 2.0, 8.0, 40.0, 150.0, 230.0, 400.0, 600.0, 900.0]
    events = _stream(values)
    assert len(events) == 1
    (warning,) = events
    assert warning.step == 6 * EVERY  # the third sample past 100; the window (12) is not full
    assert "is past its critical level 100" in warning.message
    assert warning.metrics["steps_left"] == 0 and warning.metrics["slope_per_step"] > 0


def test_a_signal_past_critical_from_the_start_does_not_warn() -> None:
    """A pretrained model's layer whose max logit sits past critical from the first sample, and
    stays: nothing rose, nothing to warn of."""
    rng = np.random.default_rng(3)
    values = [130.0 + 5.0 * rng.standard_normal() for _ in range(60)]
    assert _stream(values) == []


def test_a_noisy_flat_stream_does_not_warn() -> None:
    rng = np.random.default_rng(1)
    values = [40.0 + 6.0 * rng.standard_normal() for _ in range(400)]
    assert _stream(values) == []


def test_slowing_growth_does_not_warn() -> None:
    rng = np.random.default_rng(2)
    # rises fast from 20 and levels off at 60: each window's newer half rises at under half the
    # older half's rate
    values = [60.0 - 40.0 * math.exp(-i / 4.0) + 0.2 * rng.standard_normal() for i in range(80)]
    assert _stream(values) == []


def test_a_signal_far_from_critical_does_not_warn() -> None:
    values = [1.0 * 1.1**i for i in range(20)]  # fast, but 6.7 at most: not within 4x of 100
    assert _stream(values) == []


def test_falling_entropy_warns() -> None:
    values = [2.0 * 0.93**i for i in range(60)]  # towards 0.1 from above
    events = _stream(values, signal="attn_entropy", layer="blocks.0")
    assert len(events) == 2  # heading there; then past it (under 0.1), said once
    assert events[0].metrics["signal"] == "attn_entropy" and events[0].metrics["value"] <= 0.4
    assert "falling towards" in events[0].message and events[1].metrics["value"] <= 0.1
    assert "past its critical level 0.1" in events[1].message


def test_a_layer_that_grows_back_past_critical_after_a_rescale_is_warned_of_again() -> None:
    """Warned of at ~40, rescaled to 12 (inside the episode: fewer quiet samples than the
    window), then growing again: a warning when it passes critical, so the policy may act again;
    none while it stays past."""
    rise = [10.0 * 1.08**i for i in range(25)]  # to ~63: warned of
    regrow = [12.0 * 1.5**i for i in range(8)]  # 12 to ~205: past 100 at its 6th sample
    events = _stream(rise + regrow + [300.0] * 5)
    assert len(events) == 2
    assert "towards its critical level" in events[0].message
    assert events[1].step == (len(rise) + 6) * EVERY
    assert "past its critical level" in events[1].message


def test_a_new_episode_warns_again_after_the_signal_settles() -> None:
    rise = [10.0 * 1.08**i for i in range(25)]
    settled = [12.0] * 30  # e.g. after a qk rescale
    events = _stream(rise + settled + rise)
    assert len(events) == 2


def test_state_dict_round_trip_keeps_the_episode() -> None:
    values = [10.0 * 1.06**i for i in range(40)]  # up to 97: short of critical
    detector = PrecursorWarningDetector(PrecursorWarningConfig())
    first = []
    for i, v in enumerate(values[:36]):
        first += detector.update(MetricPoint(i * EVERY, 2.0, precursors={"max_logit": {"a": v}}))
    assert len(first) == 1
    restored = PrecursorWarningDetector()
    restored.load_state_dict(detector.state_dict())
    later = []
    for i, v in enumerate(values[36:], start=36):
        later += restored.update(MetricPoint(i * EVERY, 2.0, precursors={"max_logit": {"a": v}}))
    assert later == []  # the episode goes on: no second warning


def test_theil_sen_ignores_an_outlier() -> None:
    x = np.arange(12.0)
    y = 2.0 * x + 1.0
    y[5] = 100.0
    slope, intercept = theil_sen(x, y)
    assert abs(slope - 2.0) < 1e-9 and abs(intercept - 1.0) < 1e-9


# -- a tiny transformer trained at too high an LR ----------------------------------------------


class _Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = 1, d
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        out: torch.Tensor = self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return out


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2, self.attn = nn.LayerNorm(d), nn.LayerNorm(d), _Attention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class _LM(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(2))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


SEQ, STEPS, WARMUP = 16, 150, 120


def _train(
    lr: float, preempt: dict[str, Any] | None = None
) -> tuple[list[float], list[Event], tg.Guard, list[float]]:
    """The losses, events and LRs of the tiny LM trained under a watching Guard (no skip, no
    rollback) with the probe on every 5 steps."""
    torch.manual_seed(0)
    corpus = TextCorpus.load()
    model = _LM(corpus.vocab_size, SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    config = tg.GuardConfig(
        console=False,
        policy={"skip_on": []},
        recovery={"enabled": False},
        diagnosis={"lint": False},
        precursors={"every": 5, **({"preempt": preempt} if preempt is not None else {})},
    )
    losses: list[float] = []
    events: list[Event] = []
    lrs: list[float] = []  # the LR each step's update used
    with tg.Guard(model, opt, sched, config=config) as guard:
        for batch in corpus.batches(8, SEQ, STEPS, seed=1):
            logits = model(batch.x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.y.reshape(-1))
            loss.backward()
            lrs.append(opt.param_groups[0]["lr"])
            events += guard.step(loss).events
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    return losses, events, guard, lrs


@functools.cache
def _run(preempt: tuple[str, ...] | None) -> tuple[list[float], list[Event], dict[str, Any]]:
    """The tiny LM at LR 0.6 (its attention logits grow until the loss climbs back), watched
    only or with `preempt` actions, once a session; and what the guard's actions hold after."""
    losses, events, guard, lrs = _train(
        0.6, None if preempt is None else {"actions": list(preempt)}
    )
    assert guard.preemption is not None and guard.actions is not None
    held = {
        "lr_scale": guard.actions.lr_scale,
        "rescales": list(guard.preemption.rescales),
        "z_loss": guard.preemption.z_loss_weight,
        "policy": guard.policy.state_dict()["preempted"],
        "lrs": lrs,
    }
    return losses, events, held


def _spike(losses: list[float]) -> int | None:
    """The first step where the loss's EMA is 5% over its lowest so far (the benchmark's rule)."""
    ema, lowest = math.nan, math.inf
    for i, x in enumerate(losses):
        ema = x if math.isnan(ema) else 0.9 * ema + 0.1 * x
        if i > 20 and ema > 1.05 * lowest:
            return i
        lowest = min(lowest, ema)
    return None


def test_a_tiny_model_at_too_high_an_lr_is_warned_of_before_its_loss_spikes() -> None:
    losses, events, held = _run(None)
    spike = _spike(losses)
    warnings = [e for e in events if e.kind == "precursor"]
    assert spike is not None and warnings
    assert warnings[0].step < spike
    assert warnings[0].metrics["signal"] in ("max_logit", "attn_entropy", "block_rms")
    # off by default: nothing touched
    assert not [e for e in events if e.kind == "preemption"]
    assert {k: v for k, v in held.items() if k != "lrs"} == {
        "lr_scale": 1.0,
        "rescales": [],
        "z_loss": None,
        "policy": {},
    }


def test_preemptive_actions_switched_on_act_once_a_warning_and_keep_the_run_finite() -> None:
    losses, events, held = _run(("qk_rescale", "lr_cut"))
    assert all(math.isfinite(x) for x in losses)
    warnings = [e for e in events if e.kind == "precursor" and e.severity == "warning"]
    taken = [e for e in events if e.kind == "preemption"]
    assert taken and warnings
    assert taken[0].step == warnings[0].step  # on the warning's own step, after its update
    # each action once per warning episode and layer
    keys = [(e.step, e.metrics["action"], e.metrics["layer"]) for e in taken]
    assert len(keys) == len(set(keys))
    lr_cuts = [e for e in taken if e.metrics["action"] == "lr_cut"]
    assert len(lr_cuts) <= len({e.step for e in warnings})
    # a cut during the warmup holds: the LR never climbs past its value right after the cut
    first = lr_cuts[0].step
    assert first + 1 < WARMUP
    # (the schedule's LR for step first + 1 is 0.6 * (first + 2) / WARMUP)
    assert held["lrs"][first + 1] == pytest.approx(0.5 * 0.6 * (first + 2) / WARMUP)
    assert max(held["lrs"][first + 1 :]) == pytest.approx(held["lrs"][first + 1])
    assert held["lr_scale"] <= 0.5 ** len(lr_cuts)
    # the warnings' own rescales said one by one, the clipping kept up after them summed up
    said = [e for e in taken if e.metrics["action"] == "rescale_qk" and "summary" not in e.metrics]
    summed = sum(e.metrics.get("rescales", 0) for e in taken if "summary" in e.metrics)
    assert len(said) + summed <= len(held["rescales"])
    assert held["policy"]  # in the guard's state: a resumed run does not repeat them
    # the guard's own rescale of W_q and W_k is no weight jump (a write outside the optimizer)
    rescaled = {e.step for e in taken if e.metrics["action"] == "rescale_qk"}
    assert rescaled and not [e for e in events if e.kind == "weight_jump"]


def _warning(step: int, layer: str, value: float, signal: str = "max_logit") -> Event:
    return Event(
        step=step,
        kind="precursor",
        severity="warning",
        message="",
        metrics={"layer": layer, "signal": signal, "value": value},
    )


def test_the_policy_preempts_only_when_switched_on_and_once_a_warning() -> None:
    point = MetricPoint(500, 2.0, precursors={"max_logit": {"0": 40.0, "1": 20.0, "2": 31.0}})
    assert StepPolicy().decide(point, [_warning(500, "0", 40.0)]).preempt == []  # default: off
    policy = StepPolicy(preempt=PreemptConfig(actions=["qk_rescale", "lr_cut"]))
    calls = policy.decide(point, [_warning(500, "0", 40.0)]).preempt
    assert [(c.action, c.layer) for c in calls] == [
        ("lr_cut", "0"),
        ("qk_rescale", "0"),
        ("qk_rescale", "2"),  # past qk_threshold (25) too; layer 1 (20) is not
    ]
    assert calls[1].factor == 15.0 / 40.0 and calls[0].factor == 0.5
    # the same warning again (a replayed step; a restored policy remembers): no second LR cut,
    # only the clipping of the layers still past qk_threshold (a rollback restored their weights)
    restored = StepPolicy(preempt=PreemptConfig(actions=["qk_rescale", "lr_cut"]))
    restored.load_state_dict(policy.state_dict())
    replayed = restored.decide(point, [_warning(500, "0", 40.0)]).preempt
    assert [(c.action, c.layer) for c in replayed] == [("qk_rescale", "0"), ("qk_rescale", "2")]
    # a later episode's warning acts again
    later = MetricPoint(900, 2.0, precursors={"max_logit": {"0": 45.0}})
    assert len(restored.decide(later, [_warning(900, "0", 45.0)]).preempt) == 2
    # z-loss only on a log Z warning, qk_rescale only on a max-logit one
    z = StepPolicy(preempt=PreemptConfig(actions=["z_loss", "qk_rescale"]))
    z_point = MetricPoint(100, 2.0, precursors={"log_z": {"output": 12.0}})
    (call,) = z.decide(z_point, [_warning(100, "output", 12.0, "log_z")]).preempt
    assert call.action == "z_loss"


def test_a_skipped_step_takes_no_preemptive_action() -> None:
    policy = StepPolicy(preempt=PreemptConfig(actions=["lr_cut"]))
    point = MetricPoint(10, math.nan, precursors={"max_logit": {"0": 40.0}})
    decision = policy.decide(point, [_warning(10, "0", 40.0)])
    assert decision.action == "skip" and decision.preempt == []


def test_preempt_config_is_checked() -> None:
    with pytest.raises(ValidationError):
        PreemptConfig(actions=["lr_cut", "lr_cut"])
    # actions that could never run: a one-line error that says which switch is off
    with pytest.raises(
        ConfigError,
        match=r"^config: precursors: preempt.actions \['lr_cut'\] "
        r"act on precursor warnings, but precursors.warning.enabled is false",
    ):
        tg.GuardConfig.of(
            {"precursors": {"warning": {"enabled": False}, "preempt": {"actions": ["lr_cut"]}}}
        )
    with pytest.raises(ValidationError):
        PreemptConfig(qk_threshold=10.0, qk_target=20.0)
    with pytest.raises(ValidationError):
        PrecursorWarningConfig(critical={"max_logits": 100.0})
    assert tg.GuardConfig().precursors.preempt.actions == []  # off by default


def test_the_suite_runs_it_offline_as_live() -> None:
    values = [10.0 * 1.06**i for i in range(50)]  # towards critical, then past it (at 40)
    steps = np.arange(50 * EVERY)
    column: list[dict[str, dict[str, float]] | None] = [None] * len(steps)
    for i, v in enumerate(values):
        column[i * EVERY] = {"max_logit": {"0": v}}
    series = MetricSeries(steps, np.full(len(steps), 2.0), precursors=column)
    offline = [e for e in DetectorSuite().run(series) if e.kind == "precursor"]
    live_suite = DetectorSuite()
    live = [e for i in range(len(steps)) for e in live_suite.update(series.point(i))]
    live = [e for e in live if e.kind == "precursor"]
    assert len(offline) == 2 and [e.step for e in offline] == [e.step for e in live]
    assert [e.metrics for e in offline] == [e.metrics for e in live]


def test_analyze_reads_the_precursors_of_a_guarded_runs_log(tmp_path: Path) -> None:
    rows = []
    for step in range(40 * EVERY):  # up to 97: short of critical
        row: dict[str, Any] = {"step": step, "loss": 2.0 - 1e-4 * step, "action": "step"}
        if step % EVERY == 0:
            row["precursors"] = {"max_logit": {"0": 10.0 * 1.06 ** (step // EVERY)}}
        rows.append(json.dumps(row))
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    data = read_log(tmp_path / "metrics.jsonl")
    assert data.precursors is not None and sum(p is not None for p in data.precursors) == 40
    found = [e for e in analyze(data).events if e.kind == "precursor"]
    assert len(found) == 1 and found[0].metrics["layer"] == "0"


class _NoLayers:
    """A preemption whose model has no such layer and no head."""

    def rescale_qk(
        self, step: int, layer: str, factor: float, max_logit: float | None = None
    ) -> Event:
        raise TrainguardError(f"rescale_qk: no attention layer {layer!r}")

    def enable_z_loss(self, step: int, weight: float) -> Event:
        raise TrainguardError("z-loss needs the model's output head")


def test_preemptive_actions_that_cannot_be_taken_say_so_and_raise_nothing() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = [
        PreemptCall("lr_cut", "0", "max_logit", 40.0, 0.5, 7),
        PreemptCall("qk_rescale", "9", "max_logit", 40.0, 0.4, 7),
        PreemptCall("z_loss", "output", "log_z", 12.0, None, 7),
    ]
    decision = Decision(step=7, action="step", preempt=calls)
    events = PreemptiveActions(OptimizerActions(opt), _NoLayers(), 1e-4).apply(decision)
    assert [e.kind for e in events] == ["preemption"] * 3
    assert opt.param_groups[0]["lr"] == 0.05 and events[0].metrics["lr_scale"] == 0.5
    assert "the LR 0.1 -> 0.05, held there" in events[0].message
    assert [e.metrics.get("taken", True) for e in events] == [True, False, False]
    assert "no attention layer" in events[1].message and "output head" in events[2].message
    bare = PreemptiveActions(None, None, 1e-4).apply(decision)
    assert all(e.metrics["taken"] is False for e in bare)


def test_after_a_max_logit_warning_the_policy_keeps_clipping_every_layer_past_threshold() -> None:
    policy = StepPolicy(preempt=PreemptConfig(actions=["qk_rescale"]))
    before = MetricPoint(100, 2.0, precursors={"max_logit": {"0": 60.0}})
    assert policy.decide(before, []).preempt == []  # no warning yet: no clipping
    first = MetricPoint(200, 2.0, precursors={"max_logit": {"0": 40.0, "1": 10.0}})
    assert [c.layer for c in policy.decide(first, [_warning(200, "0", 40.0)]).preempt] == ["0"]
    # later sampled steps, no warning: every layer past qk_threshold (25) is brought to 15
    later = MetricPoint(250, 2.0, precursors={"max_logit": {"0": 30.0, "1": 50.0, "2": 20.0}})
    calls = policy.decide(later, []).preempt
    assert [(c.action, c.layer, c.factor, c.warning_step) for c in calls] == [
        ("qk_rescale", "0", 15.0 / 30.0, 200),
        ("qk_rescale", "1", 15.0 / 50.0, 200),
    ]
    assert policy.decide(MetricPoint(251, 2.0), []).preempt == []  # an unsampled step
    skipped = MetricPoint(300, math.nan, precursors={"max_logit": {"0": 90.0}})
    assert policy.decide(skipped, []).preempt == []  # a skipped step takes none
    restored = StepPolicy(preempt=PreemptConfig(actions=["qk_rescale"]))
    restored.load_state_dict(policy.state_dict())
    assert [c.layer for c in restored.decide(later, []).preempt] == ["0", "1"]
    # with only an LR cut chosen, nothing is clipped
    cut_only = StepPolicy(preempt=PreemptConfig(actions=["lr_cut"]))
    cut_only.decide(first, [_warning(200, "0", 40.0)])
    assert cut_only.decide(later, []).preempt == []


def test_the_clipping_kept_up_after_a_warning_is_summed_up_not_said_a_layer_a_step() -> None:
    torch.manual_seed(0)
    model = _LM(11, SEQ)
    preemption = Preemption(model)
    actions = PreemptiveActions(None, preemption, 1e-4)
    calls = [
        PreemptCall("qk_rescale", "0", "max_logit", 40.0, 0.5, 7),  # the warning's own
        PreemptCall("qk_rescale", "1", "max_logit", 30.0, 0.5, 3),  # kept up since step 3
    ]
    events = actions.apply(Decision(step=7, action="step", preempt=calls))
    assert [e.severity for e in events] == ["warning"] and actions.rewrote_weights
    assert "its max logit 40 -> 20" in events[0].message
    assert [r["layer"] for r in preemption.rescales] == ["0", "1"]
    # both layers clipped on every sampled step (every 5) for 1500 steps: one summary in 1000
    said: list[Event] = []
    for step in range(8, 1508):
        kept = [
            PreemptCall("qk_rescale", layer, "max_logit", 30.0 + step % 7, 0.6, 7)
            for layer in ("0", "1")
            if step % 5 == 0
        ]
        said += actions.apply(Decision(step=step, action="step", preempt=kept))
    assert len(preemption.rescales) == 2 + 2 * 300
    # (layer 1 at step 7 was kept up, not warned of: the tally starts there)
    assert [(e.step, e.severity, e.metrics["rescales"]) for e in said] == [(1007, "info", 401)]
    summary = said[0]
    assert summary.metrics["since_step"] == 7 and summary.metrics["summary"] is True
    assert summary.metrics["layers"]["0"]["highest_max_logit"] == 36.0
    assert "401 rescales of 2 attention layer(s)" in summary.message
