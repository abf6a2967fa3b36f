"""The per-step exchange's named record: a `RankRow` packed into one vector, the gathered rows
read back as `RankColumns` field by field, and the per-rank figures that reach the host."""

from __future__ import annotations

import math

import torch

from trainguard.detectors import MetricPoint
from trainguard.distributed.context import RankContext
from trainguard.distributed.exchange import RankColumns, RankRow, StepExchange
from trainguard.distributed.reduce import from_raw_bits, pack, raw_bits, unpack


def _row(rank: int, groups: int, own_sq: float) -> RankRow:
    base = 10.0 * (rank + 1)
    return RankRow(
        loss=torch.tensor(base + 1),
        nonfinite=torch.tensor(float(rank)),
        shard_sq=torch.tensor(base + 2),
        own_sq=torch.tensor(own_sq),
        step_time=torch.tensor(base + 3),
        data_wait=torch.tensor(base + 4),
        checkpoint_due=torch.tensor(float(rank == 1)),
        group_shard_sq=torch.arange(groups, dtype=torch.float32) + base,
    )


def test_pack_unpack_round_trip() -> None:
    rows = [_row(r, groups=4, own_sq=float(r * r)) for r in range(3)]
    packed = [row.pack() for row in rows]
    assert all(p.dtype == torch.float32 and p.shape == (7 + 4,) for p in packed)
    columns = RankColumns.unpack(torch.stack(packed))  # what the all-gather returns
    names = ("loss", "nonfinite", "shard_sq", "own_sq", "step_time", "data_wait", "checkpoint_due")
    for name in names:
        assert torch.equal(getattr(columns, name), torch.stack([getattr(r, name) for r in rows]))
    assert torch.equal(columns.group_shard_sq, torch.stack([r.group_shard_sq for r in rows]))


def test_per_rank_figures_reach_the_point_by_name() -> None:
    rows = [_row(r, groups=2, own_sq=float((r + 1) ** 2)) for r in range(3)]
    columns = RankColumns.unpack(torch.stack([row.pack() for row in rows]))
    exchange = StepExchange(RankContext(3, 3, ["a", "b", "c"], torch.device("cpu")))
    point = MetricPoint(step=0, loss=0.0)
    exchange.add_rank_figures(point, [*columns.per_rank().tolist(), 1.0])
    assert exchange.checkpoint_due  # rank 1's clock said so: due on every rank
    assert point.rank_losses == [11.0, 21.0, 31.0]
    assert point.rank_grad_norms == [1.0, 2.0, 3.0]
    assert point.rank_step_times == [13.0, 23.0, 33.0]
    assert point.rank_data_waits == [14.0, 24.0, 34.0]


def test_no_ddp_hook_leaves_rank_grad_norms_out() -> None:
    rows = [_row(r, groups=1, own_sq=math.nan) for r in range(2)]
    columns = RankColumns.unpack(torch.stack([row.pack() for row in rows]))
    exchange = StepExchange(RankContext(0, 2, ["a", "a"], torch.device("cpu")))
    point = MetricPoint(step=0, loss=0.0)
    exchange.add_rank_figures(point, [*columns.per_rank().tolist(), 0.0])
    assert not exchange.checkpoint_due
    assert point.rank_grad_norms is None
    assert point.rank_losses == [11.0, 21.0]


def test_packed_keys_reduce_by_value_then_by_the_lowest_rank() -> None:
    values = torch.tensor([-math.inf, -2.5, -1e-30, 0.0, 1e-30, 3.0, 7.25, math.inf])
    packed = [pack(values[i : i + 1], rank=5 - i % 3) for i in range(len(values))]
    order = [int(torch.argmax(torch.stack(packed[: k + 1]))) for k in range(len(values))]
    assert order == list(range(len(values)))  # each larger value wins over all before it
    decoded, ranks = unpack(torch.cat(packed))
    assert decoded.tolist() == values.tolist() and ranks.tolist() == [5, 4, 3, 5, 4, 3, 5, 4]
    tie = torch.maximum(pack(torch.tensor([2.0]), 7), pack(torch.tensor([2.0]), 3))
    assert unpack(tie)[1].tolist() == [3]  # a tie names the lowest rank
    nan = unpack(pack(torch.tensor([math.nan]), 0))[0]
    assert nan.tolist() == [-math.inf]  # NaN never wins a MAX


def test_a_named_ranks_figures_pass_a_max_unchanged() -> None:
    figures = torch.tensor([math.nan, -0.0, 1.5, -math.inf])
    sent = raw_bits(figures)
    others = torch.full_like(sent, -(2**63))
    received = from_raw_bits(torch.maximum(sent, others))
    assert torch.equal(received.view(torch.int32), figures.view(torch.int32))
