"""The guard on a GPU (issues 35 and 36): step cost with snapshots included on both hot paths,
snapshot and checkpoint blocking, blocking syncs per step on both paths, and the planted faults
on both paths; one prepared script of at most 6 minutes on one H200.

A GPT with separate q/k/v projections (untied head, pre-LN, GELU MLP), bf16 autocast on CUDA,
fused AdamW, random tokens from a pool of batches kept on the device. Sections, each guarded so
that a failure in one still prints the others, in the order they run:

1. Syncs per step at the smallest size, on each hot path (`hot_path: sync`, then `lagged`; 60
   calls each) and the plain loop beside them: the warnings of
   `torch.cuda.set_sync_debug_mode("warn")` (CUDA only), and the waits it does not report,
   `torch.cuda.synchronize()` and `Event`/`Stream.synchronize()` (on the training thread; other
   threads apart), counted call by call and split into ordinary, sampled (`stats_every`,
   precursors), snapshot and checkpoint calls. The lagged path's reads of the step before
   (`LaggedReads.read`) are counted, and the event waits inside them apart: a wait on step
   t - 1's copy while step t is queued, which leaves the device busy. A lagged call judges the
   step before, so it is 'sampled' when it measures or judges a sampled step. Target (issue 36):
   0 warnings and 0 device, stream or other event synchronizes on an ordinary lagged call.
2. Faults on the device at the smallest size, each run on both paths with the same seed (and on
   a learnable task, each token's successor fixed, AdamW at 1e-3, a snapshot every 10 steps):
   clean, a NaN batch (its loss NaN), an LR x100 burst for 5 steps (a wrapped optimizer.step),
   a toxic batch (random labels) and corrupted weights (the head x1000), at step 60 of 100. As
   tests/test_hot_path.py does, the data faults are planted by position (the batch is bad
   wherever it is replayed) and the others by attempt: a call not undone by the lagged path's
   rollback (a returned 'rollback' there drops that call's step), so both paths meet each fault
   at the same step; `guard.judge_pending()` gives the lagged path's last decision. Reported: the
   (step, action) pairs of each path, whether they are identical (the target), whether the final
   weights are equal bit for bit and the largest difference, and, on CUDA, the clean run twice
   on the synchronous path (how deterministic the device itself is).
3. Overhead at 19M, 124M (the GPT-2 small shape) and 1.3B (GPT-3 XL's): a plain loop (forward,
   backward, clip_grad_norm_(1.0), optimizer.step(), zero_grad) against the same loop under
   `tg.Guard` with its defaults ('default': `hot_path: auto`, which on CUDA with a fused AdamW
   is the lagged path; the path it took is recorded) and under `tg.Guard` with
   `hot_path: sync` ('sync'); `guard.step(loss)` replaces clip and step, the data go through
   `guard.batches`, and `recovery.snapshot_every` is 50, 50 and 30, so that snapshots fall
   inside the measured blocks. Blocks of 10 steps, the variants alternated block by block (the
   order rotated every block and reversed every other round) so drift hits all. The harness
   synchronises at block edges only (the guard must not); per-step times come from CUDA events
   on the compute stream. Reported per guard: the mean step over all blocks (snapshot steps
   included), the median block without a snapshot, the median step away from snapshots, and the
   ratios guard / plain. Where three models do not fit in the device's memory (1.3B on an
   H100), 'sync' is left out at that size and the report says so.
4. Snapshot blocking at the largest size, of the guard with defaults: (sum of the 3 step times
   around each snapshot call) - 3 x the median step; the guard's start events about snapshots.
5. Checkpoint blocking at the largest size: a fresh guard (defaults) with
   `recovery.checkpoint_every: 30` (dedup on, the default; snapshots moved out of the window),
   two checkpoints 30 steps apart, the blocked time of each the same way, whether either was
   deferred (events), and the time `guard.close()` waits for the last write.

A snapshot or checkpoint "of step k" holds the state before step k (as the guard names them):
the synchronous path takes it inside the `guard.step` call of index k - 1 ("call",
`guard.global_step` before it), the lagged path in call k (where it judges step k - 1); its
blocked time is that of the call before it, its call and the call after, less 3 medians.

Time budget (`--budget`, 330 s by default): sections 1 and 2 run a fixed number of steps at the
smallest size first (about 25 s on an H200); 100 s are kept for the checkpoints; what is left
goes to the overhead sizes, each in turn getting its share of the time still left in
proportion to its planned cost (steps x the step time issue 35 measured x the variants), so a
slow small size cannot starve 1.3B: past its share a size stops at a block edge, after one
round (each variant first once) at least. Planned: 400, 300 and 120 measured steps a variant
(about 16, 46 and 63 s with three variants, snapshots aside).

Targets: issue 35's, a 1.3B snapshot blocks <= 0.5 s, a 1.3B checkpoint <= 1 s, and with
defaults the whole-run ratio within 0.01 of the median ratio of steps without a snapshot;
issue 36's, guard / plain (whole run) <= 1.02 at 19M and <= 1.01 at 124M and 1.3B (for the
defaults; the sync guard's ratios are held to the same figures for comparison), 0 syncs on an
ordinary lagged call, and identical actions on both paths through the faults.

Results: a markdown summary on stdout (last), `$OUT/gpu.json` and `$OUT/gpu.md` when OUT is set,
written after each section. `--smoke` runs tiny models for a few steps (on the CPU in about a
minute; the faults at step 24 of 34 with AdamW at 3e-3) to test the script; off CUDA the guard
with defaults is forced onto the lagged path (`--default-hot-path`), since auto keeps the CPU
synchronous.

Run: python benchmarks/gpu.py [--device cuda] [--sizes 19M,124M,1.3B] [--steps N] [--budget 330]
         [--skip syncs,faults,checkpoints]
     python benchmarks/gpu.py --smoke --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import trainguard as tg
from _common import Block
from trainguard.demo.scenarios import scaled_step

try:  # the lagged hot path (issue 36)
    from trainguard.signals.lagged_reads import LaggedReads
except ImportError:  # an older trainguard
    LaggedReads = None  # type: ignore[assignment,misc]

TARGET_SNAPSHOT_S = 0.5
TARGET_CHECKPOINT_S = 1.0
TARGET_RATIO_GAP = 0.01
SYNC_WORDS = "synchroniz"  # set_sync_debug_mode's warning: "called a synchronizing CUDA operation"
EVENT_WORDS = re.compile(r"snapshot|pinned|host memory|defer", re.IGNORECASE)
FAULT_LR = 1e-3  # the faults section's AdamW (3e-3 on the tiny smoke model): the loss falls
# well within the detectors' warm-up, so a toxic batch stands out
FAULT_SNAPSHOT_EVERY = 10  # snapshots before each fault, for a rollback to reach
BURST_STEPS = 5
PLACEHOLDER = "judged at the next call"  # the lagged path's first call: nothing judged yet


# -- the model ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A model, its batch, and how the overhead section runs it."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq: int
    batch: int
    steps: int  # measured steps per variant (whole blocks)
    snapshot_every: int
    target_ratio: float  # guard / plain (issue 36)
    step_s: float  # a plain step's time, estimated: each size's share of the time budget
    block: int = 10


SIZES = {  # step times: issue 35's measurements on an H200
    "19M": Shape("19M", 6, 384, 6, 10240, 512, 16, 400, 50, 1.02, 0.0127),
    "124M": Shape("124M", 12, 768, 12, 50257, 1024, 16, 300, 50, 1.01, 0.0487),
    "1.3B": Shape("1.3B", 24, 2048, 16, 50257, 2048, 4, 120, 30, 1.01, 0.1566),
}
SMOKE = {  # the same roles, tiny: the script's every path on the CPU in seconds
    "19M": Shape("tiny-a", 2, 64, 2, 256, 64, 4, 20, 10, 1.02, 0.005, block=5),
    "124M": Shape("tiny-b", 2, 96, 2, 256, 64, 4, 20, 10, 1.01, 0.006, block=5),
    "1.3B": Shape("tiny-c", 3, 128, 4, 512, 64, 4, 20, 10, 1.01, 0.008, block=5),
}


class GPT(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(s.vocab, s.d_model)
        self.pos_emb = nn.Embedding(s.seq, s.d_model)
        self.blocks = nn.ModuleList(Block(s.d_model, s.n_head) for _ in range(s.n_layer))
        self.ln_f = nn.LayerNorm(s.d_model)
        self.head = nn.Linear(s.d_model, s.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def build(s: Shape, device: torch.device) -> tuple[GPT, torch.optim.Optimizer]:
    """The model, built on the device (no slow CPU init at 1.3B), and a fused AdamW."""
    torch.manual_seed(0)
    with device:
        model = GPT(s)
    try:
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except (RuntimeError, TypeError):  # no fused kernel for this device
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


Batch = tuple[torch.Tensor, torch.Tensor]


def pool(s: Shape, device: torch.device, count: int = 8) -> list[Batch]:
    """`count` batches of random tokens on the device, cycled by both variants."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=g).to(device)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


