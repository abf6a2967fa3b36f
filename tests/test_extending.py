"""A user's own event kinds and actions; observe-only `Monitor`; the one registry of kinds."""

import json
from importlib import resources

import numpy as np
import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.actions.user_actions import unregister_action
from trainguard.detectors import unregister_detector
from trainguard.detectors.series import MetricSeries
from trainguard.events import EVENT_KINDS, EventKind, events_schema_kind, known_kinds
from trainguard.policy import StepPolicy
from trainguard.sinks import Sink

from helpers import read_jsonl

EMA_SYNCED = tg.register_event_kind("mylab.ema_synced", "the EMA copy was reset after a rollback")


class SyncEmaOnRollback(tg.GuardAction):
    """Keeps an EMA copy of the weights in step with a rollback: it is reset to the restored
    weights, so it holds nothing of the undone steps."""

    name = "sync_ema"
    on = frozenset({"rollback"})
    ema: nn.Module | None = None  # the copy the training loop keeps

    def __call__(self, decision: tg.Decision, target: tg.ActionTarget) -> list[tg.Event]:
        assert self.ema is not None and target.model is not None
        self.ema.load_state_dict(target.model.state_dict())
        self.synced = getattr(self, "synced", 0) + 1
        message = f"EMA weights reset to the state restored at step {target.step}"
        return [tg.Event(step=decision.step, kind=EMA_SYNCED, severity="info", message=message)]

    def state_dict(self) -> dict[str, int]:
        return {"synced": getattr(self, "synced", 0)}


@pytest.fixture(autouse=True)
def _registered_for_each_test():
    assert tg.register_action(SyncEmaOnRollback) is SyncEmaOnRollback  # a class decorator too
    yield
    unregister_action(SyncEmaOnRollback)


def _regression_with_a_weight_write(run_dir, steps=120, write_at=60):
    """A linear model fitting noisy targets, whose weights are overwritten (x50) at `write_at`:
    a sudden incident the guard rolls back. The loop keeps an EMA copy of the weights."""
    torch.manual_seed(0)
    x = torch.randn(steps * 16, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(steps * 16, 1)
    model = nn.Linear(8, 1)
    ema = nn.Linear(8, 1)
    ema.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = tg.GuardConfig(console=False, recovery={"snapshot_every": 10})
    guard = tg.Guard(model, opt, config=cfg, run_dir=run_dir)
    (action,) = [a for a in guard.user_actions if isinstance(a, SyncEmaOnRollback)]
    action.ema = ema
    data = guard.batches(
        [(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]) for i in range(steps)]
    )
    written = False
    for xb, yb in data:
        if guard.global_step == write_at and not written:
            written = True
            with torch.no_grad():
                model.weight.mul_(50.0)
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.mul_(0.9).add_(p, alpha=0.1)
    guard.close()
    return guard, action


def test_a_registered_action_answers_a_rollback_and_its_events_are_recorded(tmp_path):
    guard, action = _regression_with_a_weight_write(tmp_path)
    events = read_jsonl(tmp_path / "events.jsonl")
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    synced = [e for e in events if e["kind"] == "mylab.ema_synced"]
    assert rollbacks, "the weight write was not rolled back"
    assert len(synced) == len(rollbacks) == action.synced
    assert [e["step"] for e in synced] == [e["step"] for e in rollbacks]
    assert guard.state_dict()["user_actions"] == {"sync_ema": {"synced": len(rollbacks)}}
    assert guard.event_counts["mylab.ema_synced"] == len(rollbacks)


def test_a_clean_run_never_calls_the_action(tmp_path):
    guard, action = _regression_with_a_weight_write(tmp_path, write_at=10**9)
    assert not hasattr(action, "synced")
    assert guard.action_counts["rollback"] == 0


def test_event_kinds_are_one_registry_with_its_schema():
    schema = json.loads(
        resources.files("trainguard").joinpath("schemas/events.schema.json").read_text()
    )
    assert schema["properties"]["kind"] == events_schema_kind()
    assert list(EVENT_KINDS) == [k.value for k in EventKind]
    assert EventKind.LOSS_SPIKE == "loss_spike" and str(EventKind.HALT) == "halt"
    assert "mylab.ema_synced" in known_kinds()


def test_a_kind_must_be_dotted_and_a_registered_one_can_drive_the_policy():
    with pytest.raises(tg.TrainguardError, match=r"mylab\.plateau"):
        tg.register_event_kind("plateau", "no dot: it could clash with a built-in kind")
    with pytest.raises(ValueError, match="unknown event kinds"):
        tg.GuardConfig(policy={"halt_on": ["mylab.never_registered"]})
    kind = tg.register_event_kind("mylab.plateau", "the loss stopped moving")
    policy = StepPolicy(tg.GuardConfig(policy={"halt_on": [kind]}).policy)
    event = tg.Event(step=3, kind=kind, severity="warning", message="flat")
    assert policy.decide(tg.MetricPoint(step=3, loss=1.0), [event]).action == "halt"


def test_a_registered_class_must_be_a_guard_action():
    with pytest.raises(tg.TrainguardError, match="GuardAction"):
        tg.register_action(dict)


def test_observe_only_is_a_monitor_and_training_calls_say_what_they_need(tmp_path):
    monitor = tg.Monitor(tg.GuardConfig(console=False), run_dir=tmp_path)
    for step in range(200):
        monitor.observe(step, loss=2.0 + 0.01 * (step % 7) + (50.0 if step == 150 else 0.0))
    monitor.close()
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert "loss_spike" in kinds and kinds[-1] == "run_closed"
    guard = tg.Guard(config=tg.GuardConfig(console=False))
    with pytest.raises(tg.TrainguardError, match="need a model, an optimizer and a run_dir"):
        guard.save_checkpoint()
    with pytest.raises(tg.TrainguardError, match=r"guard\.step needs an optimizer"):
        guard.step(torch.tensor(1.0))
    guard.close()


