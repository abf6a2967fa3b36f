"""Durable checkpoints and resume: SIGKILL, a kill while a checkpoint is written, corruption."""

from __future__ import annotations

import json
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.actions.checkpoint_files import MANIFEST, file_digest
from trainguard.actions.checkpoints import CheckpointStore

from helpers import read_jsonl
from helpers import worker_losses as losses

WORKER = Path(__file__).with_name("resume_worker.py")
STEPS = 120


def worker(run_dir: Path, *args: str) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, str(WORKER), str(run_dir), str(STEPS), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(done.stderr[-3000:])
    return done.returncode


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, str]:
    run_dir = tmp_path_factory.mktemp("reference")
    assert worker(run_dir) == 0
    return losses(run_dir)


@pytest.mark.slow(
    "the first user of the module's reference run (a subprocess trained to the end), then a "
    "run killed by SIGKILL and resumed"
)
def test_resume_after_sigkill_follows_the_same_trajectory_bit_for_bit(reference, tmp_path):
    assert worker(tmp_path, "--kill-at", "90") == -signal.SIGKILL
    assert max(losses(tmp_path)) == 89
    assert worker(tmp_path, "--resume") == 0
    events = read_jsonl(tmp_path / "events.jsonl")
    (resume,) = [e for e in events if e["kind"] == "resume"]
    assert resume["metrics"]["step"] == 80  # the newest complete checkpoint
    assert losses(tmp_path) == reference  # every step, 80..119 replayed, equal as bits


def test_sigkill_while_a_checkpoint_is_written_keeps_the_previous_one(reference, tmp_path):
    assert worker(tmp_path, "--kill-writing", "80") == -signal.SIGKILL
    directory = tmp_path / "checkpoints"
    assert [p.name for p in CheckpointStore(directory).complete()] == ["step-40"]
    partial = [p for p in directory.iterdir() if p.name.startswith(".step-80.tmp-")]
    assert partial and not (partial[0] / MANIFEST).exists()
    kept = set(json.loads((directory / "step-40" / MANIFEST).read_text())["blobs"])
    stored = {p.name for p in (directory / "blobs").iterdir()}
    assert stored - kept  # killed with step 80's blobs written, before its manifest
    assert worker(tmp_path, "--resume") == 0
    events = read_jsonl(tmp_path / "events.jsonl")
    warnings = [e["message"] for e in events if e["kind"] == "checkpoint"]
    assert any("incomplete checkpoint" in w for w in warnings)
    assert [e["metrics"]["step"] for e in events if e["kind"] == "resume"] == [40]
    assert losses(tmp_path) == reference
    newest = [json.loads((p / MANIFEST).read_text()) for p in CheckpointStore(directory).complete()]
    used = set().union(*(m["blobs"] for m in newest))
    assert {p.name for p in (directory / "blobs").iterdir()} == used  # orphans collected


def _tiny_guard(run_dir: Path, dedup: bool = True) -> tuple[tg.Guard, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = tg.GuardConfig(
        console=False,
        recovery={
            "checkpoint_every": 10,
            "keep_checkpoints": 2,
            "async_checkpoints": False,
            "dedup_checkpoints": dedup,
        },
    )
    return tg.Guard.resume(run_dir, model, opt, config=cfg), model


def _train(guard: tg.Guard, model: torch.nn.Module, until: int) -> None:
    x = torch.randn(8, 4)
    while guard.global_step < until:
        loss = model(x).pow(2).mean()
        loss.backward()
        guard.step(loss)
        guard.optimizer.zero_grad()


def test_a_corrupt_or_tampered_checkpoint_is_passed_over(tmp_path):
    """DCP's own files (`dedup_checkpoints` off); blobs: tests/test_checkpoint_dedup.py."""
    guard, model = _tiny_guard(tmp_path, dedup=False)
    _train(guard, model, 30)
    guard.close()
    directory = tmp_path / "checkpoints"
    assert [p.name for p in CheckpointStore(directory).complete()] == ["step-30", "step-20"]
    data = directory / "step-30" / "__0_0.distcp"
    data.write_bytes(b"\0" + data.read_bytes()[1:])  # one flipped byte
    guard, _ = _tiny_guard(tmp_path, dedup=False)
    events = read_jsonl(tmp_path / "events.jsonl")
    assert any("fails its checksum" in e["message"] for e in events if e["kind"] == "checkpoint")
    assert guard.global_step == 20
    guard.close()  # one live Guard per run folder

    # a .metadata that would run code when unpickled, with a manifest that vouches for it
    evil = directory / "step-20"
    (evil / ".metadata").write_bytes(pickle.dumps(_Evil()))
    manifest = json.loads((evil / MANIFEST).read_text())
    manifest["files"][".metadata"] = file_digest(evil / ".metadata", 20)
    (evil / MANIFEST).write_text(json.dumps(manifest))
    shutil.rmtree(directory / "step-30")
    guard, _ = _tiny_guard(tmp_path, dedup=False)
    assert not (tmp_path / "pwned").exists()
    assert guard.global_step == 0  # nothing usable was left: a fresh start, with a warning
    messages = [e["message"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert any("REDUCE of pathlib.Path.touch" in m for m in messages)


class _Evil:
    def __reduce__(self):
        return (Path.touch, (Path(__file__).parent / "pwned",))


def test_retention_keeps_the_newest_and_the_last_good_before_an_incident(tmp_path):
    guard, model = _tiny_guard(tmp_path)
    _train(guard, model, 20)
    assert guard.checkpointing is not None
    guard.checkpointing.last_good = 20
    guard.checkpointing.protect_last_good()  # as a rollback or halt does
    _train(guard, model, 60)
    guard.close()
    kept = [p.name for p in CheckpointStore(tmp_path / "checkpoints").complete()]
    assert kept == ["step-60", "step-50", "step-20"]


def test_resume_needs_an_existing_run_dir(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tg.TrainguardError, match="does not exist"):
        tg.Guard.resume(tmp_path / "nope", model, opt)
