"""Checkpoints by wall time (`recovery.checkpoint_every_s`), on an injected clock: alone, with
`checkpoint_every` (whichever comes first), and in 2 gloo ranks whose clocks disagree."""

from __future__ import annotations

from pathlib import Path

import torch

import trainguard as tg
from test_distributed import launch
from trainguard.actions.checkpoints import CheckpointStore


class FakeClock:
    """Seconds that move only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run(run_dir: Path, recovery: dict[str, object], seconds_per_step: float) -> list[int]:
    """Train 20 steps on a clock that moves `seconds_per_step` a step; the steps checkpointed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = tg.GuardConfig(
        console=False, recovery={"keep_checkpoints": 100, "async_checkpoints": False, **recovery}
    )
    guard = tg.Guard(model, opt, config=cfg, run_dir=run_dir)
    clock = FakeClock()
    guard.checkpoint_clock = clock
    x = torch.randn(8, 4)
    for _ in range(20):
        loss = model(x).pow(2).mean()
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
        clock.now += seconds_per_step
    guard.close()
    complete = CheckpointStore(run_dir / "checkpoints").complete()
    return sorted(int(p.name.removeprefix("step-")) for p in complete)


def test_a_checkpoint_every_60_seconds_of_25_second_steps(tmp_path):
    # the clock starts at the first step: 75 s have passed at its 4th step, then again 3 later
    steps = _run(tmp_path, {"checkpoint_every": 0, "checkpoint_every_s": 60.0}, 25.0)
    assert steps == [4, 7, 10, 13, 16, 19]


def test_time_and_steps_whichever_comes_first(tmp_path):
    # every 5 steps, or 60 s: the step checkpoint at 5 restarts the clock
    steps = _run(tmp_path, {"checkpoint_every": 5, "checkpoint_every_s": 60.0}, 25.0)
    assert steps == [4, 5, 8, 10, 13, 15, 18, 20]


def test_no_time_interval_keeps_checkpoints_by_steps_alone(tmp_path):
    steps = _run(tmp_path, {"checkpoint_every": 5}, 1e6)
    assert steps == [5, 10, 15, 20]


def test_two_ranks_checkpoint_the_same_step_when_only_one_clock_says_so(tmp_path):
    results = launch("timed_checkpoint", 2, tmp_path)
    # rank 1's clock runs 25 s a step, rank 0's stands still: 60 s are due on rank 1 alone
    assert results[0]["saved_at"] == results[1]["saved_at"] == [4, 7, 10]
    assert results[0]["actions"] == results[1]["actions"]
    complete = CheckpointStore(tmp_path / "checkpoints").complete()
    assert sorted(p.name for p in complete) == ["step-10", "step-4", "step-7"]
    for step in (4, 7, 10):
        shards = {p.name for p in (tmp_path / "checkpoints" / f"step-{step}").iterdir()}
        assert {"trainguard-rank0.json", "trainguard-rank1.json"} <= shards
