"""The pieces of recovery on their own: data rewind, LR cuts, snapshots, policy rules."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg
from trainguard.actions import OptimizerActions
from trainguard.actions.data import GuardedBatches
from trainguard.actions.snapshots import SnapshotRing
from trainguard.config import RecoveryConfig
from trainguard.detectors import MetricPoint
from trainguard.events import Event
from trainguard.policy import StepPolicy


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
    actions = OptimizerActions(opt, sched, max_grad_norm=None, rewarm_steps=4)
    p.grad = torch.zeros(1)
    actions.step(0.0)  # schedule: 1/2
    actions.cut_lr(0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    lrs = []
    for _ in range(5):
        actions.step(0.0)
        lrs.append(opt.param_groups[0]["lr"])
    schedule = [1 / 3, 1 / 4, 1 / 5, 1 / 6, 1 / 7]
    scale = [0.625, 0.75, 0.875, 1.0, 1.0]  # from 0.5 back to 1 over 4 steps
    assert lrs == pytest.approx([a * b for a, b in zip(schedule, scale, strict=True)])
    assert sched.get_last_lr()[0] == pytest.approx(1 / 7)  # the scheduler never saw our cut


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
    SnapshotRing.restore(snap, model, opt, None, None)
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


def test_snapshots_skip_windows_with_incidents():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = tg.GuardConfig(console=False, recovery=RecoveryConfig(snapshot_every=10))
    guard = tg.Guard(model, opt, config=cfg)
    x = torch.ones(3, 2)
    for step in range(40):
        loss = model(x).sum() * (100.0 if step == 25 else 1.0)
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
    assert [s.step for s in guard.ring.snapshots] == [10, 20, 40]  # 30: its window held a spike


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
