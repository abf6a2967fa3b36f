"""The pieces of recovery on their own: data rewind, LR cuts, snapshots, policy rules."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg
from trainguard.actions import OptimizerActions
from trainguard.actions.data import GuardedBatches, sized_skip
from trainguard.actions.quarantine import Quarantine
from trainguard.actions.snapshots import SnapshotRing, budget_interval
from trainguard.config import PolicyConfig, RecoveryConfig
from trainguard.detectors import MetricPoint
from trainguard.detectors.base import Detector
from trainguard.events import Decision, Event
from trainguard.policy import StepPolicy

from helpers import read_jsonl


def first_values(batches) -> list[int]:
    return [int(b[0][0]) for b in batches]


def test_shuffled_dataloader_rewinds_to_the_same_order_and_skips():
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=2, shuffle=True)
    wrapped = GuardedBatches(loader)
    seen: list[int] = []
    state = None
    for batch in wrapped:
        seen.append(int(batch[0][0]))
        if wrapped.current == 5:
            state = wrapped.state()  # the position after batch 5
        if wrapped.current == 12 and len(seen) == 13:
            torch.rand(100)  # the training consumed randomness meanwhile
            wrapped.rewind(state, skip=(8, 10))
    reference = first_values(_iterate_with_seed(loader, 0))
    assert seen[:13] == reference[:13]
    assert seen[13:] == reference[6:8] + reference[10:]  # rewound to 6, skipped 8 and 9


def _iterate_with_seed(loader, seed):
    torch.manual_seed(seed)
    return list(loader)


class StatefulSource:
    """The protocol of torchdata's StatefulDataLoader: state_dict/load_state_dict resume."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.next = 0
        self.loads = 0

    def __iter__(self):
        while self.next < self.n:
            value = self.next
            self.next += 1
            yield value
        self.next = 0

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.loads += 1
        self.next = state["next"]


def test_stateful_source_is_rewound_from_its_state():
    source = StatefulSource(10)
    wrapped = GuardedBatches(source, ids=lambda b: [b])
    seen = []
    for value in wrapped:
        seen.append(value)
        if value == 3:
            state = wrapped.state()
        if value == 6 and seen.count(6) == 1:
            wrapped.rewind(state, skip=(5, 6))
    assert seen == [0, 1, 2, 3, 4, 5, 6, 4, 6, 7, 8, 9]
    assert source.loads == 1


def test_one_shot_iterator_cannot_be_rewound():
    wrapped = GuardedBatches(iter(range(10)))
    with pytest.raises(tg.TrainguardError, match="re-iterable"):
        for value in wrapped:
            if value == 4:
                wrapped.rewind({"position": 1}, None)


def test_quarantined_batches_are_never_handed_out():
    wrapped = GuardedBatches(
        [[1, 2], [3, 4], [5, 6]], ids=lambda b: b, quarantined=lambda ids: 3 in ids
    )
    assert list(wrapped) == [[1, 2], [5, 6]]


def test_lr_cut_rides_on_top_of_the_schedule_and_rewarms():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    actions = OptimizerActions(opt, sched, max_grad_norm=None)
    p.grad = torch.zeros(1)
    actions.step(0.0)  # schedule: 1/2
    actions.cut_lr(0.5, rewarm_steps=4)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    lrs = []
    for _ in range(5):
        actions.step(0.0)
        lrs.append(opt.param_groups[0]["lr"])
    schedule = [1 / 3, 1 / 4, 1 / 5, 1 / 6, 1 / 7]
    scale = [0.625, 0.75, 0.875, 1.0, 1.0]  # from 0.5 back to 1 over 4 steps
    assert lrs == pytest.approx([a * b for a, b in zip(schedule, scale, strict=True)])
    assert sched.get_last_lr()[0] == pytest.approx(1 / 7)  # the scheduler never saw our cut


