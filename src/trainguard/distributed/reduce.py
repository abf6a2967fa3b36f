"""`ReduceExchange`: the guard's per-step exchange as two fixed-size reductions, whatever the
number of ranks: a SUM (the loss, shard norms, each metric's sum of logs and counts, step times),
then a MAX of keys packed with their rank (each rank's robust z against its own line, the
non-finite ranks, the worst and best values, a straggler to report). Per-rank detail comes only
for the ranks the MAX points at, in rare extra MAX rounds on the steps something is out of line.

Two reductions, not one: each rank's key is its log-ratio to the others' centre, which needs the
step's SUM first; one all_reduce applies one operation."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainguard.detectors.base import RankMetric, RankTiming
from trainguard.detectors.ranks import METRICS, OwnRule
from trainguard.distributed.context import RankContext
from trainguard.distributed.upload import FigureUpload
from trainguard.signals.host_reads import read_now

if TYPE_CHECKING:
    from trainguard.detectors import MetricPoint
    from trainguard.detectors.ranks import RankOutlierDetector, StragglerDetector
    from trainguard.distributed.exchange import LocalGradNorm
    from trainguard.signals.gradients import Measurement

MAX_NAMED = 8  # ranks named per kind of finding; beyond, an event says there were more
RANK_LIMIT = 2**31 - 1
_LOW = 2**32
_NONE = -(2**63)  # below every packed key: "nothing from this rank"
# the MAX's categories: ranks out of line (two metrics), non-finite (two metrics), straggler
CATEGORIES = ("loss", "grad_norm", "loss_nonfinite", "grad_norm_nonfinite", "straggler")
_DETAIL = 3  # figures a named rank sends: its value (a straggler: mean, data wait, windows)
_SUMMARY = (  # the MAX's summaries: the reach, the highest and (negated) lowest values
    "reach_loss",
    "reach_grad_norm",
    "high_loss",
    "high_grad_norm",
    "low_loss",
    "low_grad_norm",
    "high_step_time",
)
_SUMS = 10  # after the loss, shard norms and groups: logs(2), valid(2), non-finite(2),
# measured(2), step time, data wait


def order_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 values as int64 in the same order (infinities included; never NaN)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def from_order_bits(keys: torch.Tensor) -> torch.Tensor:
    bits = torch.where(keys < 0, keys ^ 0x7FFFFFFF, keys)
    return bits.to(torch.int32).view(torch.float32)


def pack(values: torch.Tensor, rank: int) -> torch.Tensor:
    """Each value with `rank` in one int64 whose MAX over ranks is the largest value and, on a
    tie, the lowest rank; NaN counts as -inf."""
    values = values.to(torch.float32)
    clean = torch.where(torch.isnan(values), -math.inf, values)
    return order_bits(clean) * _LOW + (RANK_LIMIT - rank)


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The values and ranks `pack` put into the int64s."""
    keys = torch.bitwise_right_shift(packed, 32)  # arithmetic: the sign stays
    return from_order_bits(keys), RANK_LIMIT - torch.bitwise_and(packed, 0xFFFFFFFF)


def raw_bits(values: torch.Tensor) -> torch.Tensor:
    """float32 values as non-negative int64 (any bits, NaN too): over `_NONE` from the other
    ranks, a MAX hands them on unchanged."""
    return values.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def from_raw_bits(keys: torch.Tensor) -> torch.Tensor:
    signed = torch.where(keys >= 2**31, keys - _LOW, keys)
    return signed.to(torch.int32).view(torch.float32)


