"""The `trainguard demo` run: a small GPT on a shipped public-domain text, trained three times side
by side (clean, unguarded, guarded) through four planted incidents, then a table and a report."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import trainguard as tg
from trainguard.analysis.run import RunRecord, load_run
from trainguard.demo.data import Batch, TextCorpus
from trainguard.demo.model import Block, TinyGPT, TinyGPTConfig
from trainguard.demo.scenarios import Fault, planted, train
from trainguard.line_file import stderr_report
from trainguard.run_files import remove_tree
from trainguard.sinks.html_report import Incident, incidents_of

LR = 3e-3
BATCH, SEQ = 16, 64
OUTCOME_AFTER = 30  # steps after the detection at which the outcome is read
SPARE = 200  # batches beyond `steps` for the guard to skip and replay
RUNS = ("clean", "unguarded", "guarded")
PROGRESS_EVERY_S = 5.0  # seconds between progress lines when the output is not a terminal
MAX_TOLD = 3  # guard actions named on one progress line


@dataclass(frozen=True)
class Plan:
    """Where the four incidents are planted: data faults by position in the data, the others by
    loop iteration (they happen in time, whatever the data)."""

    toxic_at: int  # a batch with shuffled targets and 8x inputs
    blowup: range  # iterations whose update lands at 100x the LR
    nan_at: int  # the iteration at which blocks.1.mlp adds log(0) to its output
    shard: range  # batches of a shard that decays into noise: the loss climbs

    @classmethod
    def for_steps(cls, steps: int) -> Plan:
        b, s = int(0.4 * steps), int(0.8 * steps)
        return cls(int(0.2 * steps), range(b, b + 5), int(0.6 * steps), range(s, s + 30))

    @property
    def fault(self) -> Fault:
        """The four incidents as a fault of the scenario harness."""
        return Fault(
            "demo",
            toxic=(self.toxic_at,),
            blowup=tuple(self.blowup),
            log0_at=self.nan_at,
            shard=tuple(self.shard),
        )

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("toxic batch", f"batch {self.toxic_at}"),
            ("LR blow-up (x100)", f"iterations {self.blowup.start}-{self.blowup.stop - 1}"),
            ("NaN in blocks.1.mlp (log 0)", f"iteration {self.nan_at}"),
            (
                "divergence (a shard decays into noise)",
                f"batches {self.shard.start}-{self.shard.stop - 1}",
            ),
        ]


@dataclass
class DemoRun:
    """One of the three runs: its model, the loss at each step, and what the guard did."""

    name: str
    model: TinyGPT
    optimizer: torch.optim.Optimizer
    guard: tg.Guard | None = None
    losses: dict[int, float] = field(default_factory=dict)  # the latest loss logged per step
    decisions: list[tuple[int, tg.Decision]] = field(default_factory=list)  # (iteration, ...)
    first_ids: dict[int, int] = field(default_factory=dict)  # iteration -> its batch's first id
    eval_loss: float = math.nan
    halted: tg.TrainingHalted | None = None

    @property
    def events(self) -> list[tg.Event]:
        return [e for _, d in self.decisions for e in d.events]


@dataclass
class DemoResult:
    """The three runs and the incident table."""

    runs: dict[str, DemoRun]
    rows: list[dict[str, str]]
    run_dir: Path
    report: Path | None

    @property
    def events(self) -> list[tg.Event]:
        return self.runs["guarded"].events


def run_demo(
    steps: int = 400,
    run_dir: str | Path = "runs/demo",
    seed: int = 0,
    console: Console | None = None,
) -> DemoResult:
    """Train the three runs for `steps` optimizer steps each, print what happened and write the
    guarded run's files and report.html into `run_dir`."""
    if steps < 200:
        raise tg.TrainguardError("the demo needs at least 200 steps; pass --steps 200 or more")
    console = console or Console()
    run_dir = Path(run_dir)
    _clear(run_dir)
    plan = Plan.for_steps(steps)
    corpus = TextCorpus.load()
    clean = list(corpus.batches(BATCH, SEQ, steps + SPARE, seed=seed + 1))
    faulty = planted(clean, plan.fault, corpus)
    runs = {name: _make_run(name, corpus, seed, run_dir) for name in RUNS}
    params = sum(p.numel() for p in runs["clean"].model.parameters())
    console.print(
        f"[bold]trainguard demo[/]: a GPT of {params:,} parameters learns Genesis and Exodus "
        f"(King James Version, {len(corpus.tokens) + len(corpus.held_out):,} characters) for "
        f"{steps} steps, three times side by side: clean, unguarded, and guarded by trainguard."
    )
    table = Table(title="Planted in the unguarded and guarded runs", title_justify="left")
    table.add_column("incident")
    table.add_column("where")
    for name, where in plan.rows():
        table.add_row(name, where)
    console.print(table)
    loops = {
        "clean": _train(runs["clean"], clean, steps, Fault()),
        "unguarded": _train(runs["unguarded"], faulty, steps, plan.fault),
        "guarded": _train(runs["guarded"], faulty, steps, plan.fault),
    }
    if console.is_terminal:
        _progress_bars(loops, runs, steps, console)
    else:  # a pipe or a file (`make demo | tee log`): live bars would show nothing until the end
        _progress_lines(loops, runs, steps, console)
    evals = list(corpus.batches(32, SEQ, 8, seed=999, held_out=True))
    for run in runs.values():
        run.eval_loss = _evaluate(run.model, evals)
    record = _record(run_dir, console)
    events = record.events if record is not None else [e.to_dict() for e in runs["guarded"].events]
    rows = _incidents(runs, plan, faulty, incidents_of(events))
    report = _report(record, run_dir, console)
    result = DemoResult(runs, rows, run_dir, report)
    console.print(_incident_table(rows))
    console.print(_final_table(runs))
    console.print(_verdict(runs, run_dir, report))
    return result