def test_a_kept_lr_cut_is_the_ceiling_a_later_rewarm_climbs_back_to():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    actions = OptimizerActions(opt, None, max_grad_norm=None)
    p.grad = torch.zeros(1)
    actions.cut_lr(0.5)  # kept: a repeated incident
    actions.step(0.0)
    assert actions.lr_scale == pytest.approx(0.5)
    actions.cut_lr(0.5, rewarm_steps=2)  # re-warms to 0.5, not to the schedule's 1.0
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    actions.step(0.0)
    actions.step(0.0)
    actions.step(0.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    restored = OptimizerActions(opt, None, max_grad_norm=None)
    restored.load_state_dict(actions.state_dict())
    assert restored.lr_scale == pytest.approx(0.5) and restored.lr_ceiling == pytest.approx(0.5)


def test_a_held_cut_keeps_the_lr_from_climbing_through_a_warmup_then_follows_the_decay():
    p = nn.Parameter(torch.zeros(1))
    frozen = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [frozen], "lr": torch.tensor(0.3)}], lr=1.0)
    # a warmup to the peak (1.0) over 10 steps, then a halving every step
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / 10 if s < 10 else 0.5 ** (s - 9)
    )
    actions = OptimizerActions(opt, sched, max_grad_norm=None)
    p.grad, frozen.grad = torch.zeros(1), torch.zeros(1)
    for _ in range(3):
        actions.step(0.0)  # schedule: 0.4 after three steps
    actions.cut_lr(0.5, hold=True)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    lrs = []
    for _ in range(9):
        actions.step(0.0)
        lrs.append(opt.param_groups[0]["lr"])
    # held at 0.2 while the warmup climbs to 1.0; then the decay, from 0.2 at its peak's scale
    assert lrs == pytest.approx([0.2] * 6 + [0.1, 0.05, 0.025])
    assert actions.lr_scale == pytest.approx(0.2)
    assert sched.get_last_lr()[0] == pytest.approx(0.125)  # the scheduler never saw the cut
    assert isinstance(opt.param_groups[1]["lr"], torch.Tensor)  # a tensor LR: scaled, not read
    restored = OptimizerActions(opt, sched, max_grad_norm=None)
    restored.load_state_dict(actions.state_dict())
    assert actions.lr_hold is not None and actions.lr_hold[0] == pytest.approx(0.2)
    assert restored.lr_hold == actions.lr_hold and actions.lr_hold[1] is None
    # a plain cut (recovery's) lets the warmup raise the LR as before
    plain = OptimizerActions(opt, None, max_grad_norm=None)
    plain.load_state_dict({k: v for k, v in actions.state_dict().items() if k != "lr_hold"})
    assert plain.lr_hold is None


def test_an_lr_cut_holds_under_a_schedule_the_guard_does_not_step():
    """A Trainer steps its own LambdaLR after each optimizer step, resetting the LR: the cut
    still applies to the LR the optimizer steps with, on top of the schedule's new value."""
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    actions = OptimizerActions(opt, None, max_grad_norm=None)  # the guard does not own it
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))
    p.grad = torch.zeros(1)
    actions.cut_lr(0.5)
    for _ in range(3):
        actions.step(0.0)
        sched.step()  # the Trainer's own schedule, after the step
    assert used == pytest.approx([0.5, 0.5 * 0.9, 0.5 * 0.81])


def test_a_first_rollback_rewarms_its_lr_cut_and_a_repeat_keeps_it():
    rec = RecoveryConfig(snapshot_every=10)
    policy = StepPolicy(PolicyConfig(), rec)
    assert policy.recovery.rewarm_steps == 20  # sized: 2x the snapshot interval

    def explosion(step: int) -> Decision:
        event = Event(
            step=step, kind="loss_spike", severity="critical", message="", type="gradient_explosion"
        )
        return policy.decide(MetricPoint(step=step, loss=9.0), [event], can_roll_back=True)

    first, repeat = explosion(100), explosion(130)
    assert first.action == repeat.action == "rollback"
    assert first.rewarm_steps == 20 and repeat.rewarm_steps == 0
    later = explosion(100 + rec.rollback_window + 50)  # the window has passed: a first again
    assert later.rewarm_steps == 20
    off = StepPolicy(PolicyConfig(), RecoveryConfig(snapshot_every=10, rewarm_steps=0))
    event = Event(
        step=5, kind="loss_spike", severity="critical", message="", type="gradient_explosion"
    )
    assert off.decide(MetricPoint(step=5, loss=9.0), [event], True).rewarm_steps == 0


