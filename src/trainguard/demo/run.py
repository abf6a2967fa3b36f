"""The `trainguard demo` run: a tiny GPT with planted incidents, guarded, shown step by step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

import trainguard as tg
from trainguard.demo.data import MarkovCorpus
from trainguard.demo.model import TinyGPT, TinyGPTConfig
from trainguard.sinks import ConsoleSink

LR = 3e-3


@dataclass
class DemoResult:
    """What the demo run saw and did."""

    events: list[tg.Event]
    skipped: list[int]
    final_loss: float
    toxic_step: int
    blowup_step: int
    run_dir: Path


def run_demo(
    steps: int = 300,
    run_dir: str | Path = "runs/demo",
    seed: int = 0,
    console: Console | None = None,
) -> DemoResult:
    """Train TinyGPT for `steps` with a toxic batch at 40% and LR x100 for 5 steps at 70%."""
    if steps < 100:
        raise tg.TrainguardError("the demo needs at least 100 steps; pass --steps 100 or more")
    console = console or Console()
    run_dir = Path(run_dir)
    for name in ("events.jsonl", "metrics.jsonl", "quarantine.jsonl"):
        (run_dir / name).unlink(missing_ok=True)  # a fresh demo each time, never a user's run
    toxic_step, blowup_step = int(0.4 * steps), int(0.7 * steps)
    corpus = MarkovCorpus(seed=seed)
    torch.manual_seed(seed)
    model = TinyGPT(TinyGPTConfig(d_model=64, n_layer=2, n_head=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    guard = tg.Guard(
        model,
        optimizer,
        config=tg.GuardConfig(console=False),
        run_dir=run_dir,
        sinks=[ConsoleSink(console)],
    )
    console.print(
        f"[bold]trainguard demo[/]: TinyGPT ({sum(p.numel() for p in model.parameters()):,} "
        f"parameters) on a synthetic corpus, {steps} steps; planted: a toxic batch at step "
        f"{toxic_step}, LR x100 for 5 steps from step {blowup_step}."
    )
    events: list[tg.Event] = []
    skipped: list[int] = []
    losses: list[float] = []
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}  grad {task.fields[grad]:.3g}"),
        TimeRemainingColumn(),
    )
    data = list(corpus.batches(16, 32, steps + 400, seed=seed + 1))  # spare batches to skip
    data[toxic_step] = corpus.make_toxic(data[toxic_step])
    rollbacks: list[int] = []
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("training", total=steps, loss=float("nan"), grad=float("nan"))
        for iteration, batch in enumerate(guard.batches(data)):
            if guard.global_step >= steps:
                break
            blowup = blowup_step <= iteration < blowup_step + 5  # a fault in time, not in data
            for group in optimizer.param_groups:
                group["lr"] *= 100 if blowup else 1
            loss = model.loss(model(batch.x, batch.input_scale), batch.y)
            loss.backward()  # type: ignore[no-untyped-call]
            decision = guard.step(loss, batch_ids=batch.ids)
            if blowup and decision.action != "rollback":  # a rollback already reset the LR
                for group in optimizer.param_groups:
                    group["lr"] /= 100
            optimizer.zero_grad(set_to_none=True)
            events += decision.events
            if decision.action == "skip":
                skipped.append(decision.step)
            if decision.action == "rollback":
                rollbacks.append(decision.step)
            losses.append(float(decision.metrics["loss"]))
            progress.update(
                task,
                completed=guard.global_step,
                loss=losses[-1],
                grad=float(decision.metrics["grad_norm"]),
            )
    guard.close()
    final = sum(losses[-20:]) / 20
    result = DemoResult(events, skipped, final, toxic_step, blowup_step, run_dir)
    console.print(_table(result))
    console.print(_summary(result))
    return result


def _table(result: DemoResult) -> Table:
    table = Table(title="What trainguard saw and did", title_justify="left")
    for column in ("step", "event", "action"):
        table.add_column(column, no_wrap=True)
    table.add_column("what", overflow="fold", ratio=1)
    for e in result.events:
        event = e.kind + (f"\n{e.type}" if e.type else "") + f"\n{e.severity}"
        table.add_row(str(e.step), event, e.action or "", e.message)
    return table


def _summary(result: DemoResult) -> str:
    def first(kinds: tuple[str, ...], lo: int, hi: int) -> tg.Event | None:
        return next((e for e in result.events if e.kind in kinds and lo <= e.step <= hi), None)

    done = {"skip": "skipped", "step": "stepped", "halt": "halted"}
    lines = []
    toxic = first(("loss_spike",), result.toxic_step, result.toxic_step)
    if toxic is not None:
        lines.append(
            f"toxic batch at step {result.toxic_step}: detected at step {toxic.step} as "
            f"{toxic.kind} ({toxic.type}) and {done.get(toxic.action or '', 'logged')}."
        )
    else:
        lines.append(f"toxic batch at step {result.toxic_step}: not detected.")
    blow = first(
        ("grad_spike", "grad_explosion", "loss_spike"), result.blowup_step, result.blowup_step + 6
    )
    if blow is not None:
        rollback = next((e for e in result.events if e.kind == "rollback"), None)
        then = (
            f"then rolled back to the known-good state at step {rollback.metrics['to_step']} "
            f"with the LR x{rollback.metrics['lr_factor']:.2g}"
            if rollback is not None
            else "no rollback was needed"
        )
        lines.append(
            f"LR blow-up from step {result.blowup_step}: detected at step {blow.step} as "
            f"{blow.kind}; {then}."
        )
    else:
        lines.append(f"LR blow-up from step {result.blowup_step}: not detected.")
    lines.append(
        f"final loss (mean of the last 20 steps): {result.final_loss:.3f}; "
        f"events and metrics in {result.run_dir}/"
    )
    return "\n".join(lines)
