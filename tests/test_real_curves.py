"""The detectors on real public loss curves (data/curves, see its SOURCES.md)."""

from __future__ import annotations

import csv
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

import trainguard as tg
from trainguard.analysis import read_log
from trainguard.detectors import DetectorSuite, MetricPoint

CURVES = Path(
    os.environ.get("TRAINGUARD_CURVES", Path(__file__).resolve().parents[1] / "data" / "curves")
)


def run_suite(name: str) -> list[tg.Event]:
    path = CURVES / name
    assert path.is_file(), (
        f"{path} is missing: the curves are committed in data/curves, "
        "or set TRAINGUARD_CURVES to their folder"
    )
    suite = DetectorSuite(tg.GuardConfig())
    events: list[tg.Event] = []
    with path.open() as f:
        for row in csv.DictReader(f):
            if not row["loss"]:
                continue
            grad = float(row["grad_norm"]) if row.get("grad_norm") else None
            lr = float(row["lr"]) if row.get("lr") else None
            point = MetricPoint(
                step=int(row["step"]), loss=float(row["loss"]), grad_norm=grad, lr=lr
            )
            events += suite.update(point)
    return events


def test_pythia_burst_is_found_and_the_rest_of_143k_steps_is_quiet():
    """SOURCES.md: one early burst, loss ~3.7 -> 4.2-5.9 over steps 1197-1213; rest clean."""
    events = [e for e in run_suite("pythia-160m-seed8.csv") if e.severity != "info"]
    assert events and events[0].step == 1197 and events[0].kind == "loss_spike"
    assert events[0].type == "gradient_explosion"  # the loss built up into it
    assert all(1197 <= e.step <= 1231 for e in events), [(e.step, e.kind) for e in events]


@pytest.mark.parametrize("step", [2675, 3775])
def test_megatron_mixtral_isolated_spikes(step):
    """SOURCES.md: isolated spikes that recover, 2.61->5.10 at 2675 and 2.49->5.60 at 3775."""
    events = run_suite("megatron-mixtral8x7b-release-v080.csv")
    spikes = {e.step: e for e in events if e.kind == "loss_spike"}
    assert step in spikes and spikes[step].type == "data_toxicity"
    follow = [e for e in events if e.kind == "spike_classified" and e.metrics["spike_step"] == step]
    assert follow and follow[0].type == "data_toxicity"  # back at its level at once


def test_healthy_megatron_gpt3_run_is_quiet():
    assert [
        e for e in run_suite("megatron-gpt3-15b-release-h100-dev.csv") if e.severity != "info"
    ] == []


def test_labels_index_every_curve_and_each_parses_and_has_its_source():
    """labels.json names every CSV once; each reads with read_log, has a SOURCES.md entry and the
    half the sha256 rule gives it (or the one its `half_because` names); a file is unhealthy
    exactly when it lists instabilities."""
    import json

    from trainguard.analysis.logs import read_log

    labels_path = CURVES / "labels.json"
    assert labels_path.is_file(), f"{labels_path} is missing: it is committed beside the curves"
    labels = json.loads(labels_path.read_text())
    sources = (CURVES / "SOURCES.md").read_text()
    assert sorted(labels) == sorted(p.name for p in CURVES.glob("*.csv"))
    for name, label in labels.items():
        with (CURVES / name).open() as f:
            rows = sum(1 for _ in f) - 1
        log = read_log(CURVES / name)
        assert len(log.steps) == rows and not log.warnings, (name, log.warnings)
        assert f"\n### {name}\n" in sources, f"{name} has no SOURCES.md entry"
        assert label["healthy"] == (not label["instabilities"]), name
        for start, end in label["instabilities"] + label.get("outliers", []):
            assert log.steps[0] <= start <= end <= log.steps[-1], (name, start, end)
        repo, _, rest = label["source"].partition("@")
        assert repo.count("/") == 1 and len(rest.split(":", 1)[0]) == 40, label["source"]
        even = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 2 == 0
        if label.get("half_because"):  # a fresh file held out whole, or one seen while tuning
            assert label["half"] in ("tune", "held_out"), name
        else:
            assert label["half"] == ("tune" if even else "held_out"), name


def tuning_half(name: str) -> bool:
    """The held-out split of the real curves: thresholds are tuned on this half only (the
    label's half: the sha256 rule's, or the one its `half_because` names)."""
    return bool(labels()[name]["half"] == "tune")


def labels() -> dict[str, dict[str, Any]]:
    loaded: dict[str, dict[str, Any]] = json.loads((CURVES / "labels.json").read_text())
    return loaded


TUNING_HALF = sorted(n for n in labels() if tuning_half(n))


@pytest.mark.parametrize("name", TUNING_HALF)
def test_real_runs_of_the_tuning_half_warn_only_at_their_labelled_instabilities(name):
    """Healthy real runs raise no warning; a labelled instability (a span of steps) or a
    labelled single-row outlier may warn, and a visible instability of pythia/rig is found."""
    label = labels()[name]
    events = DetectorSuite(tg.GuardConfig()).run(read_log(CURVES / name).series())
    warned = [(e.step, e.kind) for e in events if e.severity != "info"]
    spans = [tuple(s) for s in label["instabilities"] + label.get("outliers", [])]
    assert all(any(a <= step <= b for a, b in spans) for step, _ in warned), warned
    for a, b in label["instabilities"]:  # a visible instability taller than 1.5x is still found
        if name.startswith(("pythia", "rig")):
            assert any(a <= step <= b and kind == "loss_spike" for step, kind in warned), warned