def test_snapshot_restores_weights_optimizer_and_random_state_exactly():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ring = SnapshotRing(2)
    snap = ring.take(7, model, opt, None, None, {"x": 1}, {"position": 3})
    weights = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    ring.restore(snap, model, opt, None, None)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert all(torch.equal(opt.state[model.weight][k], v) for k, v in state.items())
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws
    assert snap.nbytes > 0 and ring.newest_at_or_before(6) is snap  # the oldest when none fits


def test_policy_rolls_back_after_three_nonfinite_steps_in_fifty():
    policy = StepPolicy(recovery=RecoveryConfig(nonfinite_rollback=3, nonfinite_window=50))
    actions = []
    for step in (10, 30, 55):
        point = MetricPoint(step=step, loss=math.nan)
        actions.append(policy.decide(point, [], can_roll_back=True).action)
    assert actions == ["skip", "skip", "rollback"]
    far = StepPolicy()
    assert [
        far.decide(MetricPoint(step=s, loss=math.nan), [], True).action for s in (0, 60, 120)
    ] == [
        "skip",
        "skip",
        "skip",
    ]


def test_policy_cuts_lr_on_oscillation_without_rollback():
    policy = StepPolicy()
    event = Event(step=5, kind="oscillation", severity="warning", message="swings")
    decision = policy.decide(MetricPoint(step=5, loss=2.0), [event], can_roll_back=True)
    assert decision.action == "step" and decision.lr_factor == 0.5
    second = policy.decide(MetricPoint(step=6, loss=2.0), [event], can_roll_back=True)
    assert second.lr_factor == pytest.approx(0.5**1.1)


def test_no_snapshot_means_no_rollback_yet():
    policy = StepPolicy()
    event = Event(step=5, kind="divergence", severity="critical", message="rising")
    assert (
        policy.decide(MetricPoint(step=5, loss=2.0), [event], can_roll_back=False).action == "step"
    )


def test_snapshots_stay_on_schedule_after_a_warning_and_never_land_inside_an_incident():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = tg.GuardConfig(console=False, recovery=RecoveryConfig(snapshot_every=10, snapshots=4))
    guard = tg.Guard(model, opt, config=cfg)
    x = torch.ones(3, 2)
    for step in range(40):
        loss = model(x).sum() * (100.0 if step == 25 else 1.0)
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
    snapshots = guard.ring.snapshots
    assert [s.step for s in snapshots] == [10, 20, 30, 40]  # 30 too, after the spike at 25
    assert [s.last_warning for s in snapshots] == [None, None, 25, None]
    ring = guard.ring
    assert ring.target_for(45, 10).step == 30  # a snapshot after an earlier warning serves
    assert ring.target_for(35, 10).step == 20  # the margin first
    assert ring.target_for(15, 10).step == 10  # else the newest at or before the first step
    assert ring.target_for(9, 0) is None  # never one inside the incident


def spike(step: int, kind: str, type_: str, z: float = 50.0, spike_step: int | None = None):
    metrics = {"z_score": z, "z_threshold": 10.0}
    if spike_step is not None:
        metrics = {"spike_step": spike_step}
    return Event(
        step=step, kind=kind, severity="warning", message=kind, type=type_, metrics=metrics
    )