class ReduceExchange:
    """Each step a SUM then a MAX of fixed size (a few dozen numbers, whatever the world); the
    rank detectors' own lines (`outlier`, `straggler`: the live detectors) score this rank on
    the device between the two."""

    def __init__(
        self,
        context: RankContext,
        outlier: RankOutlierDetector | None,
        straggler: StragglerDetector | None,
    ) -> None:
        self.context = context
        self.outlier = outlier
        self.straggler = straggler
        self.calls = 0  # collectives made, for tests and benchmarks
        self.rounds = 0  # of them, the rare rounds that named ranks
        self.checkpoint_due = False  # whether any rank's clock said a checkpoint is due
        self.checkpoint_busy = False  # whether any rank's checkpoint writer was busy
        self.bytes_sent = 0  # payload of this rank's reductions so far
        self._keys: torch.Tensor | None = None  # this step's key per category, on the device
        self._detail: torch.Tensor | None = None  # what it sends if named, per category
        self._window_ends = False
        self._upload = FigureUpload(context.device, torch.float64)  # pinned: no pageable copy

    def _reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        dist.all_reduce(tensor, op=op, group=self.context.group)
        self.calls += 1
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def _rules(self) -> list[OwnRule]:
        if self.outlier is None:
            return [OwnRule(0.0, 1.0, 0.0, False, math.inf, math.inf) for _ in METRICS]
        return [self.outlier.own_rule(metric) for metric in METRICS]

    def share(
        self,
        m: Measurement,
        hook: LocalGradNorm | None,
        ready_at: float | None,
        data_wait: float,
        last_step_time: float | None,
        checkpoint_due: bool = False,
        checkpoint_busy: bool = False,
    ) -> None:
        """The step's two reductions: the measurement's figures become global, this rank is
        judged against its own line, and the results (summaries, the worst ranks, this rank's
        own figures, whether any rank's checkpoint is due or its writer busy) ride along in
        `m.extra` to the host."""
        ctx = self.context
        world, device, f64 = ctx.world_size, ctx.device, torch.float64
        now = time.perf_counter()
        own_sq = hook.sq if hook is not None and hook.sq is not None else None
        start = ready_at if ready_at is not None else last_step_time
        end = hook.first_ready if hook is not None and hook.first_ready is not None else now
        compute = end - start if start is not None else math.nan
        rules = self._rules()  # this rank's own line, from the detector's state so far
        figures = [data_wait + compute, data_wait, float(checkpoint_due), float(own_sq is not None)]
        for name in ("centre", "spread", "lowest", "limit", "reach", "warm"):
            figures += [float(getattr(rule, name)) for rule in rules]
        figures.append(float(checkpoint_busy))  # last
        host = self._upload.send(figures)  # one copy to the device, from pinned memory

        def floats(name: str) -> torch.Tensor:
            at = 4 + 2 * ("centre", "spread", "lowest", "limit", "reach", "warm").index(name)
            return host[at : at + 2]

        loss, nonfinite = m.rank_figures()
        assert m.shard_sq is not None and m.group_shard_sq is not None
        nan = torch.full((), math.nan, dtype=f64, device=device)
        grad = own_sq.to(device, f64).sqrt() if own_sq is not None else nan
        values = torch.stack([loss.to(device, f64).reshape(()), grad.reshape(())])
        measured = torch.cat([torch.ones(1, dtype=f64, device=device), host[3:4]])
        finite = torch.isfinite(values)
        valid = finite & (values > 0)
        logs = torch.where(valid, values.abs().clamp_min(1e-300).log(), 0.0)
        groups = m.group_shard_sq.numel()
        sent = torch.cat(  # float32, as the all-gather's rows were: 4 bytes a figure
            [
                loss.to(device, f64).reshape(1),
                m.shard_sq.to(device, f64).reshape(1),
                m.group_shard_sq.to(device, f64).reshape(-1),
                logs,
                valid.to(f64),
                (~finite).to(f64) * measured,
                measured,
                host[:2],
            ]
        ).to(torch.float32)
        self._reduce(sent, dist.ReduceOp.SUM)
        sums = sent.to(f64)
        pos = 2 + groups
        log_sum, n_valid = sums[pos : pos + 2], sums[pos + 2 : pos + 4]
        times = sums[pos + 8 : pos + 10]

        # this rank against its own line: its log-ratio to the others' centre, as a robust z
        d = logs - (log_sum - logs) / (world - 1)
        excess = d - floats("centre")
        inf = torch.full((), math.inf, dtype=f64, device=device)
        learned = torch.where(excess > floats("lowest"), excess / floats("spread"), -inf)
        early = torch.where(d > floats("limit"), inf, -inf)
        warm = floats("warm") > 0
        key_out = torch.where(warm, learned, early)
        key_out = torch.where(valid & (n_valid == world), key_out, -inf)
        if self.outlier is None:
            key_out = torch.full_like(key_out, -math.inf)
        counted = finite & (measured > 0)
        key_nonfinite = torch.where(~finite & (measured > 0), 1.0, -inf)
        if self.outlier is None:
            key_nonfinite = torch.full_like(key_nonfinite, -math.inf)
        straggler_key, slow, detail = self._straggler(host, times)
        keys = torch.cat([key_out, key_nonfinite, straggler_key.reshape(1)])
        summary = torch.cat(
            [
                floats("reach"),
                torch.where(counted, values, -inf),
                torch.where(counted, -values, -inf),
                torch.where(torch.isfinite(host[:1]), host[:1], -inf),
            ]
        )
        maxima = torch.cat(
            [
                nonfinite.to(device, torch.int64).reshape(1),
                host[2:3].to(torch.int64),
                host[-1:].to(torch.int64),
                pack(keys, ctx.rank),
                pack(summary, ctx.rank),
            ]
        )
        self._reduce(maxima, dist.ReduceOp.MAX)
        best, ranks = unpack(maxima[3:])
        out = m.head.device
        m.combine(
            losses=(sums[:1] / world).to(out, torch.float32),
            nonfinite=maxima[:1].to(out, torch.float32),
            shard_sq=sums[1:2].to(out, torch.float32),
            group_shard_sq=sums[2:pos].to(out, torch.float32).reshape(1, -1),
        )
        self._keys = keys.to(torch.float32)
        pad = torch.zeros(2, _DETAIL - 1, dtype=f64, device=device)
        per_metric = torch.cat([values.reshape(2, 1), pad], dim=1)
        self._detail = torch.cat([per_metric, per_metric, detail.reshape(1, _DETAIL)])
        self._detail = self._detail.to(torch.float32)
        m.extra = torch.cat(
            [
                maxima[1:3].to(f64),
                sums[pos : pos + _SUMS],
                best.to(f64),
                ranks.to(f64),
                d,
                host[:2],
                slow.to(f64).reshape(1),
            ]
        )
        if hook is not None:
            hook.reset()

    def _straggler(
        self, host: torch.Tensor, times: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """At the last step of a timing window: this rank's key (its ratio to the others' mean
        where it is a straggler to report now), whether its window was slow, and what it sends
        if named (mean step time, mean data wait, slow windows in a row)."""
        device, f64 = host.device, torch.float64
        world = self.context.world_size
        none = torch.full((), -math.inf, dtype=f64, device=device)
        no = torch.zeros((), dtype=torch.bool, device=device)
        self._window_ends = False
        if self.straggler is None:
            return none, no, torch.zeros(_DETAIL, dtype=f64, device=device)
        own = self.straggler.own_window()
        if own["world"] != world:  # its first step: the detector starts afresh
            own = {k: 0.0 for k in own}
        count = own["count"] + 1
        cfg = self.straggler.config
        self._window_ends = count >= cfg.every
        mean = (own["sum"] + host[0]) / count
        wait = (own["wait"] + host[1]) / count
        if not self._window_ends:
            return none, no, torch.stack([mean, wait, torch.zeros_like(mean)])
        everyone = (own["all"] + times[0] / world) / count
        centre = (everyone * world - mean) / (world - 1)
        slow = torch.isfinite(times[0]) & (centre > 0) & (mean > cfg.factor * centre)
        runs = own["slow_runs"] + 1
        report = slow & (runs >= cfg.windows) & (own["reported"] == 0)
        key = torch.where(report, mean / centre, none)
        return key, slow, torch.stack([mean, wait, torch.full_like(mean, runs)])

    def add_rank_figures(self, point: MetricPoint, extra: list[float]) -> None:
        """The reductions' results, once on the host: summaries of each per-rank figure on the
        point, and, where the MAX points at ranks out of line, non-finite or straggling, those
        ranks by name with their own figures (fetched in rare extra rounds)."""
        world = self.context.world_size
        self.checkpoint_due = extra[0] > 0
        self.checkpoint_busy = extra[1] > 0
        pos = 2
        log_sum, n_valid = extra[pos : pos + 2], extra[pos + 2 : pos + 4]
        n_nonfinite, n_measured = extra[pos + 4 : pos + 6], extra[pos + 6 : pos + 8]
        times = extra[pos + 8 : pos + 10]
        pos += _SUMS
        width = len(CATEGORIES) + len(_SUMMARY)
        best, ranks = (
            extra[pos : pos + width],
            [int(r) for r in extra[pos + width : pos + 2 * width]],
        )
        pos += 2 * width
        own, own_time, own_wait, slow = (
            extra[pos : pos + 2],
            extra[pos + 2],
            extra[pos + 3],
            extra[pos + 4],
        )
        top = {name: (best[i], ranks[i]) for i, name in enumerate(CATEGORIES + _SUMMARY)}
        metrics: dict[str, RankMetric] = {}
        for i, metric in enumerate(METRICS):
            if n_measured[i] == 0:
                continue
            low, low_rank = top[f"low_{metric}"]
            metrics[metric] = RankMetric(
                world=world,
                mean_log=log_sum[i] / world,
                positive=n_valid[i] == world,
                nonfinite=round(n_nonfinite[i]),
                worst=top[metric][0],
                worst_rank=top[metric][1],
                reach=top[f"reach_{metric}"][0],
                high=top[f"high_{metric}"][0],
                high_rank=top[f"high_{metric}"][1],
                low=-low,
                low_rank=low_rank,
                own=own[i],
            )
        high, high_rank = top["high_step_time"]
        timing = RankTiming(
            world=world,
            mean=times[0] / world,
            high=high,
            high_rank=high_rank,
            mean_wait=times[1] / world,
            own=own_time,
            own_wait=own_wait,
            own_slow=slow > 0,
        )
        bars = self._bars(metrics, timing)
        pointed = {c: top[CATEGORIES[c]] for c, bar in bars.items() if top[CATEGORIES[c]][0] > bar}
        if pointed:
            named, more = self._name(pointed, bars)
            for c, found in named.items():
                if c == 4:
                    timing.named = [(r, v[0], v[1], round(v[2])) for r, v, _ in found]
                    continue
                figure = metrics[METRICS[c % 2]]
                figure.named = [(r, v[0], key) for r, v, key in found]
                figure.more = more[c]
        point.rank_metrics = metrics
        point.rank_timing = timing

    def _bars(self, metrics: dict[str, RankMetric], timing: RankTiming) -> dict[int, float]:
        """Per category that can point at a rank this step, the key a rank must pass."""
        bars: dict[int, float] = {}
        for i, metric in enumerate(METRICS):
            figure = metrics.get(metric)
            if figure is None or self.outlier is None:
                continue
            if figure.nonfinite:
                bars[2 + i] = 0.0
            elif figure.positive:
                bars[i] = self.outlier.bar(metric, figure.reach)
        if self._window_ends and math.isfinite(timing.mean):
            bars[4] = 0.0
        return bars

    def _name(
        self, pointed: dict[int, tuple[float, int]], bars: dict[int, float]
    ) -> tuple[dict[int, list[tuple[int, list[float], float]]], dict[int, bool]]:
        """Name the ranks over each category's bar, worst first: each round is one MAX that
        carries what the ranks named in the last round send, and finds the next rank over the
        bar (this rank leaves itself out once named); `MAX_NAMED` at most."""
        assert self._keys is not None and self._detail is not None
        me, device = self.context.rank, self.context.device
        count = len(CATEGORIES)
        named: dict[int, list[tuple[int, list[float], float]]] = {c: [] for c in pointed}
        more = {c: False for c in pointed}
        candidate = dict(pointed)
        mine: set[int] = set()
        detail = self._detail
        while candidate:
            keys = self._keys.clone()
            sent = torch.full((count, _DETAIL), _NONE, dtype=torch.int64, device=device)
            for c in range(count):
                if c in candidate and candidate[c][1] == me:
                    mine.add(c)
                    sent[c] = raw_bits(detail[c])
                if c not in candidate or c in mine:
                    keys[c] = -math.inf
            vector = torch.cat([pack(keys, me), sent.reshape(-1)])
            self._reduce(vector, dist.ReduceOp.MAX)
            self.rounds += 1
            next_keys, next_ranks = unpack(vector[:count])
            f64 = torch.float64  # holds each float32 key and figure and each rank exactly
            received_bits = from_raw_bits(vector[count:]).to(f64)
            # one read of the round's keys, ranks and figures
            values = read_now(torch.cat([next_keys.to(f64), next_ranks.to(f64), received_bits]))
            next_list, rank_list = values[:count], values[count : 2 * count]
            flat = values[2 * count :]
            received = [flat[c * _DETAIL : (c + 1) * _DETAIL] for c in range(count)]
            for c in list(candidate):
                rank, key = candidate[c][1], candidate[c][0]
                named[c].append((rank, received[c], key))
                if next_list[c] > bars[c] and len(named[c]) < MAX_NAMED:
                    candidate[c] = (next_list[c], int(rank_list[c]))
                else:
                    more[c] = next_list[c] > bars[c]
                    del candidate[c]
        return named, more
