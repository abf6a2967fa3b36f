"""The guard on a GPU (issue 35): step cost with snapshots included, snapshot and checkpoint
blocking, and blocking syncs per step; one prepared script of at most 6 minutes on one H200.

A GPT with separate q/k/v projections (untied head, pre-LN, GELU MLP), bf16 autocast on CUDA,
fused AdamW, random tokens from a pool of batches kept on the device. Sections, each guarded so
that a failure in one still prints the others:

1. Overhead at 19M, 124M (the GPT-2 small shape) and 1.3B (GPT-3 XL's): a plain loop (forward,
   backward, clip_grad_norm_(1.0), optimizer.step(), zero_grad) against the same loop under
   `tg.Guard` with its defaults (`guard.step(loss)` replaces clip and step; the data through
   `guard.batches`), except `recovery.snapshot_every` (50, 50 and 30), so that snapshots fall
   inside the measured blocks. Blocks of 10 steps, the variants alternated block by block (the
   order flipped every block) so drift hits both. The harness synchronises at block edges only
   (the guard must not); per-step times come from CUDA events on the compute stream. Reported:
   the mean step over all blocks (snapshot steps included), the median block without a
   snapshot, the median step away from snapshots, and the ratios guard / plain.
2. Snapshot blocking at the largest size: (sum of the 3 step times around each snapshot step)
   - 3 x the median step; the guard's own start events about snapshots (host memory).
3. Checkpoint blocking at the largest size: a fresh guard with `recovery.checkpoint_every: 30`
   (dedup on, the default; snapshots moved out of the window), two checkpoints 30 steps apart,
   the blocked time of each the same way, whether either was deferred (events), and the time
   `guard.close()` waits for the last write.
4. Syncs per step at the smallest size: the warnings of `torch.cuda.set_sync_debug_mode("warn")`
   (CUDA only), and the waits it does not report, `torch.cuda.synchronize()` and
   `Event`/`Stream.synchronize()` (on the training thread; other threads apart), counted step by
   step and split into ordinary, sampled (`stats_every`, precursors), snapshot and checkpoint
   steps; the plain loop beside it.

A snapshot or checkpoint "of step k" holds the state before step k (as the guard names them):
it was taken inside the `guard.step` call of index k - 1 ("call", `guard.global_step` before
it), and its blocked time is that of calls k - 2, k - 1 and k, less 3 medians.

Targets (issue 35): a 1.3B snapshot blocks <= 0.5 s, a 1.3B checkpoint <= 1 s, and with
defaults the whole-run ratio within 0.01 of the median ratio of steps without a snapshot.

Results: a markdown summary on stdout (last), `$OUT/gpu.json` and `$OUT/gpu.md` when OUT is set.
`--smoke` runs tiny models for a few steps (on the CPU in well under a minute) to test the script.

Run: python benchmarks/gpu.py [--device cuda] [--sizes 19M,124M,1.3B] [--steps N] [--budget 330]
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

TARGET_SNAPSHOT_S = 0.5
TARGET_CHECKPOINT_S = 1.0
TARGET_RATIO_GAP = 0.01
SYNC_WORDS = "synchroniz"  # set_sync_debug_mode's warning: "called a synchronizing CUDA operation"
EVENT_WORDS = re.compile(r"snapshot|pinned|host memory|defer", re.IGNORECASE)


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
    block: int = 10


SIZES = {
    "19M": Shape("19M", 6, 384, 6, 10240, 512, 16, steps=400, snapshot_every=50),
    "124M": Shape("124M", 12, 768, 12, 50257, 1024, 16, steps=300, snapshot_every=50),
    "1.3B": Shape("1.3B", 24, 2048, 16, 50257, 2048, 4, steps=120, snapshot_every=30),
}
SMOKE = {  # the same roles, tiny: the script's every path on the CPU in seconds
    "19M": Shape("tiny-a", 2, 64, 2, 256, 64, 4, steps=20, snapshot_every=10, block=5),
    "124M": Shape("tiny-b", 2, 96, 2, 256, 64, 4, steps=20, snapshot_every=10, block=5),
    "1.3B": Shape("tiny-c", 3, 128, 4, 512, 64, 4, steps=20, snapshot_every=10, block=5),
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


def overhead(s: Shape, device: torch.device, steps: int, stop_at: float) -> dict[str, Any]:
    b = s.block
    warm = b + b // 2 - 1  # snapshots (every a multiple of b, after step k*every - 1) mid-block
    blocks = max(1, steps // b)
    batches = pool(s, device)
    plain_model, plain_opt = build(s, device)
    guard_model, guard_opt = build(s, device)
    run_dir = Path(tempfile.mkdtemp(prefix=f"tg-gpu-{s.name}-"))
    config: dict[str, Any] = {"console": False, "recovery": {"snapshot_every": s.snapshot_every}}
    guard = tg.Guard(guard_model, guard_opt, config=config, run_dir=run_dir)
    data = iter(guard.batches(Cycle(batches, warm + blocks * b + 1)))
    plain_params = list(plain_model.parameters())
    counter = {"plain": 0}
    actions: dict[str, int] = {}
    snapshot_at: list[int] = []  # guard step indices (0-based) whose guard.step took one
    snapshot_step: dict[int, int] = {}  # that index -> the snapshot's step (the state before it)
    ring_readable = newest_snapshot(guard) is not None

    def plain_step() -> None:
        x, y = batches[counter["plain"] % len(batches)]
        counter["plain"] += 1
        loss = loss_of(plain_model, x, y, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_params, 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    def guard_step() -> None:
        x, y = next(data)
        index = guard.global_step
        before = newest_snapshot(guard)
        loss = loss_of(guard_model, x, y, device)
        loss.backward()
        decision = guard.step(loss)
        guard_opt.zero_grad(set_to_none=True)
        actions[decision.action] = actions.get(decision.action, 0) + 1
        after = newest_snapshot(guard)
        if ring_readable:
            if after != before and after is not None:
                snapshot_at.append(index)
                snapshot_step[index] = after
        elif (index + 1) % guard.snapshot_interval == 0:
            snapshot_at.append(index)
            snapshot_step[index] = index + 1

    timer = Timer(device)
    variants: dict[str, Callable[[], None]] = {"plain": plain_step, "guard": guard_step}
    walls: dict[str, list[float]] = {"plain": [], "guard": []}
    step_times: dict[str, list[float]] = {"plain": [], "guard": []}
    warm_times: dict[str, list[float]] = {}
    t_start = time.perf_counter()
    for name, fn in variants.items():  # warm-up: kernels, allocator, Adam state, pinning
        timer.start()
        for _ in range(warm):
            fn()
            timer.mark()
        warm_times[name] = timer.stop()[1]
    cut_short = False
    for j in range(blocks):
        if j >= 2 and time.monotonic() > stop_at:  # two blocks at least: one of each order
            cut_short = True
            break
        order = ["plain", "guard"] if j % 2 == 0 else ["guard", "plain"]
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
    guard.close()
    events = guard_events(run_dir)
    snapshot_seconds = getattr(guard.recovery, "snapshot_seconds", None)
    try:
        ring_bytes: int | None = int(guard.ring.nbytes)
    except Exception:
        ring_bytes = None
    interval = guard.snapshot_interval
    n_params = params(plain_model)
    shutil.rmtree(run_dir, ignore_errors=True)

    measured = len(walls["guard"])
    # guard steps measured: indices warm .. warm + measured * b - 1; positions in step_times
    snaps = [i - warm for i in snapshot_at if warm <= i < warm + measured * b]
    near = {p + d for p in snaps for d in (-1, 0, 1, 2)}  # the snapshot step and its spill-over
    snap_blocks = {p // b for p in snaps} | {(p + 1) // b for p in snaps}
    g_times, p_times = step_times["guard"], step_times["plain"]
    plain_median = statistics.median(p_times) if p_times else math.nan
    guard_quiet = [t for i, t in enumerate(g_times) if i not in near]
    guard_median = statistics.median(guard_quiet) if guard_quiet else math.nan
    plain_mean = sum(walls["plain"]) / max(1, len(walls["plain"]) * b)
    guard_mean = sum(walls["guard"]) / max(1, measured * b)
    plain_block_median = statistics.median(w / b for w in walls["plain"]) if measured else math.nan
    quiet_blocks = [w / b for k, w in enumerate(walls["guard"]) if k not in snap_blocks]
    guard_block_median = statistics.median(quiet_blocks) if quiet_blocks else math.nan
    ratio_whole = guard_mean / plain_mean
    ratio_steps = guard_median / plain_median
    snapshot_rows = [
        {
            "snapshot_step": snapshot_step[warm + p],
            "call": warm + p,
            "step_time_s": g_times[p],
            "next_step_time_s": g_times[p + 1] if p + 1 < len(g_times) else None,
            "blocked_s": blocked(g_times, p, guard_median),
        }
        for p in snaps
    ]
    return {
        "size": s.name,
        "shape": asdict(s),
        "params": n_params,
        "tokens_per_step": s.batch * s.seq,
        "warmup_steps": warm,
        "blocks_per_variant": measured,
        "steps_per_variant": measured * b,
        "cut_short": cut_short,
        "seconds": elapsed,
        "plain_mean_s": plain_mean,
        "guard_mean_s": guard_mean,
        "ratio_whole": ratio_whole,
        "plain_median_step_s": plain_median,
        "guard_median_step_no_snapshot_s": guard_median,
        "ratio_median_steps_no_snapshot": ratio_steps,
        "plain_median_block_s": plain_block_median,
        "guard_median_block_no_snapshot_s": guard_block_median,
        "ratio_median_blocks_no_snapshot": guard_block_median / plain_block_median,
        "ratio_gap": ratio_whole - ratio_steps,
        "target_ratio_gap_met": abs(ratio_whole - ratio_steps) <= TARGET_RATIO_GAP,
        "snapshot_interval": interval,
        "snapshots_detected_by": "ring" if ring_readable else "interval",
        "snapshot_steps_all": snapshot_at,
        "snapshots_measured": snapshot_rows,
        "guard_snapshot_seconds_last": snapshot_seconds,
        "ring_bytes": ring_bytes,
        "warmup_step_times_s": warm_times,
        "guard_actions": actions,
        "events": events,
        "plain_step_times_s": p_times,
        "guard_step_times_s": g_times,
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
    checkpoint writer's) apart."""

    def _targets(self) -> list[tuple[str, Any]]:
        return [("device", torch.cuda), ("event", torch.cuda.Event), ("stream", torch.cuda.Stream)]

    @contextlib.contextmanager
    def counting(self) -> Iterator[dict[str, int]]:
        counts = {"device": 0, "event": 0, "stream": 0, "other_threads": 0}
        training = threading.current_thread()
        saved = []
        for name, owner in self._targets():
            original = owner.__dict__.get("synchronize")
            if original is None:  # not this torch's layout: not counted
                continue
            saved.append((owner, original))

            def wrapper(*args: Any, _name: str = name, _fn: Any = original, **kw: Any) -> Any:
                if threading.current_thread() is training:
                    counts[_name] += 1
                else:
                    counts["other_threads"] += 1
                return _fn(*args, **kw)

            owner.synchronize = wrapper
        try:
            yield counts
        finally:
            for owner, original in saved:
                owner.synchronize = original