def test_a_warning_alone_never_quarantines_its_follow_up_does_and_a_revision_releases():
    policy = StepPolicy()
    onset = policy.decide(MetricPoint(10, 9.0), [spike(10, "loss_spike", "data_toxicity")], True)
    assert onset.action == "skip" and onset.suspect and not onset.quarantine
    quiet = policy.decide(MetricPoint(11, 1.0), [], True)
    assert quiet.quarantine_step is None and quiet.release_step is None
    confirmed = policy.decide(
        MetricPoint(15, 1.0), [spike(15, "spike_classified", "data_toxicity", spike_step=10)], True
    )
    assert confirmed.quarantine and confirmed.quarantine_step == 10
    revised = policy.decide(
        MetricPoint(30, 1.0), [spike(30, "spike_classified", "optimizer", spike_step=10)], True
    )
    assert revised.release_step == 10 and not revised.quarantine
    # a suspect re-typed before any confirmation is released too (it was only skipped)
    policy.decide(MetricPoint(40, 9.0), [spike(40, "loss_spike", "data_toxicity")], True)
    explosion = policy.decide(
        MetricPoint(45, 9.0),
        [spike(45, "spike_classified", "gradient_explosion", spike_step=40)],
        True,
    )
    assert explosion.action == "rollback" and explosion.release_step == 40
    assert explosion.quarantine_step is None


def test_a_spike_under_the_z_threshold_is_skipped_but_never_held_for_quarantine():
    policy = StepPolicy()
    weak = policy.decide(
        MetricPoint(10, 0.6), [spike(10, "loss_spike", "data_toxicity", z=1.3)], True
    )
    assert weak.action == "skip" and not weak.suspect
    later = policy.decide(
        MetricPoint(15, 0.3), [spike(15, "spike_classified", "data_toxicity", spike_step=10)], True
    )
    assert later.quarantine_step is None
    # a clean noisy regression's hard batch: 3x the mean, z 5.7 (over the ratio rule's floor of
    # 5, under the z rule's 10); skipped, but its confirmation takes nothing away for good
    hard = spike(20, "loss_spike", "data_toxicity", z=5.7)
    hard.metrics.update(rule="ratio", ratio_min_z=5.0, ratio=3.0)
    onset = policy.decide(MetricPoint(20, 0.27), [hard], True)
    assert onset.action == "skip" and not onset.suspect
    confirmed = policy.decide(
        MetricPoint(25, 0.06), [spike(25, "spike_classified", "data_toxicity", spike_step=20)], True
    )
    assert confirmed.quarantine_step is None


def test_a_confirmed_explosion_without_a_snapshot_before_it_cuts_the_lr_once():
    policy = StepPolicy()
    confirmed = spike(56, "spike_classified", "gradient_explosion", spike_step=51)
    before_51 = {51: False}.get
    decision = policy.decide(MetricPoint(56, 5.0), [confirmed], lambda s: before_51(s, True))
    assert decision.action == "step" and decision.unrolled_incident == 51
    assert decision.lr_factor == 0.5
    again = policy.decide(MetricPoint(57, 5.0), [confirmed], lambda s: s != 51)
    assert again.lr_factor is None  # one cut per incident
    with_target = policy.decide(MetricPoint(58, 5.0), [confirmed], True)
    assert with_target.action == "rollback" and with_target.rollback_to == 41


def test_recovery_sizes_follow_the_run_length_unless_set():
    assert RecoveryConfig().sized(300).snapshot_every == 15
    assert RecoveryConfig().sized(70).snapshot_every == 10
    assert RecoveryConfig().sized(300_000).snapshot_every == 50
    assert RecoveryConfig().sized(None).snapshot_every == 50
    assert RecoveryConfig(snapshot_every=7).sized(300_000).snapshot_every == 7


def test_skips_are_a_small_share_of_what_is_left_and_never_past_the_end():
    assert sized_skip(200, 180, 0.02) == 3
    assert sized_skip(200, 20, 0.02) == 1  # at least one
    assert sized_skip(200, 0, 0.02) == 0  # nothing left to skip
    assert sized_skip(200, 299_000, 0.02) == 200  # the configured most
    assert sized_skip(200, None, 0.02) == 200
    assert GuardedBatches(list(range(30))).left_after(9) == 20
    assert GuardedBatches(iter(range(30))).left_after(9) is None


