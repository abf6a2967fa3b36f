"""`trainguard analyze` on the held-out corpus of real logs in their native formats (data/logs:
OLMo stdout, ms-swift / Hugging Face Trainer stdout, trainer_state.json, nanoGPT stdout, a CSV
where no reader exists), judged against the labels in data/logs/labels.json, tune half and
report half apart, against issue 37's targets: every labelled incident found; at most 1 clean
log in 10 with any alarm; at most 1 false alarm per 10 logs.

Run: `python benchmarks/real_logs.py` (prints a per-file verdict table and a per-half summary;
`--write` also writes the "Real logs, held out" section of RESULTS.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainguard.analysis import analyze, read_log
from trainguard.events import TrainguardError

HERE = Path(__file__).resolve().parent
FOLDER = HERE.parent / "data" / "logs"
SLACK_ROWS = 3  # logged rows after a labelled span in which an event still belongs to it
HALVES = ("tune", "held_out")
Span = tuple[int, int]


def file_half(name: str) -> str:
    """The split of every real-log corpus here: sha256 of the file name, even is `tune`."""
    return "tune" if int(hashlib.sha256(name.encode()).hexdigest(), 16) % 2 == 0 else "held_out"


def load_labels(folder: Path = FOLDER) -> dict[str, dict[str, Any]]:
    """The corpus's labels, one entry per file."""
    labels: dict[str, dict[str, Any]] = json.loads((folder / "labels.json").read_text())
    return labels


def spans(label: dict[str, Any], key: str) -> list[Span]:
    return [(int(a), int(b)) for a, b in label.get(key) or []]


@dataclass
class Verdict:
    """One log judged: its labelled incidents found or missed, its alarms outside them."""

    name: str
    half: str
    healthy: bool
    kinds: list[str] = field(default_factory=list)  # the kind of each labelled incident
    fmt: str = ""
    points: int = 0
    error: str = ""
    incidents: list[str] = field(default_factory=list)  # "step kind" of each alarm
    found: list[Span] = field(default_factory=list)
    missed: list[Span] = field(default_factory=list)
    false_alarms: list[str] = field(default_factory=list)  # alarms outside every labelled span
    on_outliers: list[str] = field(default_factory=list)  # alarms on a labelled one-row outlier
    on_borderline: list[str] = field(default_factory=list)  # alarms where either answer is fair

    @property
    def alarmed(self) -> bool:
        """Any alarm but on a borderline span: what makes a clean log count as alarmed."""
        return bool(self.false_alarms or self.on_outliers)

    @property
    def verdict(self) -> str:
        if self.error:
            return "unread"
        if self.missed:
            return "MISS"
        if self.healthy:
            return "FALSE ALARM" if self.alarmed else "ok"
        return "found, with false alarms" if self.false_alarms else "found"


def judge(path: Path, label: dict[str, Any]) -> Verdict:
    """One log through `read_log` and `analyze` (default config), its alarms (events at warning
    or above) set against its labelled spans; an alarm within `SLACK_ROWS` logged rows after a
    span belongs to it (a persistence rule may confirm a few rows late). A label's `loss_column`
    names the loss column of a log whose loss no usual name gives (`--column`)."""
    half = label.get("half") or file_half(path.name)
    out = Verdict(path.name, half, bool(label["healthy"]), list(label.get("kinds") or []))
    try:
        data = read_log(path, loss_column=label.get("loss_column", "loss"))
        analysis = analyze(data)
    except TrainguardError as exc:
        out.error = str(exc)
        out.missed = spans(label, "instabilities")
        return out
    out.fmt, out.points = data.format or "", len(data.steps)
    gaps = np.diff(np.asarray(data.steps, dtype=float))
    slack = SLACK_ROWS * (float(np.median(gaps)) if len(gaps) else 1.0)

    def within(step: int, where: list[Span]) -> bool:
        return any(a <= step <= b + slack for a, b in where)

    incidents = spans(label, "instabilities")
    outliers, borderline = spans(label, "outliers"), spans(label, "borderline")
    steps = [int(e.step) for e in analysis.incidents]
    for e in analysis.incidents:
        shown = f"{int(e.step)} {e.kind}" + (f"/{e.type}" if e.type else "")
        out.incidents.append(shown)
        step = int(e.step)
        if within(step, incidents):
            continue
        if within(step, borderline):
            out.on_borderline.append(shown)
        elif within(step, outliers):
            out.on_outliers.append(shown)
        else:
            out.false_alarms.append(shown)
    for a, b in incidents:
        (out.found if any(a <= s <= b + slack for s in steps) else out.missed).append((a, b))
    return out