class Cycle:
    """`total` batches drawn in turn from a pool; re-iterable and without a length, as a
    streaming loader (so the guard sizes nothing from it)."""

    def __init__(self, batches: list[Batch], total: int) -> None:
        self.batches = batches
        self.total = total

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.total):
            yield self.batches[i % len(self.batches)]


# -- timing --------------------------------------------------------------------------------------
class Timer:
    """Per-step times of a block: CUDA events on the compute stream (no host sync inside the
    block), the host clock on the CPU; the block's wall time between two synchronisations."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []
        self.t0 = 0.0

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        self.marks = [self._mark()]

    def mark(self) -> None:
        self.marks.append(self._mark())

    def stop(self) -> tuple[float, list[float]]:
        """The block's wall time and each step's time, in seconds."""
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        pairs = zip(self.marks, self.marks[1:], strict=False)
        if self.cuda:
            return wall, [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return wall, [b - a for a, b in pairs]


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()  # the CPU smoke run: float32


def loss_of(model: GPT, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> torch.Tensor:
    with autocast(device):
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


# -- reading the guard (public attributes only, tolerant of the snapshot code changing) ----------
def newest_snapshot(guard: tg.Guard) -> int | None:
    """The step of the newest snapshot in the ring, or None where the ring does not say."""
    try:
        snaps = guard.ring.snapshots
        return int(snaps[-1].step) if snaps else -1
    except Exception:
        return None


def guard_events(run_dir: Path) -> list[dict[str, Any]]:
    """The events of `run_dir/events.jsonl` that speak of snapshots, checkpoints or host memory."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind, message = str(event.get("kind", "")), str(event.get("message", ""))
        if kind in ("snapshot", "checkpoint") or EVENT_WORDS.search(message):
            out.append(event)
    return out


def has_setting(section: str, name: str) -> bool:
    """Whether this trainguard has the setting `section.name` (e.g. recovery.snapshot_memory)."""
    fields = getattr(type(getattr(tg.GuardConfig(), section)), "model_fields", {})
    return name in fields


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)  # pinned blocks torch cached
        if host_empty is not None:
            host_empty()


# -- section 1 (and 2): overhead with snapshots included ----------------------------------------
def blocked(times: list[float], at: int, median: float) -> float | None:
    """(Sum of the step times at `at - 1`, `at`, `at + 1`) - 3 x the median; None off the ends."""
    if at - 1 < 0 or at + 1 >= len(times):
        return None
    return sum(times[at - 1 : at + 2]) - 3 * median


class GuardRun:
    """One guarded variant of the overhead section: its own model, fused AdamW, guard and data;
    the actions its calls returned, the calls that took a snapshot and the path it took."""

    def __init__(
        self, s: Shape, device: torch.device, batches: list[Batch], total: int, hot_path: str
    ) -> None:
        self.device = device
        self.model, self.opt = build(s, device)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"tg-gpu-{s.name}-{hot_path}-"))
        recovery = {"snapshot_every": s.snapshot_every}
        config: dict[str, Any] = {"console": False, "recovery": recovery}
        if hot_path != "auto":  # auto is the default: left unset
            config["hot_path"] = hot_path
        self.asked = hot_path
        self.guard = tg.Guard(self.model, self.opt, config=config, run_dir=self.run_dir)
        self.path = path_of(self.guard)
        self.data = iter(self.guard.batches(Cycle(batches, total)))
        self.actions: dict[str, int] = {}
        self.snapshot_at: list[int] = []  # call indices (0-based) whose guard.step took one
        self.snapshot_step: dict[int, int] = {}  # that call -> the snapshot's step
        self.ring_readable = newest_snapshot(self.guard) is not None

    def count(self, decision: tg.Decision | None) -> None:
        """Count a decision returned (the lagged path's first call has none yet) or flushed."""
        if decision is not None and decision.reason != PLACEHOLDER:
            self.actions[decision.action] = self.actions.get(decision.action, 0) + 1

    def step(self) -> None:
        x, y = next(self.data)
        guard = self.guard
        index = guard.global_step
        before = newest_snapshot(guard)
        loss = loss_of(self.model, x, y, self.device)
        loss.backward()
        self.count(guard.step(loss))
        self.opt.zero_grad(set_to_none=True)
        after = newest_snapshot(guard)
        if self.ring_readable:
            if after != before and after is not None:
                self.snapshot_at.append(index)
                self.snapshot_step[index] = after
        elif (index + 1) % guard.snapshot_interval == 0:  # the synchronous path's call
            self.snapshot_at.append(index)
            self.snapshot_step[index] = index + 1

    def close(self) -> dict[str, Any]:
        """Judge the pending step, close, and what the guard says of its snapshots."""
        guard = self.guard
        self.count(guard.judge_pending())
        guard.close()
        events = guard_events(self.run_dir)
        try:
            ring_bytes: int | None = int(guard.ring.nbytes)
        except Exception:
            ring_bytes = None
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return {
            "events": events,
            "ring_bytes": ring_bytes,
            "snapshot_interval": guard.snapshot_interval,
            "guard_snapshot_seconds_last": getattr(guard.recovery, "snapshot_seconds", None),
        }