class PlantedEvents(Detector):
    """A stub detector: the events planted at given steps, raised once each (a replayed step
    after a rollback raises nothing)."""

    name = "planted"

    def __init__(self, planted: dict[int, list[Event]]) -> None:
        self.planted = planted

    def update(self, point: MetricPoint) -> list[Event]:
        return [dataclasses.replace(e, step=point.step) for e in self.planted.pop(point.step, [])]


def guarded_linear(run_dir, planted, **recovery):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = tg.GuardConfig(console=False, recovery=RecoveryConfig(**recovery))
    guard = tg.Guard(model, opt, config=cfg, run_dir=run_dir)
    guard.detectors.detectors.append(PlantedEvents(planted))
    data = [(torch.randn(8, 4), torch.randn(8, 1), [f"b{i}"]) for i in range(60)]
    return model, opt, guard, data


def train_linear(model, opt, guard, batches):
    for x, y, ids in batches:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.step(loss, batch_ids=ids)
        opt.zero_grad()


def test_a_planted_toxic_spike_is_quarantined_only_after_its_confirmation(tmp_path):
    planted = {
        20: [spike(0, "loss_spike", "data_toxicity")],
        25: [spike(0, "spike_classified", "data_toxicity", spike_step=20)],
        40: [spike(0, "spike_classified", "architecture", spike_step=20)],
    }
    model, opt, guard, data = guarded_linear(tmp_path, planted, enabled=False)
    train_linear(model, opt, guard, data[:24])
    assert guard.action_counts["skip"] == 1 and not (tmp_path / "quarantine.jsonl").exists()
    assert guard.quarantine.suspects  # held, skipped, not written
    train_linear(model, opt, guard, data[24:30])
    (record,) = read_jsonl(tmp_path / "quarantine.jsonl")
    assert record["step"] == 20 and record["confirmed_at"] == 25 and record["batch_ids"] == ["b20"]
    assert guard.quarantine.contains(["b20"])
    train_linear(model, opt, guard, data[30:])
    guard.close()
    records = read_jsonl(tmp_path / "quarantine.jsonl")
    assert [r.get("action") for r in records] == [None, "release"]  # appended, never rewritten
    assert not guard.quarantine.contains(["b20"])
    found = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "quarantine"]
    assert [(e["step"], e["metrics"]["released"]) for e in found] == [(25, False), (40, True)]
    # a restarted run honours the release: the batch comes back
    again = Quarantine(tmp_path / "quarantine.jsonl")
    source = [[f"b{i}"] for i in range(25)]
    assert len(list(GuardedBatches(source, ids=lambda b: b, quarantined=again.contains))) == 25


def test_an_earlier_release_quarantine_file_still_quarantines(tmp_path):
    path = tmp_path / "quarantine.jsonl"
    path.write_text('{"step": 3, "reason": "loss spike", "loss": 9.0, "batch_ids": ["b3"]}\n')
    assert Quarantine(path).contains(["b3"])


def test_an_explosion_with_no_snapshot_before_it_says_so_and_cuts_the_lr(tmp_path):
    planted = {
        12: [spike(0, "loss_spike", "gradient_explosion")],
        17: [spike(0, "spike_classified", "gradient_explosion", spike_step=12)],
    }
    model, opt, guard, data = guarded_linear(tmp_path, planted, snapshot_every=50)
    train_linear(model, opt, guard, data[:30])
    guard.close()
    kinds = [(e["step"], e["kind"]) for e in read_jsonl(tmp_path / "events.jsonl")]
    assert (12, "rollback_unavailable") in kinds and (12, "lr_reduced") in kinds
    assert [k for _, k in kinds].count("lr_reduced") == 1  # the follow-up adds no second cut
    assert guard.action_counts["rollback"] == 0
    assert guard.actions.lr_scale == 0.5 and opt.param_groups[0]["lr"] == pytest.approx(0.005)