def _interleaved(loops: dict[str, Iterator[int]]) -> Iterator[tuple[str, int]]:
    """One iteration of each run in turn until every run is done: the run's name and its
    optimizer steps so far."""
    going = dict(loops)
    while going:
        for name in list(going):
            step = next(going[name], None)
            if step is None:
                del going[name]
                continue
            yield name, step


def _progress_bars(
    loops: dict[str, Iterator[int]], runs: dict[str, DemoRun], steps: int, console: Console
) -> None:
    """Train the runs under one live progress bar each, for a terminal."""
    columns = (
        TextColumn("{task.description:>9}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:>7.3f}"),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        tasks = {
            name: progress.add_task(name, total=steps, loss=math.nan, note="") for name in runs
        }
        for name, step in _interleaved(loops):
            run = runs[name]
            note = ""
            if run.decisions and run.decisions[-1][1].action != "step":
                note = run.decisions[-1][1].action
            progress.update(
                tasks[name], completed=step, loss=run.losses.get(step - 1, math.nan), note=note
            )


def _progress_lines(
    loops: dict[str, Iterator[int]],
    runs: dict[str, DemoRun],
    steps: int,
    console: Console,
    every_s: float = PROGRESS_EVERY_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Train the runs, printing a plain line every `every_s` seconds and at the end: each run's
    step and loss, and what the guard did since the line before."""
    start = last = clock()
    done = dict.fromkeys(runs, 0)
    shown: dict[str, int] = {}  # the steps on the line before
    said = 0  # the guarded run's decisions already told
    for name, step in _interleaved(loops):
        done[name] = step
        if clock() - last >= every_s:
            last = clock()
            said = _say_progress(runs, done, steps, last - start, said, console)
            shown = dict(done)
    if done != shown:
        _say_progress(runs, done, steps, clock() - start, said, console)


def _say_progress(
    runs: dict[str, DemoRun],
    done: dict[str, int],
    steps: int,
    elapsed_s: float,
    said: int,
    console: Console,
) -> int:
    """Print one progress line; returns how many of the guarded run's decisions are told."""
    figures = []
    for name, run in runs.items():
        loss = run.losses.get(done[name] - 1, math.nan)
        figures.append(f"{name} step {done[name]}/{steps} loss {loss:.3f}")
    line = f"demo {elapsed_s:4.0f} s: " + " | ".join(figures)
    guarded = runs.get("guarded")
    if guarded is not None:
        news = [d for _, d in guarded.decisions[said:] if d.action != "step"]
        said = len(guarded.decisions)
        told = [f"{d.action} at step {d.step}{_kinds(d)}" for d in news[:MAX_TOLD]]
        if len(news) > MAX_TOLD:
            told.append(f"and {len(news) - MAX_TOLD} more")
        if told:
            line += "; guarded: " + ", ".join(told)
    console.print(line, markup=False, highlight=False, soft_wrap=True)
    return said


def _kinds(decision: tg.Decision) -> str:
    """The kinds of a decision's events, in brackets; empty when it has none."""
    kinds = dict.fromkeys(e.kind for e in decision.events)
    return f" ({', '.join(kinds)})" if kinds else ""


def _clear(run_dir: Path) -> None:
    """A fresh demo each time; only the demo's own files go, never anything else there."""
    for name in ("events.jsonl", "metrics.jsonl", "quarantine.jsonl", "config.json"):
        (run_dir / name).unlink(missing_ok=True)
    remove_tree(run_dir / "checkpoints", stderr_report)  # a link there: only the link goes


def _make_run(name: str, corpus: TextCorpus, seed: int, run_dir: Path) -> DemoRun:
    torch.manual_seed(seed)  # the same initial weights for the three runs
    cfg = TinyGPTConfig(vocab_size=corpus.vocab_size, seq_len=SEQ, n_layer=2, n_head=4, d_model=64)
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    run = DemoRun(name, model, optimizer)
    if name == "guarded":
        config = tg.GuardConfig(console=False)
        # the defaults are sized for long runs (PaLM skipped 200-500 batches); this one is short
        config.recovery.snapshot_every = 25
        config.recovery.skip_after_explosion = 20
        config.recovery.rewarm_steps = 50
        run.guard = tg.Guard(model, optimizer, config=config, run_dir=run_dir)
    return run


def _train(run: DemoRun, data: list[Batch], steps: int, fault: Fault) -> Iterator[int]:
    """Train `run` through the time faults of `fault` (log(0) into blocks.1.mlp), yielding its
    optimizer steps so far after each iteration."""
    block = run.model.blocks[1]
    assert isinstance(block, Block)
    guard = run.guard
    try:
        for step in train(
            run.model, run.optimizer, data, steps, fault, guard=guard, module=block.mlp
        ):
            run.first_ids[step.iteration] = step.batch.ids[0]
            if step.decision is not None:
                run.decisions.append((step.iteration, step.decision))
                run.losses[step.decision.step] = float(step.decision.metrics["loss"])
            else:
                run.losses[step.iteration] = step.loss
            yield step.done
    except tg.TrainingHalted as halted:
        run.halted = halted
        run.decisions.append((-1, halted.decision))
    finally:
        if guard is not None:
            guard.close()


@torch.no_grad()
def _evaluate(model: TinyGPT, batches: list[Batch]) -> float:
    losses = [float(model.loss(model(b.x), b.y)) for b in batches]
    return sum(losses) / len(losses)


ALARMS = ("loss_spike", "grad_spike", "grad_explosion", "nonfinite", "divergence")


def _incidents(
    runs: dict[str, DemoRun], plan: Plan, data: list[Batch], cards: list[Incident]
) -> list[dict[str, str]]:
    """For each planted incident, what the guard saw and did and where each run stood after;
    a spike's type is that of the report card (`cards`) it is on."""
    guarded = runs["guarded"]
    iteration_of = {ids: it for it, ids in reversed(guarded.first_ids.items())}
    starts = [
        iteration_of.get(data[plan.toxic_at].ids[0]),
        plan.blowup.start,
        plan.nan_at,
        iteration_of.get(data[plan.shard.start].ids[0]),
    ]
    spans = [1, len(plan.blowup) + 5, 3, len(plan.shard)]
    rows = []
    for (name, _), start, span in zip(plan.rows(), starts, spans, strict=True):
        row = {"incident": name, "detected": "not reached", "as": "", "action": "", "outcome": ""}
        rows.append(row)
        if start is None:
            continue
        window = [d for it, d in guarded.decisions if start <= it < start + span]
        events = [e for d in window for e in d.events]
        alarm = next((e for e in events if e.kind in ALARMS), None)
        if alarm is None:
            row["detected"] = "not detected"
            continue
        row["detected"] = f"step {alarm.step}"
        row["as"] = alarm.kind + (f" ({_type_of(alarm, cards)})" if alarm.type else "")
        origin = next((e for e in events if e.kind == "nan_origin"), None)
        if origin is not None:
            row["as"] += f"; origin {origin.metrics.get('module', '?')}"
        row["action"] = _actions(window, events)
        row["outcome"] = _outcome(runs, alarm.step + OUTCOME_AFTER)
    return rows


def _type_of(alarm: tg.Event, cards: list[Incident]) -> str:
    """The spike's first type, and its final one: the type of the report card it is on (one
    computation for the table and the card, `incidents_of`)."""
    card = next((c for c in cards if alarm.step in c.steps), None)
    spike = card.first_spike if card is not None else None
    first = str(spike["type"] if spike is not None else alarm.type).replace("_", " ")
    later = str(card.type if card is not None and card.type else alarm.type).replace("_", " ")
    return first if later == first else f"{first}, revised to {later}"


def _actions(window: list[tg.Decision], events: list[tg.Event]) -> str:
    """What the guard did over an incident's steps, in a few words."""
    said: list[str] = []
    rollbacks = [e for d in window for e in d.events if e.kind == "rollback"]
    for d in window:
        if d.action == "rollback":
            break  # what the rollbacks did is told below, not the replayed steps' skips
        if d.action in ("skip", "halt") and (not said or said[-1] != d.action):
            said.append(d.action)
    if rollbacks:
        first = rollbacks[0].metrics
        skipped = first.get("skipped_batches")  # None: its batches are fed again
        data = f"batches {skipped[0]}-{skipped[1] - 1} skipped" if skipped else "none skipped"
        said.append(f"rollback to step {first['to_step']}, LR x{first['lr_factor']:.2g}, {data}")
    if len(rollbacks) > 1:
        spans = [e.metrics.get("skipped_batches") for e in rollbacks]
        count = sum(s[1] - s[0] for s in spans if s)
        said.append(
            f"{len(rollbacks) - 1} more rollback(s), the LR down to "
            f"x{rollbacks[-1].metrics['lr_scale']:.2g} of the schedule, {count} batches "
            "skipped in all"
        )
    if any(d.action == "halt" for d in window) and "halt" not in said:
        said.append("halt")
    if any(e.kind == "spike_samples" for e in events):
        said.append("samples quarantined")
    return "; ".join(said) or "stepped"


def _outcome(runs: dict[str, DemoRun], step: int) -> str:
    """The loss around `step` of the guarded and unguarded runs against the clean one."""

    def around(run: DemoRun) -> float:
        values = [run.losses[s] for s in range(step - 5, step + 5) if s in run.losses]
        return sum(values) / len(values) if values else math.nan

    clean = around(runs["clean"])
    parts = []
    for name in ("guarded", "unguarded"):
        value = around(runs[name])
        parts.append(f"{name} {_vs(value, clean)}")
    return f"at step {step}: " + ", ".join(parts)


def _vs(value: float, clean: float) -> str:
    if not math.isfinite(value):
        return "NaN"
    return f"{value:.3f} ({100 * (value / clean - 1):+.1f}%)"


def _incident_table(rows: list[dict[str, str]]) -> Table:
    table = Table(title="What trainguard saw and did", title_justify="left")
    for column in ("incident", "detected", "as", "action", "outcome (vs clean)"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["incident"], row["detected"], row["as"], row["action"], row["outcome"])
    return table


def _final_table(runs: dict[str, DemoRun]) -> Table:
    table = Table(title="Held-out loss at the end", title_justify="left")
    for column in ("run", "held-out loss", "vs clean", "what happened"):
        table.add_column(column)
    clean = runs["clean"].eval_loss
    for name in RUNS:
        run = runs[name]
        loss = run.eval_loss
        vs = "-" if name == "clean" else _vs(loss, clean).split(" ")[-1].strip("()")
        table.add_row(name, f"{loss:.3f}" if math.isfinite(loss) else "NaN", vs, _story(run))
    return table


def _story(run: DemoRun) -> str:
    if run.guard is None:
        bad = next((s for s, v in sorted(run.losses.items()) if not math.isfinite(v)), None)
        if run.name == "clean":
            return "no incidents"
        return f"NaN from step {bad} on" if bad is not None else "trained through every incident"
    counts = run.guard.action_counts
    told = ", ".join(
        f"{n} {a}{'s' if n > 1 else ''}" for a, n in counts.items() if n and a != "step"
    )
    return ("halted: " + str(run.halted.diagnosis) if run.halted else "") or told


def _record(run_dir: Path, console: Console) -> RunRecord | None:
    """The guarded run as its report reads it (None, said, when its files cannot be read)."""
    try:
        return load_run(run_dir)
    except tg.TrainguardError as exc:
        console.print(f"[red]no report: {exc}[/]")
        return None


def _report(record: RunRecord | None, run_dir: Path, console: Console) -> Path | None:
    from trainguard.sinks.html_report import write_report

    if record is None:
        return None
    try:
        return write_report(record, run_dir / "report.html", "trainguard demo")
    except tg.TrainguardError as exc:
        console.print(f"[red]no report: {exc}[/]")
        return None


def _verdict(runs: dict[str, DemoRun], run_dir: Path, report: Path | None) -> str:
    clean, guarded = runs["clean"].eval_loss, runs["guarded"].eval_loss
    unguarded = runs["unguarded"].eval_loss
    close = math.isfinite(guarded) and abs(guarded / clean - 1) <= 0.02
    failed = not math.isfinite(unguarded) or unguarded > 1.02 * clean
    lines = [
        f"guarded run {'within 2% of' if close else 'NOT within 2% of'} the clean run; "
        f"unguarded run {'failed' if failed else 'did not fail'}.",
        f"events, metrics and config in {run_dir}/"
        + (f"; report: {report}" if report is not None else ""),
    ]
    return "\n".join(lines)
