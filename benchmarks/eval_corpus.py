"""The evaluation corpus: real Hugging Face `trainer_state.json` files (`data/evals`, copied
byte-for-byte from public repositories, listed in its SOURCES.md) labelled for evaluation decline
(forgetting, overfitting), and the `eval_decline` detector scored on them, per half.

Labels (`data/evals/labels.json`; the rule in `data/evals/README.md`): `draft_label` applies the
written rule to a file's `log_history`; a label is its draft unless it carries an `override` with
its reason (read by eye, before any detector ran on the files). A file's half is
`trust.file_half` of its name, the sha256 split of the real logs in `data/curves`.

Scoring: each file is read with `read_log` and judged with `analyze` (default config), as
`trainguard analyze` does; every `eval_decline` event is a firing at its step. A labelled decline
span is caught when a firing (of whichever evaluation) falls in it or up to SLACK_EVALS
evaluations after its end; its lag runs from the span's first step to the first such firing (in
steps, and in evaluations of the file). A firing outside every decline span (and its slack)
counts as borderline when it falls in a borderline span, as "in divergence" when it falls in an
`eval_up_with_train` span (the training loss rose too: a false `eval_decline`), and as a false
warning otherwise. The tune half is the one to tune on; the held-out half is the one reported.

Run: python benchmarks/eval_corpus.py [--corpus DIR] [--no-write] [--draft]
(`--draft` prints where labels.json differs from the rule's draft and exits).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trust import file_half  # noqa: E402  (the real logs' split, reused, not copied)

CORPUS = ROOT / "data" / "evals"
HALVES = ("tune", "held_out")
SLACK_EVALS = 1  # evaluations after a decline span's end in which a firing still catches it
SPAN_KEYS = ("decline", "borderline", "eval_up_with_train")

# -- the labelling rule (data/evals/README.md) ------------------------------------------------

LOWER_IS_BETTER = ("loss", "wer", "cer", "perplexity")
NOT_LABELLED = (  # bookkeeping, breakdowns and counts: no evaluation of the model to label
    "runtime",
    "per_second",
    "samples",
    "gen_len",
    "num_tokens",
    "total",
    "number",
    "thresholds",
    "precision",
    "recall",
    "epoch",
)
PER_CLASS = re.compile(r"eval_T\d+_")  # per-tag breakdowns of a token classifier
BASE_MARGIN = {True: 0.05, False: 0.02}  # relative worsening past the best: losses, scores
NOISE_FACTOR = 2.0  # ... or this many times the median relative change between evaluations
TRAIN_FALLEN = 0.95  # a decline's training loss ends at most this share of its level at the best
TRAIN_RISEN = 1.05  # every worse evaluation's training loss above this share: eval_up_with_train


def lower_is_better(name: str) -> bool:
    return any(s in name.lower() for s in LOWER_IS_BETTER)


def labelled(name: str) -> bool:
    """Whether the rule labels evaluation `name` (the model's losses and task scores)."""
    low = name.lower()
    return (
        name.startswith("eval_")
        and not any(s in low for s in NOT_LABELLED)
        and not PER_CLASS.match(name)
    )


def train_points(history: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(step, loss) of the log_history entries with a training loss."""
    return [
        (float(r["step"]), float(r["loss"]))
        for r in history
        if isinstance(r.get("loss"), int | float) and isinstance(r.get("step"), int | float)
    ]


def eval_points(history: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Every numeric `eval_*` value of the log_history, by name, in step order: (step, value);
    an evaluation logged twice at one step (the Trainer's final one) counts once, the later."""
    out: dict[str, dict[float, float]] = {}
    for r in history:
        step = r.get("step")
        if not isinstance(step, int | float):
            continue
        for k, v in r.items():
            if k.startswith("eval_") and isinstance(v, int | float) and not isinstance(v, bool):
                out.setdefault(k, {})[float(step)] = float(v)
    return {k: sorted(v.items()) for k, v in out.items()}


def _worse(name: str, best: float, value: float) -> float:
    """How much worse `value` is than `best`, relative to `best` (negative: better)."""
    gap = value - best if lower_is_better(name) else best - value
    return gap / abs(best) if best else 0.0


def _union(spans: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def draft_label(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The written rule applied to one `log_history` (see data/evals/README.md)."""
    train = train_points(history)
    found: dict[str, list[list[int]]] = {k: [] for k in SPAN_KEYS}
    metrics: set[str] = set()
    notes: list[str] = []
    for name, pts in sorted(eval_points(history).items()):
        if not labelled(name) or len(pts) < 3:
            continue
        changes = [abs(b - a) / max(abs(a), 1e-12) for (_, a), (_, b) in itertools.pairwise(pts)]
        margin = max(BASE_MARGIN[lower_is_better(name)], NOISE_FACTOR * statistics.median(changes))

        def level(i: int, pts: list[tuple[float, float]] = pts) -> float | None:
            """The mean training loss logged since the evaluation before (else the nearest)."""
            lo = pts[i - 1][0] if i else -1.0
            window = [loss for s, loss in train if lo < s <= pts[i][0]]
            if window:
                return sum(window) / len(window)
            near = min(train, key=lambda p: abs(p[0] - pts[i][0]), default=None)
            return None if near is None else near[1]

        best, i = 0, 1
        declines: dict[int, list[int]] = {}  # the best's index -> its decline span
        while i < len(pts):
            gap = _worse(name, pts[best][1], pts[i][1])
            if gap < 0:
                best = i
            if gap <= margin:
                i += 1
                continue
            j = i
            while j + 1 < len(pts) and _worse(name, pts[best][1], pts[j + 1][1]) > margin:
                j += 1
            span = [int(pts[i][0]), int(pts[j][0])]
            at_best, levels = level(best), [level(q) for q in range(i, j + 1)]
            later_best = any(_worse(name, pts[best][1], v) < 0 for _, v in pts[j + 1 :])
            if j == i:  # one worse evaluation: noise, unless it is the last one
                if j == len(pts) - 1:
                    found["borderline"].append(span)
                    notes.append(f"{name}: one worse evaluation, the last")
            elif at_best is None or len(train) < len(pts) / 2 or None in levels:
                found["borderline"].append(span)
                notes.append(f"{name}: worse x{j - i + 1}, too few training losses to tell")
            elif all(t is not None and t > TRAIN_RISEN * at_best for t in levels):
                found["eval_up_with_train"].append(span)
                notes.append(f"{name}: worse x{j - i + 1} with the training loss up")
            elif later_best:
                found["borderline"].append(span)
                notes.append(f"{name}: worse x{j - i + 1}, then a new best")
            elif not (levels[0] <= at_best and (levels[-1] or 0.0) <= TRAIN_FALLEN * at_best):
                found["borderline"].append(span)
                notes.append(f"{name}: worse x{j - i + 1}, training loss not clearly falling")
            else:
                held = declines.setdefault(best, span)
                held[1] = span[1]  # stretches after the same best, apart only within the margin
                metrics.add(name)
                most = max(_worse(name, pts[best][1], pts[q][1]) for q in range(i, j + 1))
                notes.append(
                    f"{name}: best {pts[best][1]:.4g} at {int(pts[best][0])}, worse by up to "
                    f"{100 * most:.0f}% (margin {100 * margin:.1f}%), training loss "
                    f"{at_best:.3g} -> {levels[-1]:.3g}"
                )
            i = j + 1
        found["decline"].extend(declines.values())
    label: dict[str, Any] = {k: _union(v) for k, v in found.items()}
    label["decline_metrics"] = sorted(metrics)
    label["healthy"] = not any(label[k] for k in SPAN_KEYS)
    label["notes"] = notes
    return label


# -- the corpus --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    repo: str
    commit: str
    path: str
    license: str


@dataclass
class CorpusFile:
    name: str
    path: Path
    history: list[dict[str, Any]]
    label: dict[str, Any]
    source: Source
    half: str
    eval_steps: list[int] = field(default_factory=list)  # every step with an evaluation


SOURCE_FIELD = re.compile(r"^- (repo|path|commit|license): (.*)$")


def read_sources(path: Path) -> dict[str, Source]:
    """SOURCES.md's `### file` sections: repository, path, 40-hex commit and licence of each."""
    found: dict[str, dict[str, str]] = {}
    name = None
    for line in path.read_text().splitlines():
        if line.startswith("### "):
            name = line[4:].strip()
            found[name] = {}
        elif name and (m := SOURCE_FIELD.match(line)):
            found[name][m.group(1)] = m.group(2).strip().strip("`")
    out = {}
    for name, f in found.items():
        missing = {"repo", "path", "commit", "license"} - set(f)
        if missing:
            raise ValueError(f"SOURCES.md: {name} has no {', '.join(sorted(missing))}")
        if not re.fullmatch(r"[0-9a-f]{40}", f["commit"]):
            raise ValueError(f"SOURCES.md: {name}'s commit {f['commit']!r} is not 40 hex digits")
        out[name] = Source(f["repo"], f["commit"], f["path"], f["license"])
    return out


def load_corpus(folder: Path = CORPUS) -> list[CorpusFile]:
    """Every corpus file with its label, source and half; raises ValueError where a file is not
    listed in SOURCES.md or labels.json, a listing has no file, or a file does not parse."""
    sources = read_sources(folder / "SOURCES.md")
    labels: dict[str, dict[str, Any]] = json.loads((folder / "labels.json").read_text())
    names = sorted(p.name for p in folder.glob("*.json") if p.name != "labels.json")
    for what, listed in (("SOURCES.md", sources), ("labels.json", labels)):
        if unlisted := sorted(set(names) - set(listed)):
            raise ValueError(f"not in {what}: {', '.join(unlisted)}")
        if absent := sorted(set(listed) - set(names)):
            raise ValueError(f"{what} lists files that are not there: {', '.join(absent)}")
    out = []
    for name in names:
        try:
            state = json.loads((folder / name).read_bytes())
        except ValueError as exc:
            raise ValueError(f"{name}: not JSON ({exc})") from None
        history = state.get("log_history") if isinstance(state, dict) else None
        if not isinstance(history, list):
            raise ValueError(f"{name}: no log_history list")
        half = file_half(name)
        if labels[name].get("half") != half:
            raise ValueError(f"labels.json: {name}'s half is not {half} (trust.file_half)")
        steps = sorted({int(s) for pts in eval_points(history).values() for s, _ in pts})
        out.append(
            CorpusFile(name, folder / name, history, labels[name], sources[name], half, steps)
        )
    return out


def label_differences(f: CorpusFile) -> dict[str, tuple[Any, Any]]:
    """Where the file's label departs from the rule's draft: key -> (label, draft)."""
    draft = draft_label(f.history)
    keys = (*SPAN_KEYS, "decline_metrics", "healthy")
    return {k: (f.label.get(k), draft[k]) for k in keys if f.label.get(k) != draft[k]}


# -- scoring -----------------------------------------------------------------------------------

Firing = tuple[int, str]  # (step, evaluation name)


def analyze_firings(path: Path) -> tuple[list[Firing], set[str]]:
    """The `eval_decline` events `analyze` raises over the file, as `trainguard analyze` would,
    and the names of the evaluations the log reader found in it."""
    import trainguard as tg
    from trainguard.analysis import analyze, read_log

    data = read_log(path)
    analysis = analyze(data, tg.GuardConfig())
    firings = [
        (int(e.step), str(e.metrics.get("name", "")))
        for e in analysis.events
        if e.kind == "eval_decline"
    ]
    return firings, set(data.named_evaluations())


def _inside(step: int, spans: Sequence[Sequence[int]]) -> bool:
    return any(a <= step <= b for a, b in spans)


def _slack_end(f: CorpusFile, end: int) -> int:
    """The step SLACK_EVALS evaluations after `end` (the last evaluation's at most)."""
    later = [s for s in f.eval_steps if s > end]
    return later[min(SLACK_EVALS, len(later)) - 1] if later else end


@dataclass
class FileScore:
    name: str
    half: str
    healthy: bool  # no labelled span of any kind
    firings: list[Firing]
    caught: list[tuple[list[int], int, int] | None]  # per decline span: (span, lag steps, evals)
    borderline: list[Firing]
    in_divergence: list[Firing]
    false: list[Firing]
    declining: list[str]  # the labelled declining evaluations
    unread: list[str]  # those the log reader did not return


def score_file(f: CorpusFile, firings: list[Firing], read: set[str] | None = None) -> FileScore:
    declines = [list(s) for s in f.label["decline"]]
    widened = [[a, _slack_end(f, b)] for a, b in declines]
    caught: list[tuple[list[int], int, int] | None] = []
    for span, (a, b) in zip(declines, widened, strict=True):
        hits = sorted(s for s, _ in firings if a <= s <= b)
        if hits:
            lag_evals = sum(1 for s in f.eval_steps if a < s <= hits[0])
            caught.append((span, hits[0] - a, lag_evals))
        else:
            caught.append(None)
    rest = [x for x in firings if not _inside(x[0], widened)]
    borderline = [x for x in rest if _inside(x[0], f.label["borderline"])]
    rest = [x for x in rest if x not in borderline]
    in_divergence = [x for x in rest if _inside(x[0], f.label["eval_up_with_train"])]
    false = [x for x in rest if x not in in_divergence]
    healthy = bool(f.label["healthy"])
    unread = [m for m in f.label["decline_metrics"] if read is not None and m not in read]
    declining = list(f.label["decline_metrics"])
    return FileScore(
        f.name,
        f.half,
        healthy,
        firings,
        caught,
        borderline,
        in_divergence,
        false,
        declining,
        unread,
    )


def half_summary(scores: list[FileScore]) -> dict[str, Any]:
    spans = [c for s in scores for c in s.caught]
    hits = [c for c in spans if c is not None]
    lags = [c[1] for c in hits]
    lag_evals = [c[2] for c in hits]
    healthy = [s for s in scores if s.healthy]
    return {
        "files": len(scores),
        "decline_files": sum(1 for s in scores if s.caught),
        "decline_spans": len(spans),
        "caught": len(hits),
        "lag_steps_median": statistics.median(lags) if lags else None,
        "lag_steps_max": max(lags) if lags else None,
        "lag_evals_median": statistics.median(lag_evals) if lag_evals else None,
        "lag_evals_max": max(lag_evals) if lag_evals else None,
        "healthy_files": len(healthy),
        "healthy_files_warned": sum(1 for s in healthy if s.false or s.in_divergence),
        "false_warnings": sum(len(s.false) for s in scores),
        "false_warnings_on_healthy": sum(len(s.false) for s in healthy),
        "in_divergence": sum(len(s.in_divergence) for s in scores),
        "borderline_firings": sum(len(s.borderline) for s in scores),
        "missed_unread": sum(  # missed spans of files whose declining evaluations were not read
            s.caught.count(None) for s in scores if s.unread and s.unread == s.declining
        ),
    }


def run(
    files: list[CorpusFile],
    judge: Callable[[Path], tuple[list[Firing], set[str]]] = analyze_firings,
) -> list[FileScore]:
    return [score_file(f, *judge(f.path)) for f in files]


def render(scores: list[FileScore]) -> str:
    from trainguard.analysis.logs import MAX_EVALUATIONS

    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    rows = {h: half_summary([s for s in scores if s.half == h]) for h in HALVES}
    lines = [
        "The `eval_decline` detector through `analyze` (default config) on the real "
        "`trainer_state.json` files of `data/evals` (SOURCES.md; labels and rule: labels.json, "
        "README.md). Halves by `trust.file_half`: **tune** is the half to tune on, **held_out** "
        "the half reported; a firing catches a decline span from its first step to "
        f"{SLACK_EVALS} evaluation after its end.",
        "",
        "| half | files | with a decline | decline spans | caught | lag steps (median / max) "
        "| lag evaluations (median / max) | healthy files warned | false warnings (on healthy "
        "files) | in divergence | borderline firings | missed, declining evaluation not read |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for h, r in rows.items():
        lines.append(
            f"| {h} | {r['files']} | {r['decline_files']} | {r['decline_spans']} | {r['caught']} "
            f"| {cell(r['lag_steps_median'])} / {cell(r['lag_steps_max'])} "
            f"| {cell(r['lag_evals_median'])} / {cell(r['lag_evals_max'])} "
            f"| {r['healthy_files_warned']} of {r['healthy_files']} "
            f"| {r['false_warnings']} ({r['false_warnings_on_healthy']}) | {r['in_divergence']} "
            f"| {r['borderline_firings']} | {r['missed_unread']} |"
        )
    for h, r in rows.items():
        lag = (
            f" (lag median {cell(r['lag_steps_median'])} steps, {cell(r['lag_evals_median'])} "
            "evaluations)"
            if r["caught"]
            else ""
        )
        unread = (
            f"; {r['missed_unread']} of the misses in files whose declining evaluation the log "
            f"reader did not return (it keeps the first {MAX_EVALUATIONS} evaluation names of a "
            "log)"
            if r["missed_unread"]
            else ""
        )
        lines += [
            "",
            f"{'Held-out half (the report)' if h == 'held_out' else 'Tune half'}: caught "
            f"{r['caught']} of {r['decline_spans']} decline spans{lag}{unread}; "
            f"{r['false_warnings']} false warnings, {r['healthy_files_warned']} of "
            f"{r['healthy_files']} healthy files warned; {r['in_divergence']} firings while the "
            f"training loss rose too, {r['borderline_firings']} on borderline spans.",
        ]
    lines += [
        "",
        "| file | half | label | firings (step: evaluation) | outcome |",
        "|---|---|---|---|---|",
    ]
    for s in sorted(scores, key=lambda s: (HALVES.index(s.half), s.name)):
        label = "healthy" if s.healthy else f"decline x{len(s.caught)}" if s.caught else "other"
        fired = ", ".join(f"{st}: {n}" for st, n in s.firings[:6]) + (
            f" (+{len(s.firings) - 6})" if len(s.firings) > 6 else ""
        )
        outcome = []
        for c in s.caught:
            outcome.append("missed" if c is None else f"caught {c[0]} after {c[1]} steps")
        if s.unread:
            outcome.append(f"not read: {', '.join(s.unread)}")
        for what, xs in (
            ("false", s.false),
            ("in divergence", s.in_divergence),
            ("borderline", s.borderline),
        ):
            if xs:
                outcome.append(f"{len(xs)} {what}")
        lines.append(
            f"| {s.name} | {s.half} | {label} | {fired or '-'} | {'; '.join(outcome) or '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="the corpus folder")
    parser.add_argument("--no-write", action="store_true", help="print, leave RESULTS.md alone")
    parser.add_argument("--draft", action="store_true", help="labels.json against the rule")
    args = parser.parse_args(argv)
    files = load_corpus(args.corpus)
    if args.draft:
        for f in files:
            diff = label_differences(f)
            if diff:
                print(f"{f.name} ({f.label.get('override', 'NO OVERRIDE RECORDED')}):")
                for k, (have, drafted) in diff.items():
                    print(f"  {k}: label {have}, draft {drafted}")
        return
    body = render(run(files))
    print(body)
    if not args.no_write:
        from _common import write_section

        write_section(
            "eval_corpus",
            "Evaluation decline on real trainer_state.json files (issue 21)",
            body,
            "python benchmarks/eval_corpus.py",
        )


if __name__ == "__main__":
    main()