def test_a_rollback_skips_a_share_of_the_data_left_and_the_end_of_the_data_is_an_event(tmp_path):
    planted = {33: [spike(0, "loss_spike", "gradient_explosion")]}
    model, opt, guard, data = guarded_linear(tmp_path, planted, snapshot_every=10)
    source = guard.batches(data, ids=lambda b: b[2])
    train_linear(model, opt, guard, source)
    guard.close()
    found = read_jsonl(tmp_path / "events.jsonl")
    (rollback,) = [e for e in found if e["kind"] == "rollback"]
    (skipped,) = [e for e in found if e["kind"] == "data_skipped"]
    assert rollback["metrics"]["to_step"] == 20
    assert skipped["metrics"]["first"] == 33 and skipped["metrics"]["count"] == 2  # 1 + 1
    assert skipped["metrics"]["left"] == 26 and "not 200" in skipped["message"]
    (ended,) = [e for e in found if e["kind"] == "data_exhausted"]
    assert ended["metrics"]["skipped"] == 2 and ended["step"] == 58  # 60 batches, 2 skipped
    # no total_steps: a pass of 60 batches is no plan (a run of several passes ends each one)
    assert ended["metrics"]["planned_steps"] is None and ended["metrics"]["data_length"] == 60
    assert ended["severity"] == "info" and "a pass of the data is 60 batches" in ended["message"]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_stateful_dataloader_from_torchdata_is_rewound_from_its_state():
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    loader = StatefulDataLoader(TensorDataset(torch.arange(40)), batch_size=2, shuffle=True)
    wrapped = GuardedBatches(loader)
    assert wrapped.stateful
    seen: list[int] = []
    for batch in wrapped:
        seen.append(int(batch[0][0]))
        if wrapped.current == 5:
            state = wrapped.state()
        if wrapped.current == 12 and len(seen) == 13:
            torch.rand(100)
            wrapped.rewind(state, skip=(8, 10))
    torch.manual_seed(0)
    fresh = StatefulDataLoader(TensorDataset(torch.arange(40)), batch_size=2, shuffle=True)
    reference = [int(b[0][0]) for b in fresh]
    assert seen == reference[:13] + reference[6:8] + reference[10:]


def test_a_sudden_explosion_rolls_back_to_just_before_its_jump_a_built_up_one_keeps_the_margin():
    policy = StepPolicy(recovery=RecoveryConfig(snapshot_every=10))
    revised = spike(53, "spike_classified", "gradient_explosion", spike_step=51)
    revised.metrics["previous_type"] = "data_toxicity"  # a jump with no build-up
    sudden = policy.decide(MetricPoint(53, 5.0), [revised], True)
    assert sudden.action == "rollback" and sudden.rollback_to == 50  # before the update at 50
    built_up = spike(90, "loss_spike", "gradient_explosion")
    built_up.metrics["since_step"] = 88  # a lasting jump: its first elevated step
    onset = policy.decide(MetricPoint(90, 5.0), [built_up], True)
    assert onset.action == "rollback" and onset.rollback_to == 78  # rollback_margin 10


def test_snapshots_come_as_often_as_their_budget_allows_only_where_the_data_goes_on():
    assert budget_interval(0.003, 0.0135, 0.01, 3, 10) == 10  # a fifth of a step: the sized one
    assert budget_interval(0.0002, 0.01, 0.01, 3, 10) == 3  # cheap: down to what the ring needs
    assert budget_interval(0.0005, 0.01, 0.01, 3, 10) == 5
    assert budget_interval(0.0002, 0.01, 0.0, 3, 10) == 10  # a budget of 0 keeps the sized one
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = tg.GuardConfig(console=False, diagnosis={"total_steps": 200})
    guard = tg.Guard(model, opt, config=config)
    assert guard.snapshot_interval == 10  # nothing measured yet
    guard.recovery.snapshot_seconds = 0.0001
    guard.recovery.step_times.extend([0.05] * 5)
    assert not guard.rewinds_data and guard.snapshot_interval == 3  # (5 + 1) / (3 - 1) steps
    (spikes,) = [d for d in guard.detectors.detectors if d.name == "loss_spike"]
    assert spikes.confirm_steps == 2  # each step waited is lost where the data goes on
    guard.batches(list(range(200)))
    assert guard.rewinds_data and guard.snapshot_interval == 10  # a rollback replays the data
    assert spikes.confirm_steps == 0  # the whole window: a short fault ends before the replay
    fixed = tg.GuardConfig(console=False, recovery={"snapshot_every": 7})
    pinned = tg.Guard(model, opt, config=fixed)
    pinned.recovery.snapshot_seconds = 0.0001
    pinned.recovery.step_times.extend([0.05] * 5)
    assert pinned.snapshot_interval == 7  # the user's interval is kept


