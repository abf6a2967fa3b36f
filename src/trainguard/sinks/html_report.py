"""`write_report`: one self-contained HTML file of a run (plotly inlined, no network): curves with
the incidents on them, a heat map of layer-group grad norms, incident cards, lint and config."""

from __future__ import annotations

import contextlib
import html
import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from trainguard.analysis.run import RunRecord
from trainguard.events import SEVERITY_RANK

MAX_POINTS = 6000  # per trace: min/max per bucket keeps every spike visible
MAX_HEAT_COLUMNS = 600
MAX_CARDS = 200
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
}
ATTACHED = ("spike_classified", "spike_samples", "nan_origin", "rollback", "lr_reduced")
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1200px;
padding:16px 24px;color:#222}
h1{font-size:22px;margin:4px 0}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.verdict{padding:8px 12px;border-radius:6px;margin:8px 0}.ok{background:#e8f5e9}
.bad{background:#fdecea}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(360px,1fr));gap:12px}
.incident{border:1px solid #ddd;border-left:6px solid var(--c);border-radius:6px;padding:10px 12px}
.incident h3{margin:0 0 6px;font-size:15px}.sev{font-size:12px;padding:1px 6px;border-radius:4px;
background:#eee;margin-left:6px}.sev.critical{background:#d62728;color:#fff}
.sev.warning{background:#ff9800;color:#fff}dl{margin:4px 0;display:grid;
grid-template-columns:max-content 1fr;gap:2px 10px;font-size:13px}dt{color:#666}dd{margin:0}
pre{background:#f6f8fa;padding:10px;overflow:auto;font-size:12px;max-height:420px}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:4px 8px;
text-align:left;vertical-align:top}.muted{color:#777;font-size:13px}
"""


def write_report(record: RunRecord, out: str | Path, title: str | None = None) -> Path:
    """Write the report of `record` to `out` and return its path."""
    from plotly.offline import get_plotlyjs

    path = Path(out)
    incidents = [e for e in record.events if _is_incident(e)]
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
    body.append(
        "<h2>Config</h2><pre>"
        + html.escape(json.dumps(record.config, indent=2, sort_keys=True))
        + "</pre>"
    )
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{name}</title><style>{CSS}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script></head><body>'
        + "\n".join(body)
        + f'<script type="text/javascript">{data}\n{scripts}</script></body></html>\n'
    )
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        tmp.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()  # no half-written page is left behind
        raise
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


def _colour(event: dict[str, Any]) -> str:
    return TYPE_COLOURS.get(str(event.get("type")), KIND_COLOURS.get(str(event["kind"]), "#d62728"))


def _curves(record: RunRecord, incidents: list[dict[str, Any]]) -> dict[str, Any]:
    from plotly.subplots import make_subplots

    cols = record.columns
    panels = [("loss", "loss", False)]
    if "grad_norm" in cols and np.isfinite(cols["grad_norm"]).any():
        panels.append(("grad_norm", "grad norm", True))
    if "lr" in cols and np.isfinite(cols["lr"]).any():
        panels.append(("lr", "learning rate", False))
    if "loss_scale" in cols and np.isfinite(cols["loss_scale"]).any():
        panels.append(("loss_scale", "loss scale", True))
    fig = make_subplots(
        rows=len(panels),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        row_heights=[2.0] + [1.0] * (len(panels) - 1),
    )
    steps = record.steps
    for row, (key, label, log) in enumerate(panels, 1):
        x, y = decimate(steps, cols[key])
        fig.add_scatter(
            x=x.tolist(),
            y=_finite(y),
            mode="lines",
            name=label,
            row=row,
            col=1,
            line={"width": 1, "color": "#4c72b0"},
        )
        if log:
            fig.update_yaxes(type="log", row=row, col=1)
        fig.update_yaxes(title_text=label, row=row, col=1)
    loss = cols["loss"]
    x, y, width = _block_medians(steps, loss)
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
            name="abandoned by a rollback",
            row=1,
            col=1,
            marker={"size": 4, "color": "#bbbbbb"},
        )
    clip = record.config.get("max_grad_norm")
    if "grad_norm" in cols and isinstance(clip, (int, float)):
        fig.add_hline(
            y=float(clip),
            line={"dash": "dash", "color": "#c44e52"},
            row=2,
            col=1,
            annotation_text=f"clip {clip:g}",
            annotation_position="top left",
        )
    by_label: dict[str, list[dict[str, Any]]] = {}
    for e in incidents:
        by_label.setdefault(str(e.get("type") or e["kind"]), []).append(e)
    index = {int(s): i for i, s in enumerate(steps.tolist())}
    for label, group in by_label.items():
        xs, ys, texts = [], [], []
        for e in group:
            i = index.get(int(e["step"]))
            seen = (e.get("metrics") or {}).get("loss")  # the loss the detector saw there
            value = float(seen) if isinstance(seen, (int, float)) else math.nan
            if not math.isfinite(value):
                value = loss[i] if i is not None else math.nan
            xs.append(int(e["step"]))
            ys.append(float(value) if math.isfinite(value) else None)
            texts.append(
                f"step {e['step']}: {e['kind']} ({e.get('type') or e['severity']})<br>"
                + _wrap(str(e.get("message", "")))
            )
        fig.add_scatter(
            x=xs,
            y=ys,
            mode="markers",
            name=label.replace("_", " "),
            row=1,
            col=1,
            marker={
                "size": 11,
                "color": _colour(group[0]),
                "symbol": "diamond",
                "line": {"width": 1, "color": "#fff"},
            },
            text=[html.escape(t).replace("&lt;br&gt;", "<br>") for t in texts],
            hovertemplate="%{text}<extra></extra>",
        )
    fig.update_layout(
        height=260 + 170 * len(panels),
        margin={"l": 60, "r": 20, "t": 20, "b": 40},
        hovermode="closest",
        legend={"orientation": "h", "y": -0.08},
    )
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    return dict(fig.to_plotly_json())


def _wrap(text: str, width: int = 90) -> str:
    words, lines, line = text.split(), [], ""
    for w in words:
        if len(line) + len(w) > width and line:
            lines.append(line)
            line = ""
        line = f"{line} {w}".strip()
    lines.append(line)
    return "<br>".join(lines[:6])


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
            y=[html.escape(g) for g in record.groups],
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


def _summary(record: RunRecord, incidents: list[dict[str, Any]]) -> str:
    loss = record.columns["loss"]
    finite = loss[np.isfinite(loss)]
    final = f"{float(np.mean(finite[-20:])):.4g}" if len(finite) else "n/a"
    counts: dict[str, int] = {}
    for e in incidents:
        counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    actions = ""
    if record.action_counts:
        tally = {a: record.action_counts.get(a, 0) for a in ("skip", "rollback", "halt")}
        actions = ", ".join(f"{n} {a}" for a, n in tally.items() if n) or "no intervention"
    kinds = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in counts.items())
    verdict = f"{len(incidents)} incident(s): {kinds}" if incidents else "healthy: no incident"
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


def _cards(record: RunRecord, incidents: list[dict[str, Any]]) -> str:
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
    cards = [_card(record, e, by_step.get(int(e["step"]), [])) for e in shown]
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


def _card(record: RunRecord, e: dict[str, Any], related: list[dict[str, Any]]) -> str:
    """One incident: when, what, cause, diagnosis, action and outcome."""
    step = int(e["step"])
    esc = html.escape
    what = str(e["kind"]).replace("_", " ")
    kind_type = e.get("type")
    rows: list[tuple[str, str]] = [("step", str(step)), ("what", esc(str(e.get("message", ""))))]
    for r in related:
        if r["kind"] == "spike_classified":
            kind_type = r.get("type") or kind_type
            rows.append(("type", esc(str(r.get("message", "")))))
    if kind_type:
        rows.insert(1, ("cause", esc(str(kind_type).replace("_", " "))))
    diagnosis = _diagnosis(e, related)
    if diagnosis:
        rows.append(("diagnosis", diagnosis))
    action = e.get("action")
    acts = [
        esc(str(r.get("message", ""))) for r in related if r["kind"] in ("rollback", "lr_reduced")
    ]
    if action or acts:
        rows.append(("action", esc(str(action or "")) + "".join(f"<br>{a}" for a in acts)))
    rows.append(("outcome", esc(_outcome(record, step))))
    body = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    sev = esc(str(e.get("severity")))
    colour = _colour({**e, "type": kind_type})
    return (
        f'<div class="incident" style="--c:{colour}" data-step="{step}" '
        f'data-kind="{esc(str(e["kind"]))}"><h3>{esc(what)} at step {step}'
        f'<span class="sev {sev}">{sev}</span></h3><dl>{body}</dl></div>'
    )


def _diagnosis(e: dict[str, Any], related: list[dict[str, Any]]) -> str:
    esc = html.escape
    parts: list[str] = []
    metrics = e.get("metrics") or {}
    first = metrics.get("first_group")
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
            if frames and isinstance(frames, list):
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
    return "<br>".join(parts)


def _outcome(record: RunRecord, step: int) -> str:
    """The loss before the incident against the loss `OUTCOME_STEPS` steps later."""
    steps, loss = record.steps, record.columns["loss"]
    i = int(np.searchsorted(steps, step))
    before = loss[max(0, i - 20) : i]
    after = loss[i + OUTCOME_STEPS : i + OUTCOME_STEPS + 20]
    if record.actions is not None and "halt" in record.actions[i:]:
        return "the run halted"
    before, after = before[np.isfinite(before)], after[np.isfinite(after)]
    if len(before) == 0 or len(after) == 0:
        return "not enough steps around it to judge"
    b, a = float(np.median(before)), float(np.median(after))
    change = (a - b) / abs(b) if b else 0.0
    if change <= 0.02:
        return f"recovered: loss {a:.4g} {OUTCOME_STEPS} steps later against {b:.4g} before"
    return f"still {change:.0%} above: loss {a:.4g} {OUTCOME_STEPS} steps later against {b:.4g}"


def _lint(record: RunRecord) -> str:
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