def path_of(guard: tg.Guard) -> str:
    """The hot path a guard took: 'lagged' where it reads its figures one call later."""
    return "lagged" if getattr(guard, "_lagged", None) is not None else "sync"


def block_orders(names: list[str], blocks: int) -> list[list[str]]:
    """The order of the variants in each block: rotated block by block, and reversed every other
    round, so each variant runs first, last and beside each other one alike (two variants:
    flipped every block, as issue 35's two did)."""
    n = len(names)
    out = []
    for j in range(blocks):
        order = names[j % n :] + names[: j % n]
        out.append(order[::-1] if n > 2 and (j // n) % 2 else order)
    return out


def overhead(
    s: Shape,
    device: torch.device,
    steps: int,
    stop_at: float,
    default_hot_path: str = "auto",
    with_sync: bool = True,
) -> dict[str, Any]:
    """Plain against the guard with defaults (`hot_path` as `default_hot_path`: auto, the default,
    on a GPU) and, unless `with_sync` is off, the guard held to `hot_path: sync`."""
    b = s.block
    warm = b + b // 2 - 1  # snapshots (every a multiple of b, after step k*every - 1) mid-block
    blocks = max(1, steps // b)
    batches = pool(s, device)
    plain_model, plain_opt = build(s, device)
    total = warm + blocks * b + 1
    guards = {"default": GuardRun(s, device, batches, total, default_hot_path)}
    if with_sync:
        guards["sync"] = GuardRun(s, device, batches, total, "sync")
    plain_params = list(plain_model.parameters())
    counter = {"plain": 0}

    def plain_step() -> None:
        x, y = batches[counter["plain"] % len(batches)]
        counter["plain"] += 1
        loss = loss_of(plain_model, x, y, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_params, 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    timer = Timer(device)
    variants: dict[str, Callable[[], None]] = {"plain": plain_step}
    variants.update({name: run.step for name, run in guards.items()})
    names = list(variants)
    walls: dict[str, list[float]] = {name: [] for name in names}
    step_times: dict[str, list[float]] = {name: [] for name in names}
    warm_times: dict[str, list[float]] = {}
    t_start = time.perf_counter()
    for name, fn in variants.items():  # warm-up: kernels, allocator, Adam state, pinning
        timer.start()
        for _ in range(warm):
            fn()
            timer.mark()
        warm_times[name] = timer.stop()[1]
    cut_short = False
    for j, order in enumerate(block_orders(names, blocks)):
        if j >= len(names) and time.monotonic() > stop_at:  # each variant first once at least
            cut_short = True
            break
        for name in order:
            timer.start()
            for _ in range(b):
                variants[name]()
                timer.mark()
            wall, times = timer.stop()
            walls[name].append(wall)
            step_times[name].extend(times)
        if (j + 1) % 5 == 0 or j + 1 == blocks:
            print(f"  {s.name}: {j + 1}/{blocks} blocks", flush=True)
    elapsed = time.perf_counter() - t_start
    closed = {name: run.close() for name, run in guards.items()}
    measured = len(walls["plain"])
    p_times = step_times["plain"]
    plain_median = statistics.median(p_times) if p_times else math.nan
    plain_mean = sum(walls["plain"]) / max(1, measured * b)
    plain_block_median = statistics.median(w / b for w in walls["plain"]) if measured else math.nan

    def figures(name: str, run: GuardRun) -> dict[str, Any]:
        # guard calls measured: indices warm .. warm + measured * b - 1; positions in the times
        snaps = [i - warm for i in run.snapshot_at if warm <= i < warm + measured * b]
        near = {p + d for p in snaps for d in (-1, 0, 1, 2)}  # the snapshot call and spill-over
        snap_blocks = {p // b for p in snaps} | {(p + 1) // b for p in snaps}
        g_times = step_times[name]
        guard_quiet = [t for i, t in enumerate(g_times) if i not in near]
        guard_median = statistics.median(guard_quiet) if guard_quiet else math.nan
        guard_mean = sum(walls[name]) / max(1, measured * b)
        quiet_blocks = [w / b for k, w in enumerate(walls[name]) if k not in snap_blocks]
        guard_block_median = statistics.median(quiet_blocks) if quiet_blocks else math.nan
        ratio_whole = guard_mean / plain_mean
        ratio_steps = guard_median / plain_median
        rows = [
            {
                "snapshot_step": run.snapshot_step[warm + p],
                "call": warm + p,
                "step_time_s": g_times[p],
                "next_step_time_s": g_times[p + 1] if p + 1 < len(g_times) else None,
                "blocked_s": blocked(g_times, p, guard_median),
            }
            for p in snaps
        ]
        return {
            "hot_path_asked": run.asked,
            "hot_path": run.path,
            "guard_mean_s": guard_mean,
            "ratio_whole": ratio_whole,
            "target_ratio": s.target_ratio,
            "target_ratio_met": ratio_whole <= s.target_ratio,
            "guard_median_step_no_snapshot_s": guard_median,
            "ratio_median_steps_no_snapshot": ratio_steps,
            "guard_median_block_no_snapshot_s": guard_block_median,
            "ratio_median_blocks_no_snapshot": guard_block_median / plain_block_median,
            "ratio_gap": ratio_whole - ratio_steps,
            "target_ratio_gap_met": abs(ratio_whole - ratio_steps) <= TARGET_RATIO_GAP,
            "snapshots_detected_by": "ring" if run.ring_readable else "interval",
            "snapshot_steps_all": run.snapshot_at,
            "snapshots_measured": rows,
            "warmup_step_times_s": warm_times[name],
            "guard_actions": run.actions,
            **closed[name],
            "guard_step_times_s": g_times,
        }

    return {
        "size": s.name,
        "shape": asdict(s),
        "params": params(plain_model),
        "tokens_per_step": s.batch * s.seq,
        "warmup_steps": warm,
        "variants": names,
        "blocks_per_variant": measured,
        "steps_per_variant": measured * b,
        "cut_short": cut_short,
        "seconds": elapsed,
        "plain_mean_s": plain_mean,
        "plain_median_step_s": plain_median,
        "plain_median_block_s": plain_block_median,
        "plain_warmup_step_times_s": warm_times["plain"],
        "guards": {name: figures(name, run) for name, run in guards.items()},
        "plain_step_times_s": p_times,
    }


# -- section 3: checkpoints ----------------------------------------------------------------------
def checkpoints(s: Shape, device: torch.device, every: int, tmp: str | None) -> dict[str, Any]:
    b = s.block
    warm = b // 2  # checkpoints (after step k*every - 1, every a multiple of b) mid-block
    total = warm + 2 * every + b
    blocks = (total - warm + b - 1) // b
    batches = pool(s, device)
    model, opt = build(s, device)
    parent = tmp or tempfile.gettempdir()
    need = 2.2 * 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    free = shutil.disk_usage(parent).free
    if free < need:  # two checkpoints of weights and both Adam moments, kept (retention 3)
        raise RuntimeError(
            f"{parent} has {free / 1e9:.1f} GB free, two checkpoints need about "
            f"{need / 1e9:.1f} GB: pass --tmp DIR"
        )
    run_dir = Path(tempfile.mkdtemp(prefix=f"tg-gpu-ckpt-{s.name}-", dir=parent))
    config: dict[str, Any] = {
        "console": False,
        # checkpoints every `every` steps; no snapshot inside the window, to isolate their cost
        "recovery": {"checkpoint_every": every, "snapshot_every": 10 * every},
    }
    guard = tg.Guard(model, opt, config=config, run_dir=run_dir)
    data = iter(guard.batches(Cycle(batches, warm + blocks * b + 1)))
    actions: dict[str, int] = {}

    def step() -> None:
        x, y = next(data)
        loss = loss_of(model, x, y, device)
        loss.backward()
        decision = guard.step(loss)
        opt.zero_grad(set_to_none=True)
        actions[decision.action] = actions.get(decision.action, 0) + 1

    timer = Timer(device)
    timer.start()
    for _ in range(warm):
        step()
        timer.mark()
    warm_times = timer.stop()[1]
    times: list[float] = []
    for j in range(blocks):
        timer.start()
        for _ in range(b):
            step()
            timer.mark()
        times.extend(timer.stop()[1])
        if (j + 1) % 5 == 0 or j + 1 == blocks:
            print(f"  checkpoints {s.name}: {j + 1}/{blocks} blocks", flush=True)
    t0 = time.perf_counter()
    guard.close()  # waits for the last write
    close_s = time.perf_counter() - t0
    events = guard_events(run_dir)
    folder = run_dir / "checkpoints"
    saved = sorted(
        int(m.group(1))
        for p in (folder.iterdir() if folder.is_dir() else [])
        if (m := re.fullmatch(r"\D*(\d+)", p.name)) is not None
    )
    disk = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
    shutil.rmtree(run_dir, ignore_errors=True)

    planned = [every, 2 * every]
    steps = sorted(set(planned) | set(saved))  # a deferred one lands at a later step
    median = statistics.median(times)
    rows = []
    for k in steps:  # a checkpoint at step k is taken in the guard.step call of index k - 1
        p = k - 1 - warm
        rows.append(
            {
                "checkpoint_step": k,
                "call": k - 1,
                "planned": k in planned,
                "on_disk": k in saved,
                "step_time_s": times[p] if 0 <= p < len(times) else None,
                "blocked_s": blocked(times, p, median),
            }
        )
    slowest = sorted(range(len(times)), key=lambda i: times[i], reverse=True)[:5]
    deferred = [e for e in events if "defer" in str(e.get("message", "")).lower()]
    return {
        "size": s.name,
        "checkpoint_every": every,
        "disk_free_bytes_before": free,
        "median_step_s": median,
        "checkpoints": rows,
        "saved_steps": saved,
        "deferred": bool(deferred),
        "deferral_events": deferred,
        "close_waits_s": close_s,
        "run_dir_bytes": disk,
        "slowest_calls": [{"call": warm + i, "time_s": times[i]} for i in slowest],
        "warmup_step_times_s": warm_times,
        "guard_actions": actions,
        "events": events,
        "step_times_s": times,
    }


# -- section 4: blocking syncs per step ----------------------------------------------------------
class Waits:
    """Counts the host waits made through torch.cuda's Python API while a step runs: device-wide
    `torch.cuda.synchronize()` (which `set_sync_debug_mode` does not report), and
    `Event.synchronize()` / `Stream.synchronize()`, on the training thread and on others (the
    checkpoint writer's) apart. The lagged path's reads (`LaggedReads.read`, one a call) are
    counted, and the event waits inside them apart ("lagged_wait"): a wait on the copy of step
    t - 1 while step t is queued, which leaves the device busy."""

    def _targets(self) -> list[tuple[str, Any]]:
        return [("device", torch.cuda), ("event", torch.cuda.Event), ("stream", torch.cuda.Stream)]

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict[str, int]]:
        counts = {
            "device": 0,
            "event": 0,
            "stream": 0,
            "other_threads": 0,
            "lagged_reads": 0,
            "lagged_wait": 0,
        }
        training = threading.current_thread()
        inside = {"read": False}
        saved: list[tuple[Any, str, Any]] = []
        for name, owner in self._targets():
            original = owner.__dict__.get("synchronize")
            if original is None:  # not this torch's layout: not counted
                continue
            saved.append((owner, "synchronize", original))

            def wrapper(*args: Any, _name: str = name, _fn: Any = original, **kw: Any) -> Any:
                if threading.current_thread() is not training:
                    counts["other_threads"] += 1
                elif _name == "event" and inside["read"]:
                    counts["lagged_wait"] += 1
                else:
                    counts[_name] += 1
                return _fn(*args, **kw)

            owner.synchronize = wrapper
        if LaggedReads is not None:
            read = LaggedReads.__dict__["read"]
            saved.append((LaggedReads, "read", read))

            def reading(*args: Any, _fn: Any = read, **kw: Any) -> Any:
                counts["lagged_reads"] += 1
                inside["read"] = True
                try:
                    return _fn(*args, **kw)
                finally:
                    inside["read"] = False

            LaggedReads.read = reading  # type: ignore[method-assign]
        try:
            yield counts
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)


WHAT = ("syncs", "device", "stream", "event", "lagged_wait", "lagged_reads", "other_threads")


def syncs(s: Shape, device: torch.device, total: int) -> dict[str, Any]:
    """Both hot paths, `total` guarded calls each, and the plain loop: the syncs of each call."""
    snapshot_every, checkpoint_every = 15, 25
    batches = pool(s, device)
    debug_mode = device.type == "cuda"
    waits = Waits()

    def counted(fn: Callable[[torch.Tensor, torch.Tensor], None], batch: Batch) -> dict[str, Any]:
        """`fn(*batch)`, and the syncs it made: those `set_sync_debug_mode` warns of (None off
        CUDA) and the explicit waits."""
        with waits.counting() as counts, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if debug_mode:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                fn(*batch)
            finally:
                if debug_mode:
                    torch.cuda.set_sync_debug_mode("default")
        warned = sum(SYNC_WORDS in str(w.message) for w in caught) if debug_mode else None
        return {"syncs": warned, **counts}

    paths: dict[str, Any] = {}
    for hot_path in ("sync", "lagged"):
        every = (snapshot_every, checkpoint_every)
        paths[hot_path] = syncs_on_path(s, device, batches, total, hot_path, counted, every)
        free_memory(device)
    plain_model, plain_opt = build(s, device)
    plain_params = list(plain_model.parameters())

    def plain(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = loss_of(plain_model, x, y, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_params, 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    plain_rows = []
    for i in range(22):  # the first two are not counted (Adam's state is made)
        n = counted(plain, batches[i % len(batches)])
        plain_rows.append({"step": i, "kind": "plain" if i >= 2 else "plain first", **n})
    lagged_ordinary = paths["lagged"]["summary"]["ordinary"]
    return {
        "size": s.name,
        "counted": debug_mode,
        "snapshot_every": snapshot_every,
        "checkpoint_every": checkpoint_every,
        "paths": paths,
        "plain": summarize(plain_rows, ("plain",)),
        "plain_per_step": plain_rows,
        "target_lagged_ordinary_zero": zero_syncs(lagged_ordinary) if debug_mode else None,
    }


def syncs_on_path(
    s: Shape,
    device: torch.device,
    batches: list[Batch],
    total: int,
    hot_path: str,
    counted: Callable[[Callable[[torch.Tensor, torch.Tensor], None], Batch], dict[str, Any]],
    every: tuple[int, int],
) -> dict[str, Any]:
    """`total` guarded calls on one hot path, each call's syncs and its kind."""
    model, opt = build(s, device)
    run_dir = Path(tempfile.mkdtemp(prefix=f"tg-gpu-syncs-{hot_path}-"))
    config: dict[str, Any] = {
        "console": False,
        "hot_path": hot_path,
        "recovery": {"snapshot_every": every[0], "checkpoint_every": every[1]},
    }
    guard = tg.Guard(model, opt, config=config, run_dir=run_dir)
    data = iter(guard.batches(Cycle(batches, total + 1)))
    cfg = guard.config
    stats_every = cfg.stats_every
    probe_every = cfg.precursors.every if cfg.precursors.enabled else 0
    saved_in: list[tuple[int, int]] = []  # (call, step) of each checkpoint taken
    call = [0]
    save = guard.save_checkpoint

    def saving() -> None:
        saved_in.append((call[0], guard.global_step))
        save()

    guard.save_checkpoint = saving  # type: ignore[method-assign]

    def guarded(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = loss_of(model, x, y, device)
        loss.backward()
        guard.step(loss)
        opt.zero_grad(set_to_none=True)

    def sampled(i: int) -> bool:
        stats = bool(stats_every and i % stats_every == 0)
        return i >= 0 and (stats or bool(probe_every and i % probe_every == 0))

    lagged = path_of(guard) == "lagged"
    per_step: list[dict[str, Any]] = []
    for _ in range(total):
        batch = next(data)
        index = call[0] = guard.global_step
        before, calls = newest_snapshot(guard), len(saved_in)
        n = counted(guarded, batch)
        took = newest_snapshot(guard) != before if before is not None else None
        if took is None:  # the synchronous path's call
            took = (index + 1) % guard.snapshot_interval == 0
        if index < 2:
            kind = "first"
        elif len(saved_in) > calls:
            kind = "checkpoint"
        elif took:
            kind = "snapshot"
        elif sampled(index) or (lagged and sampled(index - 1)):  # lagged: judged one call later
            kind = "sampled"
        else:
            kind = "ordinary"
        per_step.append({"step": index, "kind": kind, **n})

    def flush(x: torch.Tensor, y: torch.Tensor) -> None:
        guard.judge_pending()  # the pending step, judged before close

    flushed = counted(flush, batches[0])
    guard.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    kinds = ("first", "ordinary", "sampled", "snapshot", "checkpoint")
    return {
        "hot_path": path_of(guard),
        "stats_every": stats_every,
        "precursors_every": probe_every,
        "checkpoints_taken": [{"call": c, "checkpoint_step": k} for c, k in saved_in],
        "summary": summarize(per_step, kinds),
        "flush": flushed,
        "per_step": per_step,
    }


def summarize(rows: list[dict[str, Any]], kinds: tuple[str, ...]) -> dict[str, Any]:
    """Per kind of step: how many, and the mean and max of each count (None where not counted)."""
    summary: dict[str, Any] = {}
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        summary[kind] = {"steps": len(mine)}
        for what in WHAT:
            counts = [r[what] for r in mine if r[what] is not None]
            summary[kind][what] = (
                {"mean": sum(counts) / len(counts), "max": max(counts)} if counts else None
            )
    return summary


def zero_syncs(kind: dict[str, Any]) -> bool | None:
    """Whether steps of one kind made no blocking sync: no `set_sync_debug_mode` warning, no
    device, stream or event synchronize (the lagged reads' event waits apart); None where none
    ran or the warnings were not counted."""
    if not kind["steps"] or kind["syncs"] is None:
        return None
    return all(kind[w]["max"] == 0 for w in ("syncs", "device", "stream", "event"))


# -- section 5: the planted faults on both hot paths ---------------------------------------------
@dataclass(frozen=True)
class Fault:
    """Planted by data position (`toxic`, `nan`: the batch is bad wherever it is replayed) or by
    attempt (`burst`, `corrupt_at`: a call not undone by the lagged path's rollback, so both
    paths count them alike), as tests/test_hot_path.py does."""

    name: str
    toxic: tuple[int, ...] = ()  # positions whose labels are random tokens
    nan: tuple[int, ...] = ()  # positions whose loss is NaN
    burst: tuple[int, ...] = ()  # attempts whose update lands at 100x the LR
    corrupt_at: int | None = None  # attempt at which the head's weights become 1000x


def planted(at: int) -> list[Fault]:
    return [
        Fault("clean"),
        Fault("NaN batch", nan=(at,)),
        Fault("LR x100 burst", burst=tuple(range(at, at + BURST_STEPS))),
        Fault("toxic batch", toxic=(at,)),
        Fault("corrupted weights", corrupt_at=at),
    ]


class Planted:
    """A learnable task (each token's successor fixed by one permutation of the vocabulary, so
    the loss falls and a bad batch stands out), by position: `(position, x, y, nan)`, the toxic
    positions with random labels; re-iterable, without a length."""

    def __init__(self, s: Shape, device: torch.device, fault: Fault, total: int) -> None:
        g = torch.Generator().manual_seed(2)
        perm = torch.randperm(s.vocab, generator=g)
        self.batches: list[Batch] = []
        for _ in range(16):
            tokens = [torch.randint(0, s.vocab, (s.batch,), generator=g)]
            for _ in range(s.seq):
                tokens.append(perm[tokens[-1]])
            t = torch.stack(tokens, 1).to(device)
            self.batches.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
        self.fault, self.total, self.device, self.vocab = fault, total, device, s.vocab

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, bool]]:
        for i in range(self.total):
            x, y = self.batches[i % len(self.batches)]
            if i in self.fault.toxic:
                g = torch.Generator().manual_seed(i)
                y = torch.randint(0, self.vocab, tuple(y.shape), generator=g).to(self.device)
            yield i, x, y, i in self.fault.nan


def fault_run(
    s: Shape, device: torch.device, fault: Fault, hot_path: str, steps: int, lr: float
) -> dict[str, Any]:
    """A guarded run through `fault` until `steps` steps are made: its actions as (step,
    action), the path the guard took, and its final weights."""
    model, opt = build(s, device)
    for group in opt.param_groups:
        group["lr"] = lr
    run_dir = Path(tempfile.mkdtemp(prefix=f"tg-gpu-faults-{hot_path}-"))
    config: dict[str, Any] = {
        "console": False,
        "hot_path": hot_path,
        "recovery": {"snapshot_every": FAULT_SNAPSHOT_EVERY},
    }
    guard = tg.Guard(model, opt, config=config, run_dir=run_dir)
    path = path_of(guard)
    original, attempt, calls = opt.step, 0, 0
    actions: list[tuple[int, str]] = []
    counts: dict[str, int] = {}
    losses: list[torch.Tensor] = []  # read once at the end: no sync of the benchmark's own
    t0 = time.perf_counter()

    def note(decision: tg.Decision | None) -> None:
        if decision is None or decision.reason == PLACEHOLDER:
            return  # the lagged path's first call: nothing judged yet
        counts[decision.action] = counts.get(decision.action, 0) + 1
        if decision.action != "step":
            actions.append((decision.step, decision.action))

    try:
        for position, x, y, nan in guard.batches(Planted(s, device, fault, 3 * steps)):
            if guard.global_step >= steps:
                break
            burst = attempt in fault.burst
            opt.step = functools.partial(scaled_step, opt, original, 100.0) if burst else original  # type: ignore[method-assign]
            if attempt == fault.corrupt_at:
                with torch.no_grad():
                    model.head.weight.mul_(1e3)
            loss = loss_of(model, x, y, device)
            if nan:
                loss = loss * math.nan
            loss.backward()
            losses.append(loss.detach().float())
            decision = guard.step(loss, batch_ids=[position])
            calls += 1
            note(decision)
            if not (path == "lagged" and decision.action == "rollback"):
                attempt += 1  # the lagged path's rollback undoes this call's step unmade
            opt.zero_grad(set_to_none=True)
        note(guard.judge_pending())  # the step still pending on the lagged path
    finally:
        opt.step = original  # type: ignore[method-assign]
        guard.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    weights = torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])
    return {
        "hot_path": path,
        "actions": actions,
        "action_counts": counts,
        "calls": calls,
        "steps": guard.global_step,
        "seconds": time.perf_counter() - t0,
        "losses": [round(v, 4) for v in torch.stack(losses).tolist()] if losses else [],
        "weights": weights,
    }


def faults(
    s: Shape, device: torch.device, steps: int, at: int, lr: float, control: bool
) -> dict[str, Any]:
    """Each planted fault through the synchronous and the lagged path with the same seed: the
    actions step by step and whether the final weights are equal bit for bit; beside them,
    where `control`, the clean run twice on the synchronous path (is the device itself
    deterministic?)."""
    rows = []
    twice: dict[str, Any] = {}
    for fault in planted(at):
        sync = fault_run(s, device, fault, "sync", steps, lr)
        lagged = fault_run(s, device, fault, "lagged", steps, lr)
        diff = float((sync["weights"] - lagged["weights"]).abs().max())
        if fault.name == "clean" and control:
            again = fault_run(s, device, fault, "sync", steps, lr)
            twice = {
                "weights_bitwise_equal": bool(torch.equal(sync["weights"], again["weights"])),
                "max_abs_diff": float((sync["weights"] - again["weights"]).abs().max()),
                "actions_identical": sync["actions"] == again["actions"],
            }
        rows.append(
            {
                "fault": fault.name,
                "planted": asdict(fault),
                "identical_actions": sync["actions"] == lagged["actions"],
                "weights_bitwise_equal": bool(torch.equal(sync["weights"], lagged["weights"])),
                "max_abs_diff": diff,
                "acted_on": bool(sync["actions"]),
                **{
                    name: {k: v for k, v in run.items() if k != "weights"}
                    for name, run in (("sync", sync), ("lagged", lagged))
                },
            }
        )
        print(f"  faults {s.name}: {fault.name} done", flush=True)
    return {
        "size": s.name,
        "steps": steps,
        "at": at,
        "lr": lr,
        "snapshot_every": FAULT_SNAPSHOT_EVERY,
        "faults": rows,
        "sync_twice": twice,
        "identical_actions": all(r["identical_actions"] for r in rows),
        "weights_bitwise_equal": all(r["weights_bitwise_equal"] for r in rows),
    }


# -- the report ----------------------------------------------------------------------------------
def ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def times(ratio: float) -> str:
    return "-" if math.isnan(ratio) else f"{ratio:.3f}x"


def sec(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def report(result: dict[str, Any]) -> str:
    lines = [f"## GPU: {result['device_name']}", "", result["setup"], ""]
    rows = result["overhead"]
    if rows:
        lines += [
            "| model (params) | guard (hot path) | plain step, mean (ms) "
            "| guard step, mean incl. snapshots (ms) | guard / plain, whole run (target) "
            "| guard / plain, median steps without a snapshot "
            "| median blocks without a snapshot | gap (target <= 0.01) | snapshots measured "
            "| guard actions |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {name} | error: {r['error']} | | | | | | | | |")
                continue
            short = " (cut short)" if r["cut_short"] else ""
            for variant, g in r["guards"].items():
                lines.append(
                    f"| {r['size']} ({r['params'] / 1e6:,.1f}M) "
                    f"| {variant} ({g['hot_path_asked']}: {g['hot_path']}) "
                    f"| {ms(r['plain_mean_s'])} | {ms(g['guard_mean_s'])} "
                    f"| {times(g['ratio_whole'])} (<= {g['target_ratio']}: "
                    f"{'met' if g['target_ratio_met'] else 'not met'}) "
                    f"| {times(g['ratio_median_steps_no_snapshot'])} "
                    f"| {times(g['ratio_median_blocks_no_snapshot'])} | {g['ratio_gap']:+.3f} "
                    f"| {len(g['snapshots_measured'])} in {r['steps_per_variant']} steps{short} "
                    f"| {g['guard_actions']} |"
                )
            if r.get("dropped"):
                lines.append(f"| {r['size']} | {r['dropped']} | | | | | | | | |")
        lines += [
            "",
            "The guard 'default' runs with its defaults ('auto: lagged': `hot_path: auto`, "
            "which took the lagged path; a CPU run forces 'lagged'), 'sync' with "
            "`hot_path: sync`. The variants alternate block by block.",
            "",
        ]
    snap = result.get("snapshot")
    if snap:
        if "error" in snap:
            lines.append(f"Snapshot blocking: error: {snap['error']}")
        else:
            each = ", ".join(
                f"of step {r['snapshot_step']}: {sec(r['blocked_s'])} s (its call "
                f"{ms(r['step_time_s'])} ms, the next {ms(r['next_step_time_s'])} ms)"
                for r in snap["snapshots"]
            )
            lines.append(
                f"Snapshot blocking at {snap['size']} (target <= {TARGET_SNAPSHOT_S} s): worst "
                f"{sec(snap['worst_blocked_s'])} s; {each or 'no snapshot measured'}. "
                f"Warm-up guard steps (pinning at start): max {ms(snap['warmup_max_s'])} ms, "
                f"median {ms(snap['warmup_median_s'])} ms."
            )
            for event in snap["events"]:
                lines.append(
                    f"- event `{event.get('kind')}` at step {event.get('step')}: "
                    f"{event.get('message')} {event.get('metrics', {})}"
                )
        lines.append("")
    ckpt = result.get("checkpoints")
    if ckpt:
        if "error" in ckpt:
            lines.append(f"Checkpoint blocking: error: {ckpt['error']}")
        else:
            each = ", ".join(
                f"of step {r['checkpoint_step']}: {sec(r['blocked_s'])} s"
                + ("" if r["on_disk"] else " (not on disk)")
                for r in ckpt["checkpoints"]
            )
            lines.append(
                f"Checkpoint blocking at {ckpt['size']}, every {ckpt['checkpoint_every']} steps, "
                f"dedup on (target <= {TARGET_CHECKPOINT_S} s each): {each}; median step "
                f"{ms(ckpt['median_step_s'])} ms; deferred: {'yes' if ckpt['deferred'] else 'no'}; "
                f"close() waited {sec(ckpt['close_waits_s'])} s for the last write; slowest "
                "calls: "
                + ", ".join(f"{r['call']} ({ms(r['time_s'])} ms)" for r in ckpt["slowest_calls"])
                + "."
            )
            for event in ckpt["events"]:
                lines.append(
                    f"- event `{event.get('kind')}` at step {event.get('step')}: "
                    f"{event.get('message')}"
                )
        lines.append("")
    sy = result.get("syncs")
    if sy:
        if "error" in sy:
            lines.append(f"Blocking syncs: error: {sy['error']}")
        else:
            lines += [
                f"Syncs per call at {sy['size']} (snapshot every {sy['snapshot_every']}, "
                f"checkpoint every {sy['checkpoint_every']}; mean, max in brackets): blocking "
                "syncs `set_sync_debug_mode('warn')` reports, and the waits it does not: "
                "`torch.cuda.synchronize()`, `Event`/`Stream.synchronize()` on the training "
                "thread, and any of them on other threads. The lagged path's reads of the step "
                "before (`LaggedReads.read`) are counted apart, with the event waits inside "
                "them: a wait on step t - 1's copy while step t is queued (the device stays "
                "busy). On the lagged path a call judges the step before, so a call is "
                "'sampled' when it measures or judges a sampled step.",
                "",
                "| path | calls | count | set_sync_debug_mode | torch.cuda.synchronize "
                "| Stream.synchronize | Event.synchronize (other) | lagged reads "
                "| their event waits | on other threads |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            ]

            def cell(v: dict[str, Any] | None) -> str:
                return "-" if v is None else f"{v['mean']:.2f} ({v['max']})"

            tables = [(f"{p['hot_path']}", p["summary"]) for p in sy["paths"].values()]
            for path, summary in [*tables, ("plain loop", sy["plain"])]:
                for kind, v in summary.items():
                    if not v["steps"]:
                        continue
                    lines.append(
                        f"| {path} | {kind} | {v['steps']} | {cell(v['syncs'])} "
                        f"| {cell(v['device'])} | {cell(v['stream'])} | {cell(v['event'])} "
                        f"| {cell(v['lagged_reads'])} | {cell(v['lagged_wait'])} "
                        f"| {cell(v['other_threads'])} |"
                    )
            lines.append("")
            target = sy["target_lagged_ordinary_zero"]
            lines.append(
                "Target: 0 blocking syncs on an ordinary call of the lagged path (no warning, "
                "no device, stream or other event synchronize): "
                + ("met" if target else "not met" if target is False else "not counted")
                + "."
            )
            if not sy["counted"]:
                lines.append("`set_sync_debug_mode` needs CUDA: not counted here.")
        lines.append("")
    fa = result.get("faults")
    if fa:
        if "error" in fa:
            lines.append(f"Faults on the device: error: {fa['error']}")
        else:

            def acts(run: dict[str, Any]) -> str:
                return ", ".join(f"{a} at {k}" for k, a in run["actions"]) or "none"

            lines += [
                f"Faults on the device at {fa['size']} ({fa['steps']} steps, each fault at "
                f"step {fa['at']}, AdamW at {fa['lr']}, snapshot every {fa['snapshot_every']}; "
                "the same seed on both paths; the actions as the guard returned them, the "
                "lagged path's one call later, and its pending step from `judge_pending()`):",
                "",
                "| fault | sync path: actions | lagged path: actions | identical actions "
                "| weights bitwise equal (max abs diff) | acted on |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            for r in fa["faults"]:
                lines.append(
                    f"| {r['fault']} | {acts(r['sync'])} | {acts(r['lagged'])} "
                    f"| {'yes' if r['identical_actions'] else 'NO'} "
                    f"| {'yes' if r['weights_bitwise_equal'] else 'no'} "
                    f"({r['max_abs_diff']:.3g}) | {'yes' if r['acted_on'] else 'no'} |"
                )
            c = fa["sync_twice"]
            if c:
                lines += [
                    "",
                    "The clean run twice on the synchronous path (the device's own determinism): "
                    f"weights bitwise equal: {'yes' if c['weights_bitwise_equal'] else 'no'} "
                    f"(max abs diff {c['max_abs_diff']:.3g}); identical actions: "
                    f"{'yes' if c['actions_identical'] else 'no'}.",
                ]
        lines.append("")
    targets = result["targets"]
    lines.append(
        "Targets: "
        + "; ".join(
            f"{k}: {'met' if v else 'not met' if v is False else '-'}" for k, v in targets.items()
        )
        + f". Took {result['seconds']:.0f} s."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default="19M,124M,1.3B", help="Any of 19M, 124M, 1.3B.")
    parser.add_argument("--steps", type=int, default=None, help="Measured steps per variant.")
    parser.add_argument("--smoke", action="store_true", help="Tiny models: test the script.")
    parser.add_argument("--budget", type=float, default=330.0, help="Seconds for the whole run.")
    parser.add_argument("--checkpoint-every", type=int, default=30)
    parser.add_argument("--tmp", default=None, help="Folder for the checkpoints' run_dir.")
    parser.add_argument("--skip", default="", help="Sections to skip: syncs,faults,checkpoints.")
    parser.add_argument(
        "--default-hot-path",
        choices=["auto", "lagged"],
        default=None,
        help="hot_path of the guard with defaults: auto (the default) on CUDA; lagged off it, "
        "where auto resolves to sync, so that a smoke run exercises the lagged path.",
    )
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.budget
    device = torch.device(args.device)
    shapes = SMOKE if args.smoke else SIZES
    names = [n.strip() for n in args.sizes.split(",") if n.strip()]
    unknown = [n for n in names if n not in shapes]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {list(shapes)}")
    skip = set(args.skip.split(","))
    every = 10 if args.smoke else args.checkpoint_every
    default_hot_path = args.default_hot_path or ("auto" if device.type == "cuda" else "lagged")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
    memory = "recovery.snapshot_memory " + (
        "present" if has_setting("recovery", "snapshot_memory") else "absent"
    )
    setup = (
        f"Device: {device.type} ({name}), torch {torch.__version__}"
        f"{', CUDA ' + str(torch.version.cuda) if device.type == 'cuda' else ''}, "
        f"trainguard {getattr(tg, '__version__', '?')}, "
        f"{'bf16 autocast' if device.type == 'cuda' else 'float32'}, fused AdamW, Guard defaults "
        f"(console off) with recovery.snapshot_every set per size; the guard with defaults at "
        f"hot_path {default_hot_path}; {memory}."
        + (" Smoke run: tiny models." if args.smoke else "")
    )
    print(setup, flush=True)
    result: dict[str, Any] = {
        "argv": sys.argv[1:],
        "device_name": name,
        "setup": setup,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "smoke": args.smoke,
        "overhead": {},
    }
    errors: dict[str, str] = {}

    def guarded(section: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        print(f"[{time.monotonic() - started:6.1f} s] {section}", flush=True)
        try:
            return fn()
        except Exception as exc:
            errors[section] = traceback.format_exc()
            print(errors[section], file=sys.stderr, flush=True)
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:  # the section's models, optimizers and guard are gone with its frame
            free_memory(device)

    smallest, largest = shapes[names[0]], shapes[names[-1]]
    out = os.environ.get("OUT")

    def finish() -> str:
        """Targets and the summary of what has run so far, written to $OUT after each section
        (a run stopped by a time limit still leaves what it measured)."""
        result["seconds"] = time.monotonic() - started
        result["errors"] = errors
        ckpt = result.get("checkpoints", {})
        ckpt_blocked = [
            r["blocked_s"]
            for r in ckpt.get("checkpoints", [])
            if r["on_disk"] and r["blocked_s"] is not None
        ]
        overheads = [r for r in result["overhead"].values() if "error" not in r]
        result["targets"] = {
            f"{largest.name} snapshot <= {TARGET_SNAPSHOT_S} s": met(
                result.get("snapshot", {}).get("worst_blocked_s"), TARGET_SNAPSHOT_S
            ),
            f"{largest.name} checkpoint <= {TARGET_CHECKPOINT_S} s": met(
                max(ckpt_blocked, default=None), TARGET_CHECKPOINT_S
            ),
            f"whole-run ratio within {TARGET_RATIO_GAP} of the median ratio (guard defaults)": (
                all(r["guards"]["default"]["target_ratio_gap_met"] for r in overheads)
                if overheads
                else None
            ),
        }
        for r in overheads:
            for variant, g in r["guards"].items():
                what = "defaults" if variant == "default" else "hot_path sync"
                key = f"{r['size']} guard ({what}, {g['hot_path']}) / plain <= {g['target_ratio']}"
                result["targets"][key] = g["target_ratio_met"]
        sy = result.get("syncs", {})
        result["targets"]["0 syncs on an ordinary lagged call"] = sy.get(
            "target_lagged_ordinary_zero"
        )
        fa = result.get("faults", {})
        result["targets"]["faults: identical actions on both paths"] = fa.get("identical_actions")
        table = report(result)
        if out:
            Path(out, "gpu.json").write_text(json.dumps(result, indent=1, default=str))
            Path(out, "gpu.md").write_text(table + "\n")
        return table

    if "syncs" not in skip:
        result["syncs"] = guarded(
            f"syncs {smallest.name}", lambda: syncs(smallest, device, 30 if args.smoke else 60)
        )
        finish()
    if "faults" not in skip:
        plant = (34, 24, 3 * FAULT_LR) if args.smoke else (100, 60, FAULT_LR)
        cuda = device.type == "cuda"
        result["faults"] = guarded(
            f"faults {smallest.name}", lambda: faults(smallest, device, *plant, control=cuda)
        )
        finish()
    reserve = 0.0 if "checkpoints" in skip or args.smoke else 100.0  # for the checkpoints
    plan = {}
    for size in names:  # which variants fit in the device's memory, and each size's cost
        s = shapes[size]
        with_sync = fits(s, device, 3)
        steps = args.steps or s.steps
        warm = s.block + s.block // 2 - 1
        plan[size] = (with_sync, steps, (steps + warm) * s.step_s * (3 if with_sync else 2))
    for k, size in enumerate(names):
        s = shapes[size]
        with_sync, steps, _ = plan[size]
        share = plan[size][2] / sum(plan[n][2] for n in names[k:])  # its share of what is left
        stop_at = time.monotonic() + share * max(0.0, deadline - reserve - time.monotonic())
        result["overhead"][size] = guarded(
            f"overhead {s.name}",
            functools.partial(overhead, s, device, steps, stop_at, default_hot_path, with_sync),
        )
        if not with_sync and "error" not in result["overhead"][size]:
            result["overhead"][size]["dropped"] = (
                "guard with hot_path sync left out: three models do not fit in the device's "
                f"memory (about {need_bytes(s, 3) / 1e9:.0f} GB)"
            )
        finish()
    big = result["overhead"].get(names[-1], {})
    if "error" not in big:
        default = big["guards"]["default"]
        snaps = default["snapshots_measured"]
        worst = [r["blocked_s"] for r in snaps if r["blocked_s"] is not None]
        warm_guard = default["warmup_step_times_s"]
        result["snapshot"] = {
            "size": largest.name,
            "hot_path": default["hot_path"],
            "snapshots": snaps,
            "worst_blocked_s": max(worst) if worst else None,
            "warmup_max_s": max(warm_guard) if warm_guard else None,
            "warmup_median_s": statistics.median(warm_guard) if warm_guard else None,
            "ring_bytes": default["ring_bytes"],
            "events": default["events"],
        }
    else:
        result["snapshot"] = big
    if "checkpoints" not in skip:
        result["checkpoints"] = guarded(
            f"checkpoints {largest.name}", lambda: checkpoints(largest, device, every, args.tmp)
        )
    table = finish()
    print()
    print(table, flush=True)


def met(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def need_bytes(s: Shape, models: int) -> float:
    """The device memory `models` models of shape `s` need side by side, roughly: weights and
    AdamW's two moments each (12 bytes a parameter), one set of gradients (the others are set
    to None), and one step's activations and logits (bf16 autocast)."""
    with torch.device("meta"):
        n = params(GPT(s))
    activations = s.batch * s.seq * (34 * s.d_model * s.n_layer + 10 * s.vocab)
    return models * 12 * n + 4 * n + activations


def fits(s: Shape, device: torch.device, models: int) -> bool:
    """Whether `models` models of shape `s` fit in the device's free memory (always off CUDA)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return need_bytes(s, models) <= 0.95 * free


if __name__ == "__main__":
    main()