def _unrewound_lm(run_dir, burst: range) -> tg.Guard:
    """TinyGPT trained 100 steps in a plain loop over a list (no guard.batches: a rollback
    cannot rewind the data), the LR x100 on the iterations of `burst`."""
    from trainguard.demo import scenarios
    from trainguard.demo.model import TinyGPT

    data = scenarios.corpus()
    batches = list(data.batches(8, 16, 100, seed=3))
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = tg.GuardConfig(console=False, recovery={"snapshot_every": 3})
    guard = tg.Guard(model, opt, config=config, run_dir=run_dir)
    original = opt.step
    for iteration, batch in enumerate(batches):
        opt.step = (  # type: ignore[method-assign]
            functools.partial(scenarios.scaled_step, opt, original, 100.0)
            if iteration in burst
            else original
        )
        loss = model.loss(model(batch.x), batch.y)
        loss.backward()
        guard.step(loss, batch_ids=batch.ids)
        opt.zero_grad(set_to_none=True)
    opt.step = original  # type: ignore[method-assign]
    guard.close()
    return guard


def test_a_rollback_where_the_data_goes_on_lands_just_before_the_jump(tmp_path):
    clean = _unrewound_lm(tmp_path / "clean", range(0))
    assert clean.action_counts["skip"] == clean.action_counts["rollback"] == 0
    _unrewound_lm(tmp_path / "burst", range(60, 62))
    found = read_jsonl(tmp_path / "burst" / "events.jsonl")
    (first, *_) = [e for e in found if e["kind"] == "loss_spike"]
    (revised, *_) = [e for e in found if e["kind"] == "spike_classified"]
    assert first["step"] == 61 and first["type"] == "data_toxicity"
    assert revised["step"] == 63 and revised["type"] == "gradient_explosion"  # 2 steps, not 5
    (rollback, *_) = [e for e in found if e["kind"] == "rollback"]
    assert rollback["metrics"]["to_step"] == 60  # the state before the first bad update
    assert rollback["metrics"]["lost_batches"] == 4  # 60..63, no more: the data goes on


def test_two_rollbacks_to_the_same_snapshot_find_it_whole(tmp_path):
    """A rollback restores a copy of the snapshot: training on after it (which moves the weights
    and the detectors' state) leaves the snapshot as it was, so a second incident that rolls back
    to the same snapshot restores the very same state."""
    planted = {33: [spike(0, "loss_spike", "gradient_explosion")]}
    model, opt, guard, data = guarded_linear(
        tmp_path, planted, snapshot_every=10, rollback_margin=4
    )
    restored = []
    for x, y, ids in guard.batches(data, ids=lambda b: b[2]):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        decision = guard.step(loss, batch_ids=ids)
        opt.zero_grad()
        if decision.action == "rollback":
            state = {k: v.clone() for k, v in model.state_dict().items()}
            restored.append((guard.global_step, state, copy.deepcopy(guard.detectors.state_dict())))
            if len(restored) == 1:  # a second incident before the next snapshot is taken
                planted[27] = [spike(0, "loss_spike", "gradient_explosion")]
    guard.close()
    assert [step for step, _, _ in restored] == [20, 20]
    (_, first, first_detectors), (_, second, second_detectors) = restored
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert first_detectors == second_detectors