def judge_all(folder: Path = FOLDER) -> list[Verdict]:
    labels = load_labels(folder)
    return [judge(folder / name, labels[name]) for name in sorted(labels)]


def summary(verdicts: list[Verdict]) -> dict[str, Any]:
    """The three targets over a set of logs."""
    clean = [v for v in verdicts if v.healthy]
    sick = [v for v in verdicts if not v.healthy]
    labelled = sum(len(v.found) + len(v.missed) for v in verdicts)
    found = sum(len(v.found) for v in verdicts)
    alarmed = [v for v in clean if v.alarmed]
    false_alarms = sum(len(v.false_alarms) + len(v.on_outliers) for v in verdicts)
    per_10 = 10 * false_alarms / len(verdicts) if verdicts else 0.0
    return {
        "logs": len(verdicts),
        "clean logs": len(clean),
        "logs with incidents": len(sick),
        "incidents": labelled,
        "incidents found": found,
        "every incident found": found == labelled,
        "clean logs alarmed": len(alarmed),
        "clean alarmed share ok": len(alarmed) * 10 <= max(len(clean), 1),
        "false alarms": false_alarms,
        "false alarms per 10 logs": per_10,
        "false alarms ok": per_10 <= 1.0,
        "unread": [v.name for v in verdicts if v.error],
    }


def ok(flag: bool) -> str:
    return "**pass**" if flag else "**fail**"


def half_lines(title: str, verdicts: list[Verdict]) -> list[str]:
    s = summary(verdicts)
    return [
        f"**{title}** ({s['logs']} logs: {s['clean logs']} clean, "
        f"{s['logs with incidents']} with {s['incidents']} labelled incidents):",
        "",
        f"- every labelled incident found: {ok(s['every incident found'])} "
        f"({s['incidents found']} of {s['incidents']})",
        f"- at most 1 clean log in 10 with any alarm: {ok(s['clean alarmed share ok'])} "
        f"({s['clean logs alarmed']} of {s['clean logs']})",
        f"- at most 1 false alarm per 10 logs: {ok(s['false alarms ok'])} "
        f"({s['false alarms']} false alarms, {s['false alarms per 10 logs']:.1f} per 10 logs)",
        *([f"- unread: {', '.join(s['unread'])}"] if s["unread"] else []),
        "",
    ]


def table(verdicts: list[Verdict]) -> list[str]:
    rows = [
        "| half | log | format | points | label | verdict | alarms (step kind/type) |",
        "|---|---|---|---:|---|---|---|",
    ]
    for v in sorted(verdicts, key=lambda v: (HALVES.index(v.half), v.name)):
        label = (
            "clean"
            if v.healthy
            else "incident "
            + ", ".join(f"{a}-{b}" for a, b in sorted(v.found + v.missed))
            + f" ({', '.join(v.kinds)})"
        )
        alarms = "; ".join(v.incidents[:6]) + (
            f"; ... ({len(v.incidents)} in all)" if len(v.incidents) > 6 else ""
        )
        rows.append(
            f"| {v.half} | {v.name} | {v.fmt or '-'} | {v.points:,} | {label} | {v.verdict} | "
            f"{alarms or v.error or 'none'} |"
        )
    return rows


