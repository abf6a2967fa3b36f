"""The fast subset of the trust benchmark (benchmarks/trust.py): a few regimes trained for real,
clean and through planted faults, guarded and unguarded, on a held-out seed, held to the
benchmark's targets: a clean run left alone, every fault caught, and a guarded faulty run within
2% of its clean run and no more than 1% worse than the unguarded one."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import trust

SEED = 1  # a held-out seed
CASES = [
    # the short run: a 300-step LM through an LR x100 burst at step 120
    ("short-300", ("lr_burst",), False),
    # a regression whose loss nears zero (at 300 steps): left alone clean; a toxic batch
    ("mse-exact", ("toxic",), True),
    # noisy targets (300 steps): left alone clean; a NaN in the inputs
    ("mse-noisy", ("nan",), True),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def judged(request: pytest.FixtureRequest) -> tuple[list, list, dict]:
    name, faults, quick = request.param
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster, and the same on any machine
    try:
        results = trust.run_regime(trust.by_name(name), SEED, quick=quick, faults=faults)
    finally:
        torch.set_num_threads(threads)
    comparisons = trust.compare(results, lambda regime, seed: "held_out")
    return results, comparisons, trust.targets(results, comparisons)


def test_every_run_trained_and_the_unguarded_twin_exists(judged):
    results, comparisons, _ = judged
    assert not [r.error for r in results if r.error]
    clean = results[0]
    assert clean.fault == "clean" and clean.steps_done == clean.steps_planned
    assert math.isfinite(clean.eval_loss)
    assert len(comparisons) == (len(results) - 1) // 2
    assert all(c.fault != "clean" for c in comparisons)


def test_the_clean_run_is_left_alone(judged):
    results, _, t = judged
    clean = results[0]
    assert t["no action on clean runs"], (clean.rollbacks, clean.halts, clean.quarantined_batches)
    assert t["skips within 1 per 10k"], f"{clean.skips} skips in {clean.steps_done} clean steps"


def test_every_planted_fault_is_caught(judged):
    _, comparisons, _ = judged
    missed = [c.fault for c in comparisons if not c.caught]
    assert not missed


def test_guarded_faulty_runs_end_near_clean_and_no_worse_than_unguarded(judged):
    _, comparisons, _ = judged
    for c in comparisons:
        assert c.within_clean, f"{c.fault}: {c.vs_clean:+.2%} against the clean run"
        assert c.not_worse, f"{c.fault}: {c.vs_unguarded:+.2%} against the unguarded run"


def test_a_log_is_judged_against_its_labels(tmp_path):
    rng = np.random.default_rng(0)
    steps = np.arange(1500)
    loss = 3.0 * (1 + steps) ** -0.1 * (1 + 0.01 * rng.standard_normal(len(steps)))
    loss[1000] *= 3.0  # one unmistakable spike
    log = tmp_path / "run.csv"
    rows = "".join(f"{s},{v:.6f}\n" for s, v in zip(steps, loss, strict=True))
    log.write_text("step,loss\n" + rows)
    as_healthy = trust.judge_log(log, {"healthy": True, "instabilities": [], "half": "held_out"})
    assert as_healthy["half"] == "held_out" and as_healthy["steps"] == 1500
    assert as_healthy["warnings outside instabilities"] >= 1
    assert as_healthy["target met"] is False
    labelled = trust.judge_log(log, {"healthy": False, "instabilities": [[995, 1010]]})
    assert labelled["instabilities found"] == 1 and labelled["instabilities"] == 1
    assert labelled["warnings outside instabilities"] == 0
    assert labelled["target met"] is None  # the no-action target is for healthy files
    assert sum(labelled["would_be"].values()) >= 1  # a spike the guard would have acted on
    unlabelled = trust.judge_log(log, None)
    assert unlabelled["labelled"] is False and "target met" not in unlabelled
