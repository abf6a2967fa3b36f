"""`trainguard analyze` on every real curve in data/curves: the incidents found in each, a
thumbnail (SVG) per curve, and the time taken.

Run: `.venv/bin/python benchmarks/curves.py` (writes benchmarks/curves/*.svg and the "Real
curves" section of RESULTS.md).
"""

from __future__ import annotations

import argparse
import html
import time
from pathlib import Path

import numpy as np

from _common import write_section
from trainguard.analysis import analyze, read_log
from trainguard.events import Event

HERE = Path(__file__).resolve().parent
DEFAULT = HERE.parent / "data" / "curves"
COLOURS = {  # spike type (or event kind) -> colour of its marker
    "data_toxicity": "#d62728",
    "gradient_explosion": "#ff7f0e",
    "optimizer": "#9467bd",
    "architecture": "#8c564b",
    "divergence": "#e377c2",
    "grad_spike": "#1f77b4",
    "grad_explosion": "#17becf",
}
W, H, PAD = 360, 110, 4


def thumbnail(steps: np.ndarray, loss: np.ndarray, incidents: list[Event]) -> str:
    """An SVG of the loss (min/max per pixel column, so spikes survive) with incident markers."""
    x0, x1 = float(steps[0]), float(max(steps[-1], steps[0] + 1))
    settled = loss[len(loss) // 20 :]  # the first steps' fall would flatten everything else
    peaks = [float(e.metrics["loss"]) for e in incidents if "loss" in e.metrics]
    lo = float(np.percentile(settled, 0.5))
    hi = max([float(np.percentile(settled, 99.9)) * 1.05, *peaks, lo + 1e-9])

    def px(s: float) -> float:
        return PAD + (s - x0) / (x1 - x0) * (W - 2 * PAD)

    def py(v: float) -> float:
        return H - PAD - (min(max(v, lo), hi) - lo) / (hi - lo) * (H - 2 * PAD)

    columns = np.minimum(((steps - x0) / (x1 - x0) * (W - 2 * PAD)).astype(int), W - 2 * PAD - 1)
    points = []
    for c in np.unique(columns):
        vals = loss[columns == c]
        x = PAD + c
        points.append(f"{x},{py(float(vals.max())):.1f} {x},{py(float(vals.min())):.1f}")
    marks = []
    for e in incidents:
        colour = COLOURS.get(e.type or e.kind, "#333333")
        value = float(e.metrics.get("loss", loss[np.searchsorted(steps, e.step)]))
        title = html.escape(f"step {e.step}: {e.kind} {e.type or ''}")
        marks.append(
            f'<circle cx="{px(e.step):.1f}" cy="{py(value):.1f}" r="3.5" fill="{colour}">'
            f"<title>{title}</title></circle>"
        )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}"><rect width="{W}" height="{H}" fill="white" stroke="#ccc"/>'
        f'<polyline fill="none" stroke="#4c72b0" stroke-width="1" points="{" ".join(points)}"/>'
        + "".join(marks)
        + "</svg>\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--curves", type=Path, default=DEFAULT)
    args = parser.parse_args()
    out = HERE / "curves"
    out.mkdir(exist_ok=True)
    rows = [
        "Each file is read and judged by `trainguard analyze` with the default config; markers "
        "in the thumbnails are incidents at warning or above, coloured by spike type (red data "
        "toxicity, orange gradient explosion, purple optimizer, brown architecture, pink "
        "divergence, blue grad spike). The loss axis spans the curve after its first 5% of "
        "steps (and every incident); the early fall is clipped at the top.\n",
        "| curve | steps | seconds | loss spike score | incidents (step: kind, type) | thumbnail |",
        "|---|---:|---:|---:|---|---|",
    ]
    for path in sorted(args.curves.glob("*.csv")):
        start = time.perf_counter()
        data = read_log(path)
        result = analyze(data)
        secs = time.perf_counter() - start
        found = result.incidents
        shown = "; ".join(f"{e.step}: {e.kind}{', ' + e.type if e.type else ''}" for e in found)
        svg = out / f"{path.stem}.svg"
        svg.write_text(thumbnail(data.steps, data.loss, found))
        rows.append(
            f"| {path.stem} | {len(data.steps):,} | {secs:.2f} | "
            f"{result.summary['spike_score']['loss']:.1e} | {shown or 'none'} | "
            f"![{path.stem}](curves/{svg.name}) |"
        )
        print(rows[-1].split("| ![")[0])
    write_section("curves", "Real curves", "\n".join(rows), "python benchmarks/curves.py")


if __name__ == "__main__":
    main()
