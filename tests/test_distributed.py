"""Distributed runs on the gloo backend in 2 and 4 processes: one decision on every rank, per-rank
checks, stragglers, and the global grad norm of sharded gradients."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from dist_worker import run


def launch(scenario: str | list[str], world: int, out: Path) -> list[dict]:
    """Each rank's result of `scenario` in a new gloo world; of a list, {name: result} a rank,
    each scenario's files in OUT/NAME."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(world, scenario, str(out), port), nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


class World:
    """Several scenarios run one after another in one gloo world (one launch for the module)."""

    def __init__(self, out: Path, results: list[dict]) -> None:
        self.out, self.results = out, results

    def __call__(self, scenario: str) -> tuple[list[dict], Path]:
        """Each rank's result of `scenario`, and the folder of its files."""
        return [r[scenario] for r in self.results], self.out / scenario


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> World:
    out = tmp_path_factory.mktemp("two-ranks")
    names = ["nan_on_rank1", "straggler", "fsdp_norm", "fsdp_checkpoint", "precursors_agree"]
    return World(out, launch(names, 2, out))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> World:
    out = tmp_path_factory.mktemp("three-ranks")
    return World(out, launch(["clean_small_batches", "sdc", "sdc_reference"], 3, out))


@pytest.mark.slow(
    "the first test of the `two_ranks` world: five scenarios run once in 2 gloo ranks for the "
    "module"
)
def test_a_nan_on_rank_1_alone_makes_every_rank_skip_the_same_step(two_ranks):
    results, run_dir = two_ranks("nan_on_rank1")
    assert results[0]["actions"] == results[1]["actions"]
    actions = dict(map(tuple, results[0]["actions"]))
    assert actions[30] == actions[45] == "skip"
    assert results[0]["weights"] == results[1]["weights"]  # the replicas never diverged
    for r in results:  # the guard's SUM and MAX a step; a round names rank 1, a replay adds one
        expected = [4 if step in (30, 45) else 2 for step in range(60)]
        assert r["collectives_per_step"] == expected and r["exchange_calls"] == 2 * 60 + 2
    found = [e for e in events(run_dir) if e["step"] == 30]
    outlier = next(e for e in found if e["kind"] == "rank_outlier")
    assert outlier["rank"] == 1 and outlier["severity"] == "critical"
    assert outlier["metrics"]["ranks"] == [1] and "non-finite" in outlier["message"]
    assert next(e for e in found if e["kind"] == "nonfinite")["rank"] == 1
    # the replay: the bad input on rank 1 comes back (suspect), with where the NaN began
    origin = next(e for e in found if e["kind"] == "nan_origin")
    assert origin["rank"] == 1 and origin["metrics"]["op"] == "aten.mse_loss.default"
    verdict = [e for e in found if e["kind"] == "rank_outlier" and "suspect" in e["metrics"]]
    assert [(e["rank"], e["metrics"]["suspect"]) for e in verdict] == [(1, True)]
    later = [e for e in events(run_dir) if e["step"] == 45 and "suspect" in e["metrics"]]
    assert [(e["rank"], e["metrics"]["suspect"]) for e in later] == [(1, False)]
    assert all(e["rank"] is not None for e in events(run_dir))


@pytest.mark.slow("a rollback agreed by 4 gloo ranks, 4 processes on 2 cores")
def test_toxic_batches_on_one_rank_roll_every_rank_back_together(tmp_path):
    results = launch("toxic_on_rank2", 4, tmp_path)
    first = results[0]["actions"]
    assert all(r["actions"] == first for r in results)
    assert "rollback" in {a for _, a in first}
    assert all(r["weights"] == results[0]["weights"] for r in results)
    found = events(tmp_path)
    outliers = [e for e in found if e["kind"] == "rank_outlier"]
    assert outliers and all(e["metrics"]["ranks"] == [2] for e in outliers)
    spike = next(e for e in found if e["kind"] == "loss_spike")
    assert spike["step"] == 60 and spike["rank"] == 2
    rollback = next(e for e in found if e["kind"] == "rollback")
    assert rollback["metrics"]["to_step"] < 60
    assert not [e for e in found if e["kind"].startswith("replica")]  # agreed at step 100


def test_a_rank_slowed_2x_is_named_a_straggler(two_ranks):
    _, run_dir = two_ranks("straggler")
    found = [e for e in events(run_dir) if e["kind"] == "straggler"]
    assert [e["rank"] for e in found] == [1]
    figures = found[0]["metrics"]
    assert figures["step_time_s"] > 1.5 * figures["others_step_time_s"]
    assert figures["host"] == socket.gethostname()


def test_the_fsdp2_grad_norm_equals_the_single_process_one(two_ranks):
    results, _ = two_ranks("fsdp_norm")
    for r in results:
        assert r["norms"] == pytest.approx(r["expected"], rel=1e-5)
    assert results[0]["norms"] == results[1]["norms"]


def torchrun(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(Path(__file__).with_name("torchrun_worker.py")),
        str(run_dir),
        *args,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=300, check=False
    )


