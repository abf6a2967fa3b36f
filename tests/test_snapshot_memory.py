"""Snapshots in host memory allocated once and sized by a budget: no allocation after the start,
never more buffers than fit, a restore equal bit for bit, and no device-wide sync."""

from __future__ import annotations

import ast
import copy
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.actions import host_memory, snapshot_pool, snapshots
from trainguard.actions.snapshots import SnapshotRing
from trainguard.config import parse_memory
from trainguard.demo.scenarios import FAULTS, run_scenario

from helpers import read_jsonl

SRC = Path(tg.__file__).parent


def tiny_run(tmp_path: Path, steps: int, memory: str | int = "25%", spike_at: int | None = None):
    """A guarded MLP regression with snapshots every 5 steps; a loss x1000 at `spike_at`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = tg.GuardConfig(
        console=False,
        recovery={"snapshot_every": 5, "snapshots": 3, "snapshot_memory": memory},
    )
    guard = tg.Guard(model, opt, config=config, run_dir=tmp_path)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    actions = []
    for step in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        if spike_at is not None and step == spike_at:
            loss = loss * 1000
        loss.backward()
        actions.append(guard.step(loss).action)
        opt.zero_grad()
    guard.close()
    return guard, model, opt, actions


def snapshot_bytes(model: nn.Module) -> int:
    """Weights plus AdamW's two moments and step counts, each tensor aligned as laid out."""
    tensors: list[tuple[str, torch.Tensor]] = []
    snapshot_pool.flatten(model.state_dict(), "model", tensors)
    for p in model.parameters():
        for name in ("exp_avg", "exp_avg_sq"):
            tensors.append((name, torch.empty_like(p)))
        tensors.append(("step", torch.zeros(())))
    return host_memory.Layout.of(tensors).nbytes


def test_snapshots_allocate_once_and_never_hold_more_than_their_slots(tmp_path, monkeypatch):
    made: list[int] = []
    real = host_memory.allocate

    def counted(nbytes: int, pinned: bool) -> torch.Tensor:
        made.append(nbytes)
        return real(nbytes, pinned)

    monkeypatch.setattr(host_memory, "allocate", counted)
    peaks: list[int] = []
    real_take = SnapshotRing.take

    def take(self, *args, **kwargs):
        snap = real_take(self, *args, **kwargs)
        peaks.append(len(self.snapshots))
        return snap

    monkeypatch.setattr(SnapshotRing, "take", take)
    guard, model, _, _ = tiny_run(tmp_path, 60)
    assert len(peaks) == 12  # a snapshot every 5 steps
    assert made == [guard.ring.plan_made.nbytes] * 3  # three buffers, made at the first update
    assert max(peaks) == 3  # the oldest's buffer is reused: never an N+1th at the peak
    assert guard.ring.pool.held_bytes == 3 * guard.ring.plan_made.nbytes
    plan = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "snapshot"]
    assert len(plan) == 1 and plan[0]["severity"] == "info" and plan[0]["step"] == 1
    assert plan[0]["metrics"]["snapshots_fit"] == 3
    assert plan[0]["metrics"]["snapshot_bytes"] == snapshot_bytes(model)


def test_a_budget_for_two_keeps_two_at_twice_the_interval(tmp_path):
    size = 2 * 2368 + 100  # two snapshots of this model and no third (checked below)
    guard, model, _, _ = tiny_run(tmp_path, 60, memory=size)
    assert 2 * snapshot_bytes(model) <= size < 3 * snapshot_bytes(model)
    assert guard.ring.pool.held_bytes <= size and len(guard.ring.pool.slots) == 2
    assert guard.snapshot_interval == 10  # the ring reaches back 10 steps, as 3 every 5 did
    assert [s.step for s in guard.ring.snapshots] == [50, 60]
    plan = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "snapshot")
    assert plan["severity"] == "warning" and "2 of 3 fit" in plan["message"]
    assert "every 10 steps instead of 5" in plan["message"]


def test_no_snapshot_fits_so_a_spike_is_skipped_with_an_lr_cut_and_that_is_said(tmp_path):
    guard, _, _, actions = tiny_run(tmp_path, 40, memory=64, spike_at=30)
    assert guard.ring.snapshots == deque_empty() and guard.ring.pool.held_bytes == 0
    assert "rollback" not in actions
    events = read_jsonl(tmp_path / "events.jsonl")
    plan = next(e for e in events if e["kind"] == "snapshot")
    assert plan["severity"] == "warning" and "none fits" in plan["message"]
    assert "skipped with an LR cut" in plan["message"]
    assert actions[30] == "skip"


def deque_empty():
    return type(snapshots.SnapshotRing(1).snapshots)()