def report(verdicts: list[Verdict]) -> str:
    lines = [
        "Real logs in their native formats from repositories the project had not used "
        "(data/logs, sources in its SOURCES.md, labels in labels.json: clean, or an incident "
        "with its step span and kind, from the authors' words where they gave any). Halves by "
        "the sha256 rule of `trust.file_half`. What was tuned on it (issue 37): the grading of "
        "grad outliers by the loss's response on two tune-half logs (swift-gemma4-fsdp2, "
        "olmo-1b-0724-continue); the level-shift rule on the tune half's mlx-lora log among "
        "generated ones; the zero-gradient rule was written after the report half's "
        "olmo-20m-tied-emb-zero-grad had been seen missed, so that hit is not a held-out one. "
        "The build-nanogpt logs were added after these changes; no rule was changed after "
        "them. An alarm is an `analyze` event at warning or above; one on a labelled "
        "one-row outlier counts as a false alarm here, one on a `borderline` span counts "
        "neither way.",
        "",
        "Second batch (issue 37 item 6, a wider corpus; labelled before `analyze` first ran "
        "on it, no rule changed after): an llm.c pretraining `main.log` (GPT-2 124M, 19,552 "
        "steps); four nanochat-family pretraining stdouts (`speedrun.log`: three d20 "
        "speedruns, one cut short at step 2,369, and nanoswe's 24 h d42 run on coding-agent "
        "data; the `nanochat` reader was added for them); seven CS336 TinyStories runs of two "
        "students' own PyTorch trainers (CSV and JSONL; LR sweeps whose LR 1 and 0.3 runs "
        "diverge, the others clean or borderline); three seeds of a JAX (optax/orbax) run "
        "resumed 10 times, its step going back ~260 at each resume, with the loss stepping at "
        "the resumes (one x2.7 step-up that sets the final loss labelled an incident, the "
        "others borderline). On this batch the tune half first failed two targets: nanoswe's "
        "per-step loss is heavy-tailed (rows of 1.5-2.0 around a median of 0.3-0.5, each "
        "undone on the next row) and `loss_spike` alarmed on seven of them (data toxicity, "
        "z 5-12.5). A `loss_spike` rule was then tuned on that tune-half log: in a run whose "
        "baseline steps (under the persistence threshold) have doubled the recent mean, the "
        "ratio rule also needs the loss past the noise's reach, and the one-row excursions "
        "that came back before they could persist count in the reach, carried out from their "
        "own rate at the body's tail power. The generated-curve detection figures are "
        "unchanged (3 seeds, every alarm and type the same), and the report half was measured "
        "after, no rule changed on it. The nanoswe result rests on a thin margin: its first "
        "excursion (3433, z 7.9) stays under the reach then (8.2) by 4%; had it been flagged, "
        "the rule would learn nothing from it (a flagged spike never joins the noise) and "
        "4354 (z 12.4 against a reach of 10.5) would still alarm. The dwarkeshsp d20 run keeps "
        "its one `loss_spike` at 16347, a 9% rise held 3 rows on a very smooth curve (z=20), "
        "which the label (written before) calls clean: nanochat prints an EMA (0.9) of the "
        "loss, and the rise decays by ~10% of its height a row, as such an EMA of a raw jump "
        "of ~50% for about three steps would, the largest in the run; the detector reads a "
        "real transient spike there, and the label is left as written. "
        "Caveats: the JAX run is a W&B CSV export read by the generic reader "
        "(`--column loss_ce`), not a JAX stdout; no MaxText, levanter, Megatron, "
        "GPT-NeoX, torchtitan or nanotron log whose repository could be named was found, so "
        "no reader was added for them; logs cluster by repository (four of one student's "
        "sweep, three seeds of one config, three runs of one speedrun script), so they are "
        "not independent draws; the halves fell 6 tune / 9 report, and the tune half gained "
        "one incident, the report half two; the report half's false alarm at 4640 on "
        "jax-birdjepa-resume-seed2 is the labelled 4505 step-up confirmed 27 rows after the "
        "span drawn for it (4505-4600, set before the run), counted as a false alarm as the "
        "label stands.",
        "",
    ]
    for half, title in (("tune", "Tune half"), ("held_out", "Report half (held out)")):
        lines += half_lines(title, [v for v in verdicts if v.half == half])
    lines += table(verdicts)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folder", type=Path, default=FOLDER)
    parser.add_argument("--write", action="store_true", help="write the RESULTS.md section")
    args = parser.parse_args()
    verdicts = judge_all(args.folder)
    body = report(verdicts)
    print(body)
    if args.write:
        from _common import write_section

        write_section(
            "real_logs",
            "Real logs, held out (issue 37)",
            body,
            "python benchmarks/real_logs.py --write",
        )
    sys.exit(0)


if __name__ == "__main__":
    main()