class _BrokenSink(Sink):
    def __init__(self) -> None:
        self.calls = 0

    def on_metrics(self, record):
        self.calls += 1
        raise OSError("the dashboard is down")


def test_a_failing_sink_is_said_once_and_dropped_and_the_run_goes_on(tmp_path, capsys):
    broken = _BrokenSink()
    monitor = tg.Monitor(tg.GuardConfig(console=False), run_dir=tmp_path, sinks=[broken])
    for step in range(50):
        monitor.observe(step, loss=1.0)
    monitor.close()
    assert broken.calls == 1 and broken not in monitor.sinks
    assert capsys.readouterr().err.count("_BrokenSink failed (OSError: the dashboard is down)") == 1
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 50


PLATEAU = tg.register_event_kind("mylab.loss_plateau", "no new best loss for `patience` steps")


class LossPlateau(tg.Detector):
    """docs/guide/extending.md's example detector, as written there."""

    name = "mylab_plateau"
    _state = ("best", "since")

    def __init__(self, patience: int = 500) -> None:
        self.patience, self.best, self.since = patience, float("inf"), 0

    def update(self, point: tg.MetricPoint) -> list[tg.Event]:
        if point.loss < self.best:
            self.best, self.since = point.loss, 0
            return []
        self.since += 1
        if self.since != self.patience:
            return []
        message = f"no new best loss ({self.best:.4g}) for {self.patience} steps"
        return [self.event(point, "warning", message, {"best": self.best}, kind=PLATEAU)]


def _plateaued_losses(steps: int = 1500) -> list[float]:
    """A loss that falls for 600 steps and then only wanders above its best."""
    rng = torch.Generator().manual_seed(0)
    noise = torch.rand(steps, generator=rng).tolist()
    return [
        3.0 - 2.0 * min(s, 600) / 600 + (0.05 + 0.01 * n if s > 600 else 0.0)
        for s, n in zip(range(steps), noise, strict=True)
    ]


def test_a_registered_detector_runs_live_in_analyze_and_drives_a_halt(tmp_path):
    tg.register_detector(LossPlateau)
    try:
        losses = _plateaued_losses()
        config = tg.GuardConfig(console=False, policy={"halt_on": [PLATEAU]})
        monitor = tg.Monitor(config, run_dir=tmp_path)
        decisions = [monitor.observe(step, loss=loss) for step, loss in enumerate(losses)]
        monitor.close()
        (halted,) = [d for d in decisions if d.action == "halt"]
        assert halted.step == 600 + 500 and halted.events[0].kind == PLATEAU
        found = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == PLATEAU]
        assert [e["step"] for e in found] == [1100] and found[0]["action"] == "halt"
        series = MetricSeries(np.arange(len(losses)), np.asarray(losses))
        bulk = [e for e in tg.DetectorSuite(tg.GuardConfig()).run(series) if e.kind == PLATEAU]
        assert [e.step for e in bulk] == [1100]
    finally:
        unregister_detector(LossPlateau)
    assert not any(isinstance(d, LossPlateau) for d in tg.DetectorSuite().detectors)


def test_a_confirmed_toxic_batch_without_ids_is_said_not_silently_kept(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(torch.randn(32, 10), torch.randn(32, 1)) for _ in range(200)]
    data[150] = (data[150][0], 1000.0 * data[150][1])  # toxic targets: no ids to name them by
    with tg.Guard(model, optimizer, config=tg.GuardConfig(console=False), run_dir=tmp_path) as g:
        for x, y in g.batches(data):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            g.step(loss)
            optimizer.zero_grad(set_to_none=True)
    events = read_jsonl(tmp_path / "events.jsonl")
    spike = next(e for e in events if e["kind"] == "loss_spike")
    assert spike["step"] == 150 and spike["action"] == "skip"
    (unnamed,) = [e for e in events if e["kind"] == "quarantine"]
    assert unnamed["severity"] == "warning" and unnamed["metrics"]["unnamed"] is True
    assert "has no ids" in unnamed["message"] and unnamed["metrics"]["spike_step"] == 150
    assert not (tmp_path / "quarantine.jsonl").exists()


def test_an_unregistered_kind_from_a_users_detector_is_one_clear_error():
    class Typo(tg.Detector):
        name = "typo"

        def update(self, point):
            return [self.event(point, "warning", "x", {}, kind="mylab.never_registered")]

    tg.register_detector(Typo)
    try:
        monitor = tg.Monitor(tg.GuardConfig(console=False))
        with pytest.raises(tg.TrainguardError, match=r"register_event_kind\('mylab\.never_reg"):
            monitor.observe(0, loss=1.0)
        monitor.close()
    finally:
        unregister_detector(Typo)


def test_a_detector_class_that_wants_arguments_says_to_register_a_factory():
    class NeedsConfig(tg.Detector):
        def __init__(self, config):
            self.config = config

    tg.register_detector(NeedsConfig)
    try:
        with pytest.raises(tg.TrainguardError, match="register a factory instead"):
            tg.DetectorSuite()
    finally:
        unregister_detector(NeedsConfig)


def test_two_action_factories_both_run_and_each_unregisters_alone():
    from trainguard.actions.user_actions import build_actions

    first, second = (lambda _config: SyncEmaOnRollback()), (lambda _config: SyncEmaOnRollback())
    tg.register_action(first)
    tg.register_action(second)
    try:
        assert len(build_actions(tg.GuardConfig())) == 3  # the fixture's class and these two
        unregister_action(first)
        assert len(build_actions(tg.GuardConfig())) == 2
    finally:
        unregister_action(first)
        unregister_action(second)