def test_one_slot_is_replaced_only_after_a_healthy_window(tmp_path, monkeypatch):
    taken: list[int] = []
    real_take = SnapshotRing.take

    def take(self, step, *args, **kwargs):
        taken.append(step)
        return real_take(self, step, *args, **kwargs)

    monkeypatch.setattr(SnapshotRing, "take", take)
    size = 2400  # one snapshot of this model fits
    guard, model, _, actions = tiny_run(tmp_path, 40, memory=size, spike_at=21)
    assert snapshot_bytes(model) <= size < 2 * snapshot_bytes(model)
    assert actions[21] == "skip" and len(guard.ring.pool.slots) == 1
    assert taken[:4] == [5, 10, 15, 20]  # on schedule while healthy
    # after the spike at 21 the one slot (step 20, before it) is kept until 5 steps pass
    # without a warning: 25 and 30 were due inside that window and not taken
    assert taken == [5, 10, 15, 20, 27, 32, 37]  # 27: the first step 5 clear of it
    assert [s.step for s in guard.ring.snapshots] == [37]
    # the one snapshot serves only an incident that began a margin after it (1 for a sudden
    # one): one at its own step may hold the update that made it (no checkpoint to fall on)
    assert guard.recovery.has_target(38) and not guard.recovery.has_target(37)
    assert guard.ring.target_for(37, 10) is not None  # what a ring of several would allow


def test_one_slot_undoes_a_sudden_lr_burst_from_the_snapshot_before_it(tmp_path):
    config = tg.GuardConfig(
        console=False, recovery={"snapshot_memory": 409600, "checkpoint_every": 0}
    )  # one TinyGPT snapshot (360 KiB) fits, and no durable checkpoint is written
    out = run_scenario(FAULTS["LR x100 for 10 steps"], run_dir=tmp_path, steps=300, config=config)
    events = read_jsonl(tmp_path / "events.jsonl")
    assert len(out.guard.ring.pool.slots) == 1
    assert [e["metrics"]["to_step"] for e in events if e["kind"] == "rollback"] == [250, 250]
    assert out.guard.action_counts["halt"] == 0
    assert not [e for e in events if e["kind"] == "rollback_unavailable"]
    plan = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "snapshot")
    assert plan["severity"] == "warning" and "1 of 3 fits" in plan["message"]


@pytest.mark.parametrize("fused", [False, True])
def test_restore_in_place_equals_load_state_dict_bit_for_bit(fused):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    x = torch.randn(8, 6)

    def steps(n: int) -> None:
        for _ in range(n):
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    steps(2)
    ring = SnapshotRing(2)
    snap = ring.take(2, model, opt, None, None, {}, None)
    expected_model = copy.deepcopy(model.state_dict())
    expected_opt = copy.deepcopy(opt.state_dict())
    opt.param_groups[0]["lr"] = 0.5  # a changed hyperparameter is put back too
    steps(3)
    load = opt.load_state_dict

    def no_load(state):
        raise AssertionError("restored through load_state_dict, not in place")

    opt.load_state_dict = no_load  # type: ignore[method-assign]
    ring.restore(snap, model, opt, None, None)
    opt.load_state_dict = load  # type: ignore[method-assign]
    assert all(torch.equal(v, expected_model[k]) for k, v in model.state_dict().items())
    got = opt.state_dict()
    assert got["param_groups"] == expected_opt["param_groups"]
    for pid, values in expected_opt["state"].items():
        for name, value in values.items():
            assert torch.equal(got["state"][pid][name], value), (fused, pid, name)
    # the reference path: a fresh optimizer loaded from the same snapshot
    twin = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    twin.load_state_dict(copy.deepcopy(snap.optimizer))
    for pid, values in twin.state_dict()["state"].items():
        for name, value in values.items():
            assert torch.equal(got["state"][pid][name], value)
    # the snapshot is still whole after training went on from it
    steps(2)
    ring.restore(snap, model, opt, None, None)
    assert all(torch.equal(v, expected_model[k]) for k, v in model.state_dict().items())


def test_a_state_that_grew_restores_through_load_state_dict():
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    model = nn.Sequential(a, b)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    a(torch.randn(2, 3)).sum().backward()  # only `a` has grads: only it has momentum
    opt.step()
    opt.zero_grad()
    ring = SnapshotRing(1)
    snap = ring.take(1, model, opt, None, None, {}, None)
    weights = copy.deepcopy(model.state_dict())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()  # now `b` has momentum too: another layout
    ring.restore(snap, model, opt, None, None)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert set(opt.state) == {a.weight, a.bias}  # the state as it was: `b` had none


def pinned_guard(tmp_path, monkeypatch, allocate):
    """A guard whose snapshots are "pinned" (on the CPU) through `allocate`, on a background
    thread as on a GPU; the model, optimizer and inputs."""
    monkeypatch.setattr(host_memory, "allocate", allocate)
    monkeypatch.setattr(snapshots, "_wants_pinning", lambda tensors: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: object())
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = tg.GuardConfig(console=False, recovery={"snapshot_every": 5})
    guard = tg.Guard(model, opt, config=config, run_dir=tmp_path)
    return guard, model, opt, torch.randn(16, 4)