@pytest.mark.slow(
    "what it checks is a real restart: torchrun runs 2 ranks clean, then killed and restarted "
    "by its agent"
)
def test_a_rank_killed_under_torchrun_restarts_and_resumes_where_it_was(tmp_path):
    clean = torchrun(tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-3000:]
    killed = torchrun(tmp_path / "killed", "--kill-at", "37")
    assert killed.returncode == 0, killed.stderr[-3000:]
    for rank in (0, 1):
        a = json.loads((tmp_path / "clean" / f"result-rank{rank}.json").read_text())
        b = json.loads((tmp_path / "killed" / f"result-rank{rank}.json").read_text())
        assert b["attempt"] == "1" and b["start"] == 30  # the last complete checkpoint
        assert b["window_at_start"] > 0  # the detectors' state came back
        assert b["weights"] == pytest.approx(a["weights"], rel=1e-6)
    assert json.loads((tmp_path / "killed" / "result-rank0.json").read_text())["quarantined"] == 1
    found = events(tmp_path / "killed")
    assert any(e["kind"] == "resume" and e["metrics"]["step"] == 30 for e in found)
    shards = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").glob("step-*/*"))
    assert "trainguard-rank0.json" in shards and "trainguard-rank1.json" in shards


def test_fsdp2_checkpoints_are_sharded_and_resume_to_the_same_weights(two_ranks):
    results, run_dir = two_ranks("fsdp_checkpoint")
    for r in results:
        assert r["start"] == 10
        assert r["second"] == pytest.approx(r["first"], rel=1e-6)
    step = run_dir / "checkpoints" / "step-10"
    assert (step / "trainguard-rank0.json").is_file() and (step / "trainguard-rank1.json").is_file()
    table = json.loads((step / "tensors.json").read_text())["tensors"]
    sharded = [v["chunks"] for k, v in table.items() if k.startswith("model.")]
    assert sharded and all(len(chunks) == 2 for chunks in sharded)  # one shard per rank
    for chunks in sharded:  # each rank wrote its own shard's blob, named by its bytes
        for chunk in chunks:
            blob = run_dir / "checkpoints" / "blobs" / chunk["blob"]
            assert blob.stat().st_size == chunk["bytes"]
            assert hashlib.sha256(blob.read_bytes()).hexdigest() == chunk["blob"]
    assert [r["written"] > 0 for r in results] == [True, True]  # both ranks wrote blobs


@pytest.mark.slow(
    "the first test of the `three_ranks` world: three scenarios (a clean run, the x1000 fault "
    "and its reference) in 3 gloo ranks"
)
def test_three_healthy_ranks_of_32_samples_raise_no_rank_outlier(three_ranks):
    _, run_dir = three_ranks("clean_small_batches")
    assert not [e for e in events(run_dir) if e["kind"].startswith("replica")]  # step 100
    found = [e for e in events(run_dir) if e["kind"] == "rank_outlier"]
    assert [e for e in found if e["severity"] != "info"] == []
    assert not any(e["metrics"].get("suspect") for e in found)


def test_gradients_x1000_on_one_rank_skip_the_step_on_every_rank_then_replay_it(three_ranks):
    results, run_dir = three_ranks("sdc")
    reference, _ = three_ranks("sdc_reference")
    planted = {40, 60, 80}
    for r in results:
        assert r["actions"] == results[0]["actions"]
        assert {s for s, a in r["actions"] if a != "step"} == planted
        assert r["weights"] == results[0]["weights"]  # the replicas never diverged
        # each planted step's update was left out, and nothing else changed
        assert r["weights"] == pytest.approx(reference[0]["skipped"]["weights"], rel=1e-5)
    found = [e for e in events(run_dir) if e["kind"] == "rank_outlier"]
    assert {e["step"] for e in found} == planted and {e["rank"] for e in found} == {1}
    verdicts = [(e["step"], e["metrics"]["suspect"]) for e in found if "suspect" in e["metrics"]]
    # a lasting fault comes back on replay; a one-off does not; with no replay, no verdict
    assert verdicts == [(40, True), (60, False), (80, None)]
    lasting = next(e for e in found if e["metrics"].get("suspect"))
    assert lasting["severity"] == "critical" and "grad norm" in lasting["message"]
    # three of 100 updates left out: the last 20 steps' loss within 5% of the clean run's
    guarded = sum(sum(r["losses"][-20:]) for r in results)
    clean = sum(sum(r["clean"]["losses"][-20:]) for r in reference)
    assert guarded == pytest.approx(clean, rel=0.05)


def test_every_rank_gets_the_same_precursors_the_max_over_the_ranks(two_ranks):
    """One all-gather on a sampled step only; each precursor the largest rank's, on every rank
    (the Adam ratio aside: the state is only the guard's to read at its step)."""
    results, _ = two_ranks("precursors_agree")
    assert results[0]["agreed"] == results[1]["agreed"]
    assert sorted(results[0]["agreed"]) == ["0", "4", "8"]
    for step in ("0", "4", "8"):
        agreed = results[0]["agreed"][step]
        for signal in ("max_logit", "attn_entropy", "block_rms", "log_z"):
            for layer, value in agreed[signal].items():
                mine = [r["local"][step][signal][layer] for r in results]
                assert value == pytest.approx(max(mine), rel=1e-6), (step, signal, layer)
                assert mine[0] != mine[1]  # the ranks did measure different figures
    baseline = results[0]["collectives_per_step"][1]
    for r in results:
        assert r["collectives_per_step"] == [
            baseline + 1 if step % 4 == 0 else baseline for step in range(9)
        ]