def syncs(s: Shape, device: torch.device, total: int) -> dict[str, Any]:
    snapshot_every, checkpoint_every = 15, 25
    batches = pool(s, device)
    model, opt = build(s, device)
    run_dir = Path(tempfile.mkdtemp(prefix="tg-gpu-syncs-"))
    config: dict[str, Any] = {
        "console": False,
        "recovery": {"snapshot_every": snapshot_every, "checkpoint_every": checkpoint_every},
    }
    guard = tg.Guard(model, opt, config=config, run_dir=run_dir)
    data = iter(guard.batches(Cycle(batches, total + 1)))
    cfg = guard.config
    stats_every = cfg.stats_every
    probe_every = cfg.precursors.every if cfg.precursors.enabled else 0
    debug_mode = device.type == "cuda"
    waits = Waits()
    per_step: list[dict[str, Any]] = []

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

    def guarded(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = loss_of(model, x, y, device)
        loss.backward()
        guard.step(loss)
        opt.zero_grad(set_to_none=True)

    for _ in range(total):
        batch = next(data)
        index = guard.global_step
        before = newest_snapshot(guard)
        n = counted(guarded, batch)
        took = newest_snapshot(guard) != before if before is not None else None
        if took is None:
            took = (index + 1) % guard.snapshot_interval == 0
        if index < 2:
            kind = "first"
        elif (index + 1) % checkpoint_every == 0:
            kind = "checkpoint"
        elif took:
            kind = "snapshot"
        elif (stats_every and index % stats_every == 0) or (
            probe_every and index % probe_every == 0
        ):
            kind = "sampled"
        else:
            kind = "ordinary"
        per_step.append({"step": index, "kind": kind, **n})
    guard.close()

    plain_model, plain_opt = build(s, device)
    plain_params = list(plain_model.parameters())

    def plain(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = loss_of(plain_model, x, y, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_params, 1.0)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    for i in range(22):  # the first two are not counted (Adam's state is made)
        n = counted(plain, batches[i % len(batches)])
        per_step.append({"step": i, "kind": "plain" if i >= 2 else "plain first", **n})
    shutil.rmtree(run_dir, ignore_errors=True)

    summary: dict[str, Any] = {}
    for kind in ("first", "ordinary", "sampled", "snapshot", "checkpoint", "plain"):
        rows = [r for r in per_step if r["kind"] == kind]
        summary[kind] = {"steps": len(rows)}
        for what in ("syncs", "device", "event", "stream", "other_threads"):
            counts = [r[what] for r in rows if r[what] is not None]
            summary[kind][what] = (
                {"mean": sum(counts) / len(counts), "max": max(counts)} if counts else None
            )
    return {
        "size": s.name,
        "counted": debug_mode,
        "stats_every": stats_every,
        "precursors_every": probe_every,
        "snapshot_every": snapshot_every,
        "checkpoint_every": checkpoint_every,
        "summary": summary,
        "per_step": per_step,
    }


# -- the report ----------------------------------------------------------------------------------
def ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def sec(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def report(result: dict[str, Any]) -> str:
    lines = [f"## GPU: {result['device_name']}", "", result["setup"], ""]
    rows = result["overhead"]
    if rows:
        lines += [
            "| model (params) | plain step, mean (ms) | guard step, mean incl. snapshots (ms) "
            "| guard / plain, whole run | guard / plain, median steps without a snapshot "
            "| median blocks without a snapshot | gap (target <= 0.01) | snapshots measured "
            "| guard actions |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {name} | error: {r['error']} | | | | | | | |")
                continue
            short = " (cut short)" if r["cut_short"] else ""
            lines.append(
                f"| {r['size']} ({r['params'] / 1e6:,.1f}M) | {ms(r['plain_mean_s'])} "
                f"| {ms(r['guard_mean_s'])} | {r['ratio_whole']:.3f}x "
                f"| {r['ratio_median_steps_no_snapshot']:.3f}x "
                f"| {r['ratio_median_blocks_no_snapshot']:.3f}x | {r['ratio_gap']:+.3f} "
                f"| {len(r['snapshots_measured'])} in {r['steps_per_variant']} steps{short} "
                f"| {r['guard_actions']} |"
            )
        lines.append("")
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
                f"Syncs per step at {sy['size']} (snapshot every {sy['snapshot_every']}, "
                f"checkpoint every {sy['checkpoint_every']}; mean, max in brackets): blocking "
                "syncs `set_sync_debug_mode('warn')` reports, and the waits it does not: "
                "`torch.cuda.synchronize()`, `Event`/`Stream.synchronize()` on the training "
                "thread, and any of them on other threads.",
                "",
                "| steps | count | set_sync_debug_mode | torch.cuda.synchronize "
                "| Event/Stream.synchronize | on other threads |",
                "| --- | --- | --- | --- | --- | --- |",
            ]

            def cell(v: dict[str, Any] | None) -> str:
                return "-" if v is None else f"{v['mean']:.2f} ({v['max']})"

            for kind, v in sy["summary"].items():
                if not v["steps"]:
                    continue
                waits = None
                if v["event"] is not None and v["stream"] is not None:
                    waits = {
                        "mean": v["event"]["mean"] + v["stream"]["mean"],
                        "max": v["event"]["max"] + v["stream"]["max"],
                    }
                lines.append(
                    f"| {kind} | {v['steps']} | {cell(v['syncs'])} | {cell(v['device'])} "
                    f"| {cell(waits)} | {cell(v['other_threads'])} |"
                )
            if not sy["counted"]:
                lines.append("")
                lines.append("`set_sync_debug_mode` needs CUDA: not counted here.")
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
    parser.add_argument("--skip", default="", help="Sections to skip: syncs,checkpoints.")
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
        f"(console off) with recovery.snapshot_every set per size; {memory}."
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
            f"whole-run ratio within {TARGET_RATIO_GAP} of the median ratio": (
                all(r["target_ratio_gap_met"] for r in overheads) if overheads else None
            ),
        }
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
    reserve = 0.0 if "checkpoints" in skip or args.smoke else 100.0  # for the checkpoints
    for size in names:
        s = shapes[size]
        steps = args.steps or s.steps
        result["overhead"][size] = guarded(
            f"overhead {s.name}",
            functools.partial(overhead, s, device, steps, deadline - reserve),
        )
        finish()
    big = result["overhead"].get(names[-1], {})
    if "error" not in big:
        snaps = big["snapshots_measured"]
        worst = [r["blocked_s"] for r in snaps if r["blocked_s"] is not None]
        warm_guard = big["warmup_step_times_s"]["guard"]
        result["snapshot"] = {
            "size": largest.name,
            "snapshots": snaps,
            "worst_blocked_s": max(worst) if worst else None,
            "warmup_max_s": max(warm_guard) if warm_guard else None,
            "warmup_median_s": statistics.median(warm_guard) if warm_guard else None,
            "ring_bytes": big["ring_bytes"],
            "events": big["events"],
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


if __name__ == "__main__":
    main()