def test_a_snapshot_due_before_its_memory_is_pinned_comes_late_not_slow(tmp_path, monkeypatch):
    release = threading.Event()
    real = host_memory.allocate

    def slow(nbytes: int, pinned: bool) -> torch.Tensor:
        assert pinned
        release.wait(30)
        return real(nbytes, False)

    guard, model, opt, x = pinned_guard(tmp_path, monkeypatch, slow)
    for step in range(12):
        if step == 7:
            release.set()  # the pinning ends between steps 7 and 8
            while not guard.ring.ready:
                threading.Event().wait(0.01)
        model(x).pow(2).mean().backward()
        guard.step(model(x).pow(2).mean().detach())
        opt.zero_grad()
    guard.close()
    assert [s.step for s in guard.ring.snapshots] == [8]  # due at 5, taken once memory was ready
    waits = [
        e
        for e in read_jsonl(tmp_path / "events.jsonl")
        if e["kind"] == "snapshot" and "waits" in e["message"]
    ]
    assert [e["step"] for e in waits] == [5]


def test_no_device_wide_sync_in_the_snapshot_code(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a device-wide sync")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    out = run_scenario(FAULTS["LR x100 for 10 steps"], run_dir=tmp_path, steps=260)
    assert out.guard.action_counts["rollback"] >= 1  # a restore ran, and took a snapshot
    for name in ("actions/snapshots.py", "actions/snapshot_pool.py", "recovery.py", "guard.py"):
        tree = ast.parse((SRC / name).read_text())
        calls = [
            ast.unparse(node.func)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("synchronize")
        ]
        assert calls in ([], ["self.copied.synchronize"]), (name, calls)  # a restore's event


@pytest.mark.parametrize(
    "text, expected",
    [
        ("25%", (0.25, True)),
        ("40GB", (40e9, False)),
        ("12 GiB", (12 * 2**30, False)),
        (1024, (1024.0, False)),
    ],
)
def test_memory_settings_parse(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["lots", "120%", "-3", "4 parsecs"])
def test_a_wrong_memory_setting_is_one_clear_line(text):
    with pytest.raises(tg.ConfigError) as info:
        tg.GuardConfig.from_dict({"recovery": {"snapshot_memory": text}})
    assert "recovery.snapshot_memory" in str(info.value) and "%'" in str(info.value)
    assert "\n" not in str(info.value).strip()


def test_the_budget_is_split_between_the_ranks_of_a_node(monkeypatch):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 800 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host_memory.rank_budget("25%").nbytes == 25 * 2**30
    assert host_memory.rank_budget("80GB").nbytes == 10e9
    assert "25% of 800 GiB available on the node, shared by 8" in (
        host_memory.rank_budget("25%").describe()
    )
    too_much = host_memory.rank_budget("2TiB")  # more than the node has: lowered to that
    assert too_much.capped and too_much.nbytes == 100 * 2**30
    assert "more than the 800 GiB available" in too_much.describe()


def test_where_no_snapshot_fits_a_rollback_lands_on_the_known_good_checkpoint(tmp_path):
    """The same LR burst rolled back from memory and, with no room for a snapshot, from the
    durable checkpoint of the same step: the same outcome, loss for loss."""
    results = {}
    for memory in ("25%", 64):
        run_dir = tmp_path / str(memory).replace("%", "pct")
        config = tg.GuardConfig(
            console=False,
            recovery={"snapshot_memory": memory, "checkpoint_every": 50},
        )
        fault = FAULTS["LR x100 for 10 steps"]
        out = run_scenario(fault, run_dir=run_dir, steps=300, config=config)
        rollbacks = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "rollback"]
        results[memory] = (out.eval_loss, rollbacks)
    (in_memory, from_memory), (on_disk, from_disk) = results["25%"], results[64]
    assert [e["metrics"]["to_step"] for e in from_disk] == [250, 250]
    assert [e["metrics"]["to_step"] for e in from_memory] == [250, 250]
    assert "durable checkpoint step-250" in from_disk[-1]["message"]
    assert "durable" not in from_memory[-1]["message"]
    assert on_disk == in_memory


def test_a_pinning_that_leaves_no_slot_is_said(tmp_path, monkeypatch):
    def refused(nbytes: int, pinned: bool) -> torch.Tensor:
        raise MemoryError("pinning refused")

    guard, model, opt, x = pinned_guard(tmp_path, monkeypatch, refused)
    for _ in range(8):
        while guard.ring.pool is not None and not guard.ring.ready:
            threading.Event().wait(0.01)
        model(x).pow(2).mean().backward()
        guard.step(model(x).pow(2).mean().detach())
        opt.zero_grad()
    guard.close()
    assert guard.ring.slots == 0 and not guard.ring.snapshots
    stopped = [
        e
        for e in read_jsonl(tmp_path / "events.jsonl")
        if e["kind"] == "snapshot" and "stopped" in e["message"]
    ]
    assert len(stopped) == 1 and stopped[0]["metrics"]["snapshots_fit"] == 0
