"""The `reduce` exchange (two fixed-size reductions a step) decides as the `gather` exchange (one
row per rank) did: the same planted faults on 3 gloo ranks raise the same events (kind,
severity, ranks named, step) and the same actions on every rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from test_distributed import launch


def findings(run_dir: Path) -> list[tuple[Any, ...]]:
    """Each event as what it found: step, kind, severity, the rank it is about, ranks named."""
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    return [
        (e["step"], e["kind"], e["severity"], e["rank"], e["metrics"].get("ranks"))
        for e in events
        if e["kind"] not in ("lint", "snapshot")
    ]


@pytest.mark.slow(
    "four runs of 3 gloo ranks (two exchanges, faulty and clean) in one world; the straggler "
    "sleeps 0.12 s a step for 40 steps in each faulty run"
)
def test_reduce_and_gather_find_the_same_faults_and_act_alike(tmp_path):
    results = launch("exchange_compare", 3, tmp_path)
    for run in ("", "-clean"):
        gather, reduce = f"gather{run}", f"reduce{run}"
        for r in results:
            assert r[reduce]["actions"] == r[gather]["actions"]
            assert r[reduce]["actions"] == results[0][reduce]["actions"]
        assert findings(tmp_path / reduce) == findings(tmp_path / gather)
    faulty = findings(tmp_path / "reduce")
    kinds = {
        (step, kind, severity, ranks and tuple(ranks)) for step, kind, severity, _, ranks in faulty
    }
    assert (30, "rank_outlier", "critical", (1,)) in kinds  # the NaN on rank 1
    assert (45, "rank_outlier", "critical", (0, 2)) in kinds  # two ranks named in two rounds
    assert (60, "rank_outlier", "warning", (2,)) in kinds  # rank 2's loss x50
    assert any(k == "straggler" and ranks == (1,) for _, k, _, ranks in kinds)
    assert any(k == "rollback" for _, k, _, _ in kinds)
    actions = dict(map(tuple, results[0]["reduce"]["actions"]))
    assert actions[30] == "skip" and actions[45] != "step"
    clean = findings(tmp_path / "reduce-clean")
    assert [f for f in clean if f[1] in ("rank_outlier", "straggler")] == []
    assert {a for _, a in results[0]["reduce-clean"]["actions"]} == {"step"}
    # the reduce exchange: a SUM and a MAX a step, and rare rounds on the steps it named ranks
    calls = [r["reduce-clean"]["exchange_calls"] for r in results]
    assert calls == [2 * 40] * 3
