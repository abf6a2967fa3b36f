"""`write_report`: one self-contained HTML file of a run (plotly inlined, no network): curves with
the incidents on them, a heat map of layer-group grad norms, incident cards, lint and config."""

from __future__ import annotations

import html
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainguard.analysis.run import RunRecord
from trainguard.events import SEVERITY_RANK, TrainguardError
from trainguard.run_files import write_atomically

MAX_POINTS = 6000  # per trace: min/max per bucket keeps every spike visible
MAX_HEAT_COLUMNS = 600
MAX_CARDS = 200
NEAR_STEPS = 5  # events this close are one incident (a spike's follow-up window)
OUTCOME_STEPS = 50  # the outcome of an incident: the loss this many steps later
TYPE_COLOURS = {
    "data_toxicity": "#d62728",
    "gradient_explosion": "#ff7f0e",
    "optimizer": "#9467bd",
    "architecture": "#8c564b",
}
KIND_COLOURS = {
    "nonfinite": "#000000",
    "grad_spike": "#1f77b4",
    "grad_explosion": "#17becf",
    "divergence": "#e377c2",
    "oscillation": "#bcbd22",
    "vanishing_gradients": "#7f7f7f",
    "halt": "#000000",
    "weight_jump": "#393b79",
    "fp16_overflow": "#637939",
    "eval_decline": "#d95f02",
}
EVAL_PANEL = "eval:"  # the key of an evaluation's panel: this and its name
MAX_EVAL_PANELS = 8
PANEL_OF = {  # the panel an event kind is drawn on, where the run has it
    "grad_spike": "grad_norm",
    "grad_explosion": "grad_norm",
    "vanishing_gradients": "grad_norm",
    "fp16_overflow": "loss_scale",
}
ATTACHED = (
    "spike_classified",
    "spike_samples",
    "nan_origin",
    "rollback",
    "lr_reduced",
    "replica_resync",
)
ACTS = ("rollback", "lr_reduced", "replica_resync")  # attached kinds that say what was done
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1200px;
padding:16px 24px;color:#222}
h1{font-size:22px;margin:4px 0;overflow-wrap:anywhere}
h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.verdict{padding:8px 12px;border-radius:6px;margin:8px 0}.ok{background:#e8f5e9}
.bad{background:#fdecea}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(360px,1fr));gap:12px}
.incident{border:1px solid #ddd;border-left:6px solid var(--c);border-radius:6px;padding:10px 12px;
min-width:0;max-height:560px;overflow:auto;overflow-wrap:anywhere}
.incident h3{margin:0 0 6px;font-size:15px}.sev{font-size:12px;padding:1px 6px;border-radius:4px;
background:#eee;margin-left:6px}.sev.critical{background:#d62728;color:#fff}
.sev.warning{background:#ff9800;color:#fff}dl{margin:4px 0;display:grid;
grid-template-columns:max-content minmax(0,1fr);gap:2px 10px;font-size:13px}dt{color:#666}
dd{margin:0;min-width:0}
pre{background:#f6f8fa;padding:10px;overflow:auto;font-size:12px;max-height:420px;max-width:100%;
box-sizing:border-box}
.incident pre{white-space:pre-wrap;overflow-wrap:anywhere}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:4px 8px;
text-align:left;vertical-align:top;overflow-wrap:anywhere}.muted{color:#777;font-size:13px}
"""


@dataclass
class Incident:
    """The events of warning or above at steps at most NEAR_STEPS apart (one fault, and the
    steps a rollback replayed bring their events again): one card."""

    events: list[dict[str, Any]]  # in step order
    first_spike: dict[str, Any] | None = None  # the first typed loss spike the run met
    type: str | None = None  # its final type: its first spike's, as that one's follow-up left it

    @property
    def step(self) -> int:
        """Its first step."""
        return min(int(e["step"]) for e in self.events)

    @property
    def last_step(self) -> int:
        return max(int(e["step"]) for e in self.events)

    @property
    def steps(self) -> list[int]:
        return sorted({int(e["step"]) for e in self.events})

    @property
    def primary(self) -> dict[str, Any]:
        """The most severe event, the first of them in step order."""
        ordered = sorted(self.events, key=lambda e: int(e["step"]))
        return max(ordered, key=lambda e: SEVERITY_RANK.get(str(e.get("severity")), 0))


def incidents_of(events: list[dict[str, Any]]) -> list[Incident]:
    """The incidents of a run (`events` in the order the run wrote them) in step order: events
    of warning or above, those at most NEAR_STEPS steps after the one before taken as one, each
    with its final type."""
    found = sorted((e for e in events if _is_incident(e)), key=lambda e: int(e["step"]))
    incidents: list[Incident] = []
    for e in found:
        if incidents and int(e["step"]) - incidents[-1].last_step <= NEAR_STEPS:
            incidents[-1].events.append(e)
        else:
            incidents.append(Incident([e]))
    incident_of = {id(e): i for i in incidents for e in i.events}
    for at, e in enumerate(events):
        incident = incident_of.get(id(e))
        if incident is None or incident.first_spike is not None:
            continue
        if e.get("kind") == "loss_spike" and e.get("type"):
            incident.first_spike = e
            incident.type = _followed_type(e, events[at + 1 :])
    return incidents


def _followed_type(spike: dict[str, Any], later: list[dict[str, Any]]) -> str:
    """A spike's type as its own follow-up (`spike_classified`) left it, else its first guess.
    A replay of its step after a rollback ends the search: that replay ran on another LR and
    other batches, so its types are not this spike's evidence (the demo's decaying shard was
    confirmed as data twice, then its third replay looked like an explosion)."""
    step = spike.get("step")
    for e in later:
        if e.get("step") == step and e.get("kind") == "loss_spike":
            break
        spike_step = (e.get("metrics") or {}).get("spike_step", e.get("step"))
        if e.get("kind") == "spike_classified" and e.get("type") and spike_step == step:
            return str(e["type"])
    return str(spike["type"])


def require_plotly() -> None:
    """Raise a TrainguardError that names the `report` extra when plotly is not installed."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise TrainguardError(
            "the HTML report needs plotly: pip install 'trainguard[report]'"
        ) from None


def write_report(record: RunRecord, out: str | Path, title: str | None = None) -> Path:
    """Write the report of `record` to `out` and return its path (a TrainguardError that names
    the `report` extra when plotly is not installed)."""
    require_plotly()
    from plotly.offline import get_plotlyjs

    path = Path(out)
    incidents = incidents_of(record.events)
    figures = [("curves", _curves(record, incidents))]
    if record.groups and len(record.group_steps):
        figures.append(("groups", _heatmap(record)))
    scripts = "\n".join(
        f"Plotly.newPlot({json.dumps(name)}, fig_{name}.data, fig_{name}.layout, "
        '{"displaylogo": false, "responsive": true});'
        for name, _ in figures
    )
    data = "\n".join(f"var fig_{name} = {_safe_json(fig)};" for name, fig in figures)
    name = html.escape(title or f"trainguard report: {record.source}")
    body = [
        f"<h1>{name}</h1>",
        _summary(record, incidents),
        '<h2>Curves</h2><div id="curves"></div>',
    ]
    if len(figures) > 1:
        body.append(
            '<h2>Layer-group gradient norms</h2><p class="muted">log10 of each group\'s '
            'gradient norm per step.</p><div id="groups"></div>'
        )
    body.append(_cards(record, incidents))
    body.append(_lint(record))
    body.append(_config(record))
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{name}</title><style>{CSS}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script></head><body>'
        + "\n".join(body)
        + f'<script type="text/javascript">{data}\n{scripts}</script></body></html>\n'
    )
    # a fresh temporary of an unpredictable name, renamed over the page: none half-written
    write_atomically(path, page.encode("utf-8"), fix="remove it or choose another output file")
    return path


def _is_incident(event: dict[str, Any]) -> bool:
    if event.get("kind") in ATTACHED or event.get("kind") == "lint":
        return False
    return SEVERITY_RANK.get(str(event.get("severity")), 0) >= SEVERITY_RANK["warning"]


def _safe_json(value: Any) -> str:
    """JSON that cannot end a <script> element, whatever strings it holds."""
    text = json.dumps(value, default=_plain)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")


def _finite(values: np.ndarray) -> list[float | None]:
    return [float(v) if math.isfinite(v) else None for v in values.tolist()]


def decimate(steps: np.ndarray, values: np.ndarray, limit: int = MAX_POINTS) -> tuple[Any, Any]:
    """At most about `limit` points: the min and max of each bucket, in step order."""
    if len(steps) <= limit:
        return steps, values
    buckets = np.array_split(np.arange(len(steps)), limit // 2)
    keep: list[int] = []
    for b in buckets:
        vals = values[b]
        if not np.isfinite(vals).any():
            keep.append(int(b[0]))
            continue
        lo, hi = int(b[np.nanargmin(vals)]), int(b[np.nanargmax(vals)])
        keep.extend(sorted({lo, hi}))
    idx = np.array(keep)
    return steps[idx], values[idx]


def _block_medians(steps: np.ndarray, values: np.ndarray) -> tuple[Any, Any, int]:
    """The smoothed curve: the median of each block of steps (about 300 blocks), robust to
    spikes and without an average's lag."""
    width = max(3, len(steps) // 300)
    n = len(steps) // width * width
    if n == 0:
        return steps, values, 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a block of only NaN stays NaN
        med = np.nanmedian(values[:n].reshape(-1, width), axis=1)
    centre = steps[:n].reshape(-1, width)[:, width // 2]
    return centre, med, width


def _colour(label: str) -> str:
    """The colour of a marker or card: by the incident's type, else by its kind."""
    return TYPE_COLOURS.get(label, KIND_COLOURS.get(label, "#d62728"))


def _label(event: dict[str, Any], incident: Incident) -> str:
    """What a marker or card is named by: a loss spike by its incident's final type (the one the
    demo's table says), else the kind."""
    if event.get("kind") == "loss_spike":
        return incident.type or str(event.get("type") or "loss_spike")
    return str(event.get("type") or event["kind"])


def _axis_range(values: np.ndarray) -> list[float] | None:
    """A linear axis's range for a series that does not vary (plotly would draw it at the
    middle of -1..1); None leaves the range to plotly."""
    finite = values[np.isfinite(values)]
    if not len(finite):
        return None
    lo, hi = float(finite.min()), float(finite.max())
    if hi - lo > 1e-9 * max(abs(lo), abs(hi)):
        return None
    return [lo - abs(lo) / 2, hi + abs(hi) / 2] if lo else [-1.0, 1.0]


def _panel_series(record: RunRecord, panel: str) -> tuple[np.ndarray, np.ndarray]:
    """The steps and values a panel draws: a column of the run, or an evaluation."""
    if panel.startswith(EVAL_PANEL):
        return record.evals[panel.removeprefix(EVAL_PANEL)]
    return record.steps, record.columns[panel]


def _value_at(steps: np.ndarray, values: np.ndarray, step: int) -> float:
    """A column's value at `step`, else its last finite value before it (where a NaN step is
    marked), else NaN."""
    i = int(np.searchsorted(steps, step, side="right"))
    finite = np.flatnonzero(np.isfinite(values[:i]))
    return float(values[finite[-1]]) if len(finite) else math.nan


def _curves(record: RunRecord, incidents: list[Incident]) -> dict[str, Any]:
    from plotly.subplots import make_subplots

    cols = record.columns
    panels = [("loss", "loss", False)]
    if "grad_norm" in cols and np.isfinite(cols["grad_norm"]).any():
        panels.append(("grad_norm", "grad norm", True))
    if "lr" in cols and np.isfinite(cols["lr"]).any():
        panels.append(("lr", "learning rate", False))
    if "loss_scale" in cols and np.isfinite(cols["loss_scale"]).any():
        panels.append(("loss_scale", "loss scale", True))
    evaluations = [  # a panel per evaluation, `MAX_EVAL_PANELS` at most
        name for name, (_, values) in record.evals.items() if np.isfinite(values).any()
    ][:MAX_EVAL_PANELS]
    panels += [
        (EVAL_PANEL + name, _plotly_text(name.replace("_", " ")), False) for name in evaluations
    ]
    row_of = {key: row for row, (key, _, _) in enumerate(panels, 1)}
    fig = make_subplots(
        rows=len(panels),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        row_heights=[2.0] + [1.0] * (len(panels) - 1),
    )
    for row, (key, label, log) in enumerate(panels, 1):
        if key.startswith(EVAL_PANEL):
            eval_steps, values = record.evals[key.removeprefix(EVAL_PANEL)]
            fig.add_scatter(
                x=eval_steps.tolist(),
                y=_finite(values),
                mode="lines+markers",
                name=label,
                row=row,
                col=1,
                line={"width": 1.5, "color": "#55a868"},
                marker={"size": 5},
            )
            fig.update_yaxes(title_text=label, row=row, col=1)
            continue
        x, y = decimate(record.steps, cols[key])
        fig.add_scatter(
            x=x.tolist(),
            y=_finite(y),
            mode="lines",
            name=label,
            row=row,
            col=1,
            line={"width": 1, "color": "#4c72b0"},
        )
        if log:  # labels written out (plotly writes 0.5 as "5" between decades)
            fig.update_yaxes(type="log", tickformat="~g", row=row, col=1)
        else:  # an LR as 5e-05, not plotly's 50µ
            fig.update_yaxes(range=_axis_range(cols[key]), exponentformat="e", row=row, col=1)
        fig.update_yaxes(title_text=label, row=row, col=1)
    loss = cols["loss"]
    x, y, width = _block_medians(record.steps, loss)
    fig.add_scatter(
        x=x.tolist(),
        y=_finite(y),
        mode="lines",
        name=f"loss (median of {width} steps)",
        row=1,
        col=1,
        line={"width": 2, "color": "#dd8452"},
    )
    if len(record.abandoned.get("step", [])):
        fig.add_scatter(
            x=record.abandoned["step"].tolist(),
            y=_finite(record.abandoned["loss"]),
            mode="markers",
            name=record.abandoned_label,
            row=1,
            col=1,
            marker={"size": 4, "color": "#bbbbbb"},
        )
    clip = record.config.get("max_grad_norm")  # a judged log's config is trainguard's, not its own
    if "grad_norm" in row_of and isinstance(clip, (int, float)) and not record.judged:
        fig.add_hline(
            y=float(clip),
            line={"dash": "dash", "color": "#c44e52"},
            row=row_of["grad_norm"],
            col=1,
            annotation_text=f"clip {clip:g}",
            annotation_position="top left",
        )
    _mark_incidents(fig, record, incidents, row_of)
    fig.update_layout(
        height=260 + 170 * len(panels),
        margin={"l": 60, "r": 20, "t": 20, "b": 40},
        hovermode="closest",
        legend={"orientation": "h", "y": -0.08},
    )
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    return dict(fig.to_plotly_json())


def _mark_incidents(
    fig: Any,
    record: RunRecord,
    incidents: list[Incident],
    row_of: dict[str, int],
) -> None:
    """A marker per event kind and step, on the panel of what it is about, coloured and named
    by the incident's final type; a non-finite step is also a line across every panel."""
    markers: dict[tuple[str, str], list[tuple[int, float | None, str]]] = {}
    nonfinite: list[int] = []
    for incident in incidents:
        seen: set[tuple[int, str]] = set()
        for e in incident.events:
            kind, step = str(e["kind"]), int(e["step"])
            if (step, kind) in seen:  # the step replayed after a rollback: one marker
                continue
            seen.add((step, kind))
            metrics = e.get("metrics") or {}
            panel = PANEL_OF.get(kind, "loss")
            if kind == "eval_decline":  # on its evaluation's panel, at the value it judged
                panel = f"{EVAL_PANEL}{metrics.get('name')}"
            panel = panel if panel in row_of else "loss"
            value = math.nan
            metric = metrics.get("value" if panel.startswith(EVAL_PANEL) else panel)
            if isinstance(metric, (int, float)) and not isinstance(metric, bool):
                value = float(metric)  # what the detector saw there
            if not math.isfinite(value):
                value = _value_at(*_panel_series(record, panel), step)
            if kind == "nonfinite":
                nonfinite.append(step)
            label = _label(e, incident)
            said = label if label != kind else str(e["severity"])
            text = (  # the user's strings escaped, trainguard's own <br> kept
                f"step {step}: {_plotly_text(kind)} ({_plotly_text(said)})"
                f"<br>{_wrap(str(e.get('message', '')))}"
            )
            markers.setdefault((panel, label), []).append(
                (step, value if math.isfinite(value) else None, text)
            )
    for (panel, label), points in markers.items():
        fig.add_scatter(
            x=[p[0] for p in points],
            y=[p[1] for p in points],
            mode="markers",
            name=_plotly_text(label.replace("_", " ")),
            legendgroup=label,
            row=row_of[panel],
            col=1,
            marker={
                "size": 11,
                "color": _colour(label),
                "symbol": "x" if label == "nonfinite" else "diamond",
                "line": {"width": 1, "color": "#fff"},
            },
            text=[p[2] for p in points],  # passed as data: the template reads no user text
            hovertemplate="%{text}<extra></extra>",
        )
    for step in nonfinite:
        fig.add_vline(x=step, line={"dash": "dot", "color": "#000000", "width": 1})


def _plotly_text(text: str) -> str:
    """`text` as plotly shows it literally: its pseudo-HTML (`<a href>`, `<br>`, `<span>`, an
    entity) and a `$...$` it would typeset as LaTeX written as entities, which plotly decodes."""
    escaped = html.escape(text, quote=False)  # plotly knows &amp; &lt; &gt;, not &quot;
    return escaped.replace('"', "&#34;").replace("'", "&#39;").replace("$", "&#36;")


def _wrap(text: str, width: int = 90) -> str:
    """`text` escaped for plotly, in lines of about `width` characters (six at most)."""
    words, lines, line = text.split(), [], ""
    for w in words:
        if len(line) + len(w) > width and line:
            lines.append(line)
            line = ""
        line = f"{line} {w}".strip()
    lines.append(line)
    return "<br>".join(_plotly_text(line) for line in lines[:6])


def _heatmap(record: RunRecord) -> dict[str, Any]:
    import plotly.graph_objects as go

    norms = record.group_norms
    steps = record.group_steps
    if len(steps) > MAX_HEAT_COLUMNS:  # the max of each bucket: a spike stays visible
        parts = np.array_split(np.arange(len(steps)), MAX_HEAT_COLUMNS)
        steps = np.array([steps[p[0]] for p in parts])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            norms = np.array([np.nanmax(norms[p], axis=0) for p in parts])
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.log10(np.where(norms > 0, norms, np.nan)).T
    fig = go.Figure(
        go.Heatmap(
            x=steps.tolist(),
            y=[_plotly_text(g) for g in record.groups],
            z=[[None if not math.isfinite(v) else v for v in row] for row in z.tolist()],
            colorscale="Viridis",
            colorbar={"title": {"text": "log10 norm"}},
            hovertemplate="step %{x}<br>%{y}: 10^%{z:.2f}<extra></extra>",
        )
    )
    fig.update_layout(
        height=max(240, 26 * len(record.groups) + 120),
        margin={"l": 140, "r": 20, "t": 10, "b": 40},
        xaxis={"title": {"text": "step"}},
    )
    return dict(fig.to_plotly_json())


def _summary(record: RunRecord, incidents: list[Incident]) -> str:
    loss = record.columns["loss"]
    finite = loss[np.isfinite(loss)]
    final = f"{float(np.mean(finite[-20:])):.4g}" if len(finite) else "n/a"
    counts: dict[str, int] = {}
    for incident in incidents:
        for kind in dict.fromkeys(str(e["kind"]) for e in incident.events):
            counts[kind] = counts.get(kind, 0) + 1
    actions = ""
    if record.action_counts:
        tally = {a: record.action_counts.get(a, 0) for a in ("skip", "rollback", "halt")}
        actions = ", ".join(f"{n} {a}" for a, n in tally.items() if n) or "no intervention"
    kinds = ", ".join(f"{k.replace('_', ' ')} ({n})" for k, n in counts.items())
    verdict = (
        f"{len(incidents)} incident(s) (steps with an event of warning or above): {kinds}"
        if incidents
        else "healthy: no incident"
    )
    origin = "judged offline by trainguard analyze" if record.judged else "recorded by the guard"
    rows = [
        ("source", html.escape(str(record.source))),
        ("steps", f"{len(record.steps):,} ({record.steps[0]}..{record.steps[-1]})"),
        ("final loss (mean of the last 20)", final),
        ("events", origin),
    ]
    if actions:
        rows.append(("actions", html.escape(actions)))
    rows += [("warning", html.escape(w)) for w in record.warnings]
    cells = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    cls = "bad" if incidents else "ok"
    return f'<div class="verdict {cls}">{html.escape(verdict)}</div><table>{cells}</table>'


def _cards(record: RunRecord, incidents: list[Incident]) -> str:
    if not incidents:
        return "<h2>Incidents</h2><p>None at warning or above.</p>"
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in record.events:
        if r.get("kind") in ATTACHED:
            m = r.get("metrics") or {}
            steps = (r.get("step"), m.get("spike_step"), m.get("incident_step"))
            for key in {s for s in steps if isinstance(s, int)}:
                by_step.setdefault(key, []).append(r)
    shown = incidents[:MAX_CARDS]
    cards = [
        _card(record, i, _distinct_events([r for s in i.steps for r in by_step.get(s, [])]))
        for i in shown
    ]
    more = (
        f'<p class="muted">and {len(incidents) - len(shown)} more incidents: see events.jsonl '
        "or trainguard analyze --json.</p>"
        if len(incidents) > len(shown)
        else ""
    )
    return (
        f'<h2>Incidents ({len(incidents)})</h2><div class="cards">'
        + "".join(cards)
        + "</div>"
        + more
    )


def _distinct_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events once each (one attached to two steps of an incident is found twice)."""
    return list({id(e): e for e in events}.values())


def _distinct(texts: list[str]) -> list[str]:
    """The texts once each, in order (a replayed step repeats its events' messages)."""
    return list(dict.fromkeys(t for t in texts if t))


def _card(record: RunRecord, incident: Incident, related: list[dict[str, Any]]) -> str:
    """One incident: when, what, cause, diagnosis, action and outcome."""
    step, last = incident.step, incident.last_step
    when = f"step {step}" if step == last else f"steps {step}..{last}"
    esc = html.escape
    primary = incident.primary
    label = _label(primary, incident)
    rows: list[tuple[str, str]] = [("step", when.split(" ", 1)[1])]
    if label != primary["kind"]:
        rows.append(("cause", esc(label.replace("_", " "))))
    rows.append(("what", esc(str(primary.get("message", "")))))

    def same(e: dict[str, Any]) -> bool:
        return bool(e["kind"] == primary["kind"] and e["step"] == primary["step"])

    times = sum(1 for e in incident.events if same(e))
    if times > 1:
        rows.append(("seen", f"{times} times: the step was trained again after a rollback"))
    also = _distinct(
        [
            f"{str(e['kind']).replace('_', ' ')} at {e['step']} ({e.get('severity')}): "
            f"{e.get('message', '')}"
            for e in incident.events
            if not same(e)
        ]
    )
    rows += [("also", esc(a)) for a in also]
    rows += [
        ("type", esc(t))
        for t in _distinct(
            [str(r.get("message", "")) for r in related if r["kind"] == "spike_classified"]
        )
    ]
    diagnosis = _diagnosis(incident.events, related)
    if diagnosis:
        rows.append(("diagnosis", diagnosis))
    taken = _distinct([str(e.get("action") or "") for e in incident.events])
    acts = _distinct([str(r.get("message", "")) for r in related if r["kind"] in ACTS])
    if taken or acts:
        rows.append(("action", "<br>".join(esc(a) for a in [", ".join(taken), *acts] if a)))
    if not all(str(e.get("kind")) in NOT_BY_LOSS for e in incident.events):
        rows.append(("outcome", esc(_outcome(record, step, last))))
    body = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    sev = esc(str(primary.get("severity")))
    what = str(primary["kind"]).replace("_", " ")
    return (
        f'<div class="incident" style="--c:{_colour(label)}" data-step="{step}" '
        f'data-kind="{esc(str(primary["kind"]))}"><h3>{esc(what)} at {when}'
        f'<span class="sev {sev}">{sev}</span></h3><dl>{body}</dl></div>'
    )


def _diagnosis(events: list[dict[str, Any]], related: list[dict[str, Any]]) -> str:
    esc = html.escape
    parts: list[str] = []
    for e in events:
        first = (e.get("metrics") or {}).get("first_group")
        if isinstance(first, dict):
            parts.append(
                f"{esc(str(first.get('group')))} moved first "
                f"(from step {esc(str(first.get('since_step')))})"
            )
    for r in related:
        m = r.get("metrics") or {}
        if r["kind"] == "nan_origin":
            parts.append(esc(str(r.get("message", ""))))
            frames = m.get("frames")
            if frames and isinstance(frames, list):  # the user's code, innermost last
                parts.append("<pre>" + esc("\n".join(str(f) for f in frames[-6:])) + "</pre>")
        elif r["kind"] == "spike_samples":
            samples = m.get("samples")
            items = []
            for s in samples[:8] if isinstance(samples, list) else []:
                if not isinstance(s, dict):
                    continue
                preview = s.get("preview") or s.get("text") or ""
                items.append(
                    f"<li>{esc(str(s.get('id')))}: loss {esc(str(s.get('loss')))}"
                    + (f" <q>{esc(str(preview)[:160])}</q>" if preview else "")
                    + "</li>"
                )
            parts.append(f"samples that carry it:<ul>{''.join(items)}</ul>")
    return "<br>".join(_distinct(parts))


# incidents the training loss cannot tell the outcome of: it falls while an evaluation declines
NOT_BY_LOSS = frozenset({"eval_decline", "token_accuracy"})


def _outcome(record: RunRecord, step: int, last: int | None = None) -> str:
    """The loss before the incident's first step against the loss from `OUTCOME_STEPS` steps
    after its last on (the logged points there, however far apart they are)."""
    steps, loss = record.steps, record.columns["loss"]
    i = int(np.searchsorted(steps, step))
    j = int(np.searchsorted(steps, (step if last is None else last) + OUTCOME_STEPS))
    before = loss[max(0, i - 20) : i]
    after = loss[j : j + 20]
    if record.actions is not None and "halt" in record.actions[i:]:
        return "the run halted"
    before, after = before[np.isfinite(before)], after[np.isfinite(after)]
    if len(before) == 0 or len(after) == 0:
        return "not enough steps around it to judge"
    b, a = float(np.median(before)), float(np.median(after))
    change = (a - b) / abs(b) if b else 0.0
    when = f"from step {int(steps[j])} on" if j < len(steps) else "after it"
    if change <= 0.02:
        return f"recovered: loss {a:.4g} {when} against {b:.4g} before"
    return f"still {change:.0%} above: loss {a:.4g} {when} against {b:.4g} before"


def _lint(record: RunRecord) -> str:
    if record.judged:
        return (
            "<h2>Set-up lint</h2><p>Not run: a log holds no model or optimizer to check; "
            "<code>trainguard lint</code> checks a set-up, and a guarded run records its "
            "findings here.</p>"
        )
    findings = [e for e in record.events if e.get("kind") == "lint"]
    if not findings:
        return "<h2>Set-up lint</h2><p>No findings.</p>"
    rows = []
    for f in findings:
        m = f.get("metrics") or {}
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(v))}</td>"
                for v in (
                    m.get("severity", ""),
                    m.get("code", ""),
                    m.get("message", f.get("message")),
                    m.get("fix", ""),
                )
            )
            + "</tr>"
        )
    return (
        "<h2>Set-up lint</h2><table><tr><th>severity</th><th>check</th><th>finding</th>"
        "<th>fix</th></tr>" + "".join(rows) + "</table>"
    )


def _config(record: RunRecord) -> str:
    note = (
        '<p class="muted">The GuardConfig that trainguard analyze judged this log with.</p>'
        if record.judged
        else ""
    )
    return (
        f"<h2>Config</h2>{note}<pre>"
        + html.escape(json.dumps(record.config, indent=2, sort_keys=True))
        + "</pre>"
    )
