"""DeepSpeed engines guarded in 2 gloo processes on the CPU (`DS_ACCELERATOR=cpu`): ZeRO stages
1, 2 and 3, fp32, bf16 and fp16; every scenario runs in one launch (DeepSpeed starts slowly)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from ds_worker import SCENARIOS, run

WORLD = 2


def launch(out: Path, world: int, scenarios: list[str]) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as patch:  # the workers' setting, not the session's
        patch.setenv("OMP_NUM_THREADS", "1")
        mp.spawn(run, args=(world, scenarios, str(out), port), nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("deepspeed")
    two_ranks = [name for name in SCENARIOS if name != "replica_three"]
    return out, launch(out, WORLD, two_ranks)


def events(folder: Path) -> list[dict[str, Any]]:
    lines = (folder / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def not_stepped(result: dict[str, Any]) -> list[list[Any]]:
    return [a for a in result["actions"] if a[1] != "step"]


def weights_at(result: dict[str, Any], step: int) -> list[list[float]]:
    """The weights at the start of `step`, each time it was reached."""
    return [w for s, w in result["at_start"] if s == step]


@pytest.mark.slow(
    "the first test of the module's DeepSpeed world: the `runs` fixture starts 2 ranks once "
    "and runs every two-rank scenario in them"
)
def test_a_nan_on_rank_1_alone_makes_every_rank_skip_the_same_step(runs):
    out, results = runs
    first, second = (r["nan_on_rank1"] for r in results)
    assert not_stepped(first) == not_stepped(second) == [[12, "skip"]]
    assert first["weights"] == second["weights"]  # the partitions never diverged
    assert weights_at(first, 13) == weights_at(first, 12)  # nothing was updated
    assert first["engine_steps"] == 20  # the engine counted the skipped step
    found = [e for e in events(out / "nan_on_rank1") if e["step"] == 12]
    outlier = next(e for e in found if e["kind"] == "rank_outlier")
    assert outlier["rank"] == 1 and outlier["severity"] == "critical"
    assert "non-finite loss on rank 1" in outlier["message"]
    assert next(e for e in found if e["kind"] == "nonfinite")["severity"] == "critical"


def test_an_fp16_overflow_is_the_engine_scalers_skip_not_an_incident(runs):
    out, results = runs
    for r in results:
        result = r["fp16_overflow"]
        assert not_stepped(result) == [[8, "skip"]]
        # the engine's scaler halved the scale on the overflow (hysteresis 1), not before
        assert result["scales"][7] == 256.0 and result["scales"][8] == 128.0
        assert weights_at(result, 9) == weights_at(result, 8)
    found = events(out / "fp16_overflow")
    overflow = [e for e in found if e["kind"] == "fp16_overflow"]
    assert [(e["step"], e["severity"]) for e in overflow] == [(8, "info")]
    assert overflow[0]["metrics"]["loss_scale"] == 256.0
    assert not [e for e in found if e["kind"] in ("nonfinite", "halt", "rollback")]


def test_a_toxic_batch_on_one_rank_is_skipped_on_every_rank_and_quarantined(runs):
    out, results = runs
    assert all(not_stepped(r["toxic_on_rank0"]) == [[30, "skip"]] for r in results)
    assert results[0]["toxic_on_rank0"]["weights"] == results[1]["toxic_on_rank0"]["weights"]
    found = events(out / "toxic_on_rank0")
    spike = next(e for e in found if e["kind"] == "loss_spike")
    assert spike["step"] == 30 and "data toxicity" in spike["message"]
    assert next(e for e in found if e["kind"] == "rank_outlier")["rank"] == 0
    quarantine = next(e for e in found if e["kind"] == "quarantine")
    assert quarantine["metrics"]["spike_step"] == 30
    records = (out / "toxic_on_rank0" / "quarantine-rank0.jsonl").read_text()
    assert "r0-b30" in records


@pytest.mark.parametrize("stage", [2, 3])
def test_an_lr_burst_is_rolled_back_to_the_partitions_as_they_were(runs, stage):
    out, results = runs
    first, second = (r["lr_burst"][f"stage{stage}"] for r in results)
    assert not_stepped(first) == not_stepped(second)
    rollbacks = [e for e in events(out / "lr_burst" / f"stage{stage}") if e["kind"] == "rollback"]
    assert len(rollbacks) == 1
    to_step = rollbacks[0]["metrics"]["to_step"]
    assert to_step <= 43 and rollbacks[0]["step"] > 43
    for result in (first, second):
        before, after = weights_at(result, to_step)  # reached, then rolled back to
        assert after == before  # every rank's partition restored exactly
        assert result["engine_steps"] == 70  # DeepSpeed's count went back with the weights
        assert max(result["losses"][-10:]) < 1.0  # training went on healthy
    assert first["weights"] == second["weights"]


@pytest.mark.parametrize("stage", ["1", "3", "2-accumulating"])
def test_a_clean_run_is_left_alone(runs, stage):
    out, results = runs
    for r in results:
        guarded, plain = r["clean"]["guarded"][stage], r["clean"]["plain"][stage]
        assert not_stepped(guarded) == []
        assert len(guarded["norms"]) == guarded["engine_steps"] == 30
        # none a micro-batch; a step: the all-gather's one collective, or the reduce's SUM and
        # MAX (the default), and no round naming a rank
        assert guarded["exchange_calls"] == (30 if stage == "1" else 2 * 30)
        assert guarded["exchange_rounds"] == 0
        # the replicas agreed at steps 5, 10, ..., 25; ZeRO-3 replicates nothing to compare
        assert guarded["replica_checks"] == (0 if stage == "3" else 5)
        assert guarded["weights"] == plain["weights"]  # bit for bit the engine's own run
        # the guard's norm, measured before the engine clips, is the engine's own
        for ours, engines in guarded["norms"]:
            assert ours == pytest.approx(engines, rel=1e-5)
    found = events(out / "clean" / f"stage{stage}")
    assert not [e for e in found if e["severity"] != "info"]


def test_a_replica_nudged_by_1e_minus_6_is_found_at_the_next_check_before_the_engine_steps(
    runs,
):
    out, results = runs
    for r in results:
        result = r["replica_nudge"]
        assert [a for a in result["actions"] if a[1] != "step"] == []
        assert len(result["actions"]) == 10  # steps 0-9 taken, halted at the check at 10
        # 2 ranks, 2 versions: no majority to tell the right one, so a halt naming both
        halted = result["halted"]
        assert "no majority" in halted and "ranks by version [0, 1]" in halted
        assert "at or before step 5" in halted
        # collectives: the check at 5 (agreed: one all-reduce), at 10 (differed: an all-gather
        # of the group that differs too), then around the regather, differing and agreeing
        assert result["checks"] == 1 + 2 + 2 + 1
        # nudged again, the copies differ; gathered again from the partitions, they agree
        assert result["differ_before"] != {} and result["differ_after"] == {}
        assert (
            "gathered the module's weights again from the ZeRO partitions"
            in (result["regathered"][0])
        )
    found = [
        e for e in events(out / "replica_nudge") if e["kind"] in ("replica_divergence", "halt")
    ]
    assert [(e["step"], e["kind"]) for e in found] == [(10, "replica_divergence"), (10, "halt")]
    divergence = found[0]
    assert divergence["metrics"]["ranks"] == [0, 1] and divergence["metrics"]["source"] is None
    assert divergence["metrics"]["last_agreed_step"] == 5
    assert divergence["metrics"]["classes"] == {"0": [0, 1]}


@pytest.mark.slow(
    "a third DeepSpeed rank makes a majority: its own 3-rank world, DeepSpeed imported in each"
)
def test_with_a_majority_a_diverged_replica_is_skipped_and_gathered_again(tmp_path):
    results = launch(tmp_path, 3, ["replica_three"])
    for r in results:
        result = r["replica_three"]
        assert [a for a in result["actions"] if a[1] != "step"] == [[10, "skip"]]
        assert len(result["actions"]) == result["engine_steps"] == 15  # then training went on
        assert result["weights"] == results[0]["replica_three"]["weights"]
        # checks at 5 (agreed), 10 (differed: two collectives), 11 (after the regather: agreed)
        assert result["checks"] == 1 + 2 + 1
    found = [e for e in events(tmp_path / "replica_three") if e["kind"].startswith("replica")]
    assert [(e["step"], e["kind"]) for e in found] == [
        (10, "replica_divergence"),
        (10, "replica_resync"),
    ]  # the check right after the regather (11) and the one at 5 agreed
    divergence, regather = found
    assert divergence["rank"] == 2 and divergence["metrics"]["groups"] == {"2": ["0"]}
    assert divergence["metrics"]["source"] == 0 and divergence["metrics"]["last_agreed_step"] == 5
    assert regather["metrics"]["ranks"] == [2] and regather["metrics"]["dropped_snapshots"] == []
    assert "again from the ZeRO partitions" in regather["message"]


def test_checkpoints_by_time_come_at_the_same_step_on_every_rank(runs):
    out, results = runs
    # rank 1's clock runs 25 s a step, rank 0's stands still: 60 s are due on rank 1 alone
    assert [r["timed_checkpoint"]["saved_at"] for r in results] == [[4, 7, 10]] * WORLD
    checkpoints = out / "timed_checkpoint" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-10", "step-4", "step-7"]
    assert (checkpoints / "latest").read_text() == "step-10"
    for step in (4, 7, 10):
        written = {p.name for p in (checkpoints / f"step-{step}").iterdir()}
        assert {"trainguard-rank0.json", "trainguard-rank1.json"} <= written


def test_a_deepspeed_resume_runs_no_planted_code_loads_nothing_outside_and_falls_back(runs):
    out, results = runs
    for r in results:
        found = r["checkpoint_attacks"]
        assert found["payload_ran"] is False  # neither planted file ran its payload
        assert "GLOBAL exec" in found["refused"]  # DeepSpeed's own reader, made weights-only
        assert found["resumed_at"] == 2  # not 6 (outside), 6 or 4 (planted): the one before
        assert found["engine_steps"] == 2
    warnings = [e["message"] for e in events(out / "checkpoint_attacks" / "run")]
    assert any("latest names '../../elsewhere/step-6', not a step-N" in m for m in warnings)
    assert any(  # its manifest recomputed to match: the digests alone would pass it
        "step-6 is unusable: its mp_rank_00_model_states.pt pickles builtins.exec" in m
        for m in warnings
    )
    assert any(  # the manifest as the run wrote it
        "step-4 is unusable: its mp_rank_00_model_states.pt is not of its listed size" in m
        for m in warnings
    )
    assert any("resumed from the DeepSpeed checkpoint at step 2 (step-2)" in m for m in warnings)


def test_a_second_deepspeed_run_in_a_used_folder_sets_the_first_runs_checkpoints_aside(runs):
    out, results = runs
    for r in results:
        found = r["checkpoint_attacks"]
        # run A's four checkpoints and its `latest`, whole, beside run B's
        earlier = ["latest", "step-2", "step-4", "step-6", "step-8"]
        kept = [[n for n in names if not n.startswith("zero_to")] for names in found["earlier"]]
        assert kept == [earlier]  # one folder set aside (DeepSpeed's zero_to_*.py scripts too)
        assert found["b_kept"] == ["step-2", "step-4", "step-6"]  # none deleted as written
    warnings = [e["message"] for e in events(out / "checkpoint_attacks" / "run")]
    assert any(
        "held checkpoints of an earlier run (newest step-8): moved to" in m for m in warnings
    )


def test_an_engine_the_guard_cannot_drive_gets_one_line_saying_what_to_do(runs):
    _, results = runs
    said = results[0]["unsupported"]
    assert "ZeRO stage 1, 2 or 3" in said["stage0"] and "tg.Guard" in said["stage0"]
    assert "deepspeed.initialize" in said["module"]
    assert all("\n" not in line for line in said.values())


def test_the_private_deepspeed_names_still_exist(runs):
    """`trainguard.integrations._deepspeed_private` reads these; a DeepSpeed release that
    renames one fails here first."""

    def missing(result: Any) -> list[str]:
        if not isinstance(result, dict):
            return []
        if "actions" in result:
            return list(result["private_missing"])
        return [name for inner in result.values() for name in missing(inner)]

    _, results = runs
    assert [name for r in results for res in r.values() for name in missing(res)] == []


def torchrun(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(WORLD),
        "--max-restarts",
        "1",
        str(Path(__file__).with_name("ds_torchrun_worker.py")),
        str(run_dir),
        *args,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=400, check=False
    )


@pytest.mark.slow(
    "what it checks is a real restart: torchrun runs 2 DeepSpeed ranks clean, then killed and "
    "restarted, each start importing DeepSpeed"
)
def test_a_rank_killed_under_torchrun_resumes_from_deepspeeds_checkpoint(tmp_path):
    clean = torchrun(tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-3000:]
    killed = torchrun(tmp_path / "killed", "--kill-at", "37")
    assert killed.returncode == 0, killed.stderr[-3000:]
    for rank in range(WORLD):
        a = json.loads((tmp_path / "clean" / f"result-rank{rank}.json").read_text())
        b = json.loads((tmp_path / "killed" / f"result-rank{rank}.json").read_text())
        assert b["attempt"] == "1" and b["start"] == 30  # the last complete checkpoint
        assert b["window_at_start"] > 0  # the detectors' state came back
        assert b["weights"] == a["weights"]  # bit for bit the uninterrupted run's
        assert b["engine_steps"] == a["engine_steps"] == 50
    assert json.loads((tmp_path / "killed" / "result-rank0.json").read_text())["quarantined"] == 1
    found = events(tmp_path / "killed")
    assert any(e["kind"] == "resume" and e["metrics"]["step"] == 30 for e in found)
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step-50"
    step = checkpoints / "step-50"
    assert {f"trainguard-rank{r}.json" for r in range(WORLD)} <= {p.name for p in step.iterdir()}
    assert len(list(step.glob("*optim_states.pt"))) == WORLD  # each rank's ZeRO partition


def test_the_prepare_step_clears_only_a_stale_build_lock(tmp_path):
    from prepare_deepspeed import OP, STALE_AFTER_S, clear_stale_locks

    stale, fresh, held = (tmp_path / name / OP for name in ("a", "b", "c"))
    for folder in (stale, fresh, held):
        folder.mkdir(parents=True)
        (folder / "lock").touch()
    old = time.time() - 2 * STALE_AFTER_S
    os.utime(stale / "lock", (old, old))
    os.utime(held / "lock", (old, old))
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=held)
    try:
        removed = clear_stale_locks(tmp_path, time.time())
    finally:
        builder.kill()
        builder.wait()
    assert removed == [stale / "lock"]  # a killed compile's; not a fresh one, not one in use
    assert (fresh / "lock").exists() and (held / "lock").exists()


def test_the_prepare_step_does_nothing_where_the_op_is_built(tmp_path, monkeypatch, capsys):
    """A second `make test` finds the built op and neither imports DeepSpeed nor prints a line;
    a build lock beside it (a build under way) or no op at all means it is not ready."""
    import prepare_deepspeed

    python = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    folder = tmp_path / python / prepare_deepspeed.OP
    assert not prepare_deepspeed.built(tmp_path)
    folder.mkdir(parents=True)
    (folder / f"{prepare_deepspeed.OP}.so").touch()
    assert prepare_deepspeed.built(tmp_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # an import would raise
    assert prepare_deepspeed.main() == 0 and capsys.readouterr().out == ""
    (folder / "lock").touch()
    assert not prepare_deepspeed.built(tmp_path)


def test_the_hf_trainer_running_deepspeed_is_guarded_by_the_callback(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    worker = str(Path(__file__).with_name("ds_hf_worker.py"))
    done = subprocess.run(
        [sys.executable, worker, str(tmp_path), str(port)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["guard"] == "DeepSpeedGuard"
    assert result["trainer_steps"] == result["guard_steps"] == result["engine_steps"] == 24
    assert result["finite"] and result["step_restored"]
    lines = (tmp_path / "guard" / "metrics.jsonl").read_text().splitlines()
    actions = {r["step"]: r["action"] for r in map(json.loads, lines)}
    assert [s for s, a in actions.items() if a != "step"] == [12]
    assert actions[12] == "skip"
    nonfinite = [e for e in events(tmp_path / "guard") if e["kind"] == "nonfinite"]
    assert [(e["step"], e["severity"]) for e in nonfinite] == [(12, "critical")]


def test_precursors_under_zero_2_and_3_are_measured_on_the_sampled_steps_alike(runs):
    """The probe on the first micro-batch of every 2nd step, under ZeRO-2 and ZeRO-3, hooks gone
    between; every rank's figures the same (one all-gather); a token accuracy passed in."""
    out, results = runs
    for stage in ("2", "3"):
        ranks = [r["precursors"][stage] for r in results]
        assert ranks[0]["records"] == ranks[1]["records"]
        records = ranks[0]["records"]
        assert [r is not None for r in records] == [True, False, True, False, True]
        assert set(records[2]) == {"max_logit", "attn_entropy", "block_rms", "log_z", "vocab_size"}
        assert set(records[2]["max_logit"]) == {"0", "1"}
        assert ranks[0]["hooked"] == [False, True, False, True, False]
        lines = [
            json.loads(x)
            for x in (out / "precursors" / f"stage{stage}" / "metrics.jsonl")
            .read_text()
            .splitlines()
        ]
        assert [x.get("token_accuracy") for x in lines if "step" in x] == [0.5] * 5
