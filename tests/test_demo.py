"""The demo's progress when its output is not a terminal (`make demo | tee log`), its actions,
and the types its table and its report cards say."""

from __future__ import annotations

import html
import io
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

import trainguard as tg
from trainguard.analysis.run import RunRecord
from trainguard.demo.run import ALARMS, DemoRun, _actions, _progress_lines, _type_of
from trainguard.sinks.html_report import _cards, incidents_of

# the guarded run's events of `trainguard demo` (seed 0, 400 steps), metrics cut to a few keys
DEMO_EVENTS = Path(__file__).parent / "data" / "demo_events.jsonl"


def fake_run(run: DemoRun, steps: int, skip_at: int | None = None) -> Iterator[int]:
    """A run's loop as `_train` drives it: the loss logged per step, the guard's decisions."""
    for step in range(steps):
        run.losses[step] = 3.0 - step * 0.1
        if run.name == "guarded" and step == skip_at:
            spike = tg.Event(step, "loss_spike", "critical", "a spike")
            run.decisions.append((step, tg.Decision(step, "skip", [spike])))
        elif run.name == "guarded":
            run.decisions.append((step, tg.Decision(step, "step")))
        yield step + 1


def test_progress_is_a_plain_line_every_few_seconds_when_not_a_terminal():
    model = torch.nn.Linear(2, 2)
    runs = {
        name: DemoRun(name, model, torch.optim.SGD(model.parameters()))
        for name in ("clean", "unguarded", "guarded")
    }
    loops = {name: fake_run(run, 10, skip_at=3) for name, run in runs.items()}
    out = io.StringIO()
    console = Console(file=out, width=80)  # a file: not a terminal
    assert not console.is_terminal
    seconds = itertools.count()  # each look at the clock: one second later
    _progress_lines(loops, runs, 10, console, every_s=5.0, clock=lambda: float(next(seconds)))
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3  # during the run, not only at its end
    assert all(line.startswith("demo ") and "\x1b" not in line for line in lines)  # plain text
    assert "clean step 10/10 loss 2.100" in lines[-1] and "guarded step 10/10" in lines[-1]
    told = [line for line in lines if "guarded: skip at step 3 (loss_spike)" in line]
    assert len(told) == 1  # said once, on the first line after it


def test_a_rollback_that_feeds_its_batches_again_is_not_said_to_skip_any():
    def rollback(skipped: list[int] | None) -> tg.Decision:
        metrics = {"to_step": 150, "lr_factor": 1.0, "skipped_batches": skipped}
        event = tg.Event(166, "rollback", "warning", "rolled back", metrics=metrics)
        return tg.Decision(166, "rollback", [event])

    assert _actions([rollback(None)], []) == "rollback to step 150, LR x1, none skipped"
    assert _actions([rollback([321, 327])], []) == (
        "rollback to step 150, LR x1, batches 321-326 skipped"
    )


def test_the_table_and_the_report_card_say_the_same_final_type_for_every_demo_fault():
    events = [json.loads(line) for line in DEMO_EVENTS.open()]
    cards = incidents_of(events)
    record = RunRecord(Path("demo"), np.arange(400), {"loss": np.full(400, 2.0)}, events=events)
    page = _cards(record, cards)
    said: dict[int, str] = {}  # a card's first step: its cause, or "" when it names none
    for card in re.findall(r'<div class="incident".*?</div>', page, re.S):
        cause = re.search(r"<dt>cause</dt><dd>(.*?)</dd>", card)
        step = int(re.search(r'data-step="(\d+)"', card).group(1))
        said[step] = html.unescape(cause.group(1)) if cause else ""
    table: dict[int, str] = {}
    for fault_step in (80, 161, 223, 321):  # the toxic batch, the LR blow-up, the NaN, the shard
        first = next(e for e in events if e["step"] == fault_step and e["kind"] in ALARMS)
        alarm = tg.Event(first["step"], first["kind"], first["severity"], "", type=first["type"])
        card = next(c for c in cards if fault_step in c.steps)
        table[card.step] = _type_of(alarm, cards) if alarm.type else ""
        assert table[card.step].split(", revised to ")[-1] == said[card.step]
    assert list(table.values()) == [
        "data toxicity",
        "data toxicity, revised to gradient explosion",
        "",  # the NaN: no spike type
        "data toxicity",  # the shard: data, though its fourth replay was revised to explosion
    ]
