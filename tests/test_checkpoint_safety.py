"""Checkpoints that cannot run code or crash resume: pickle payloads, damaged and mismatched
checkpoints, and checkpoint writes that fail on a full disk without stopping training."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import trainguard as tg
from checkpoint_damage import (
    BAD,
    DAMAGES,
    GOOD,
    folder,
    make_run,
    payloads,
    rehash,
    tiny_config,
    tiny_setup,
    train,
)
from trainguard.actions import checkpoints as checkpoints_module
from trainguard.actions.checkpoint_files import METADATA
from trainguard.actions.checkpoints import CheckpointMismatch, CheckpointStore

from helpers import TmpfsDisk, read_jsonl


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    run_dir = tmp_path_factory.mktemp("pristine")
    return run_dir, make_run(run_dir)


@pytest.fixture
def run(pristine, tmp_path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    source, weights = pristine
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    return run_dir, weights


def resume(run_dir: Path, optimizer: str = "adamw") -> tuple[tg.Guard, torch.nn.Module]:
    model, opt = tiny_setup(optimizer)
    return tg.Guard.resume(run_dir, model, opt, config=tiny_config()), model


def checkpoint_warnings(run_dir: Path) -> list[str]:
    return [e["message"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "checkpoint"]


def assert_weights(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def assert_resumes_to(
    run_dir: Path, step: int, weights: dict[int, dict[str, torch.Tensor]]
) -> None:
    """Resume `run_dir`: it must stand at `step` with the weights trained to it."""
    guard, model = resume(run_dir)
    guard.close()
    assert guard.global_step == step
    assert_weights(model, weights[step])


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_a_damaged_checkpoint_is_passed_over_for_the_one_before_it(run, name):
    run_dir, weights = run
    damage, word = DAMAGES[name]
    damage(folder(run_dir, BAD))
    assert_resumes_to(run_dir, GOOD, weights)
    (warning,) = [w for w in checkpoint_warnings(run_dir) if f"step-{BAD}" in w]
    assert word in warning, warning
    assert "using the one before it" in warning


def test_with_every_checkpoint_damaged_the_run_starts_at_step_0_untouched(run):
    run_dir, _ = run
    for step in (GOOD, BAD):
        (folder(run_dir, step) / METADATA).write_bytes(b"")
        rehash(folder(run_dir, step), step)
    model, opt = tiny_setup()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    guard = tg.Guard.resume(run_dir, model, opt, config=tiny_config())
    guard.close()
    assert guard.global_step == 0
    assert_weights(model, before)
    warnings = checkpoint_warnings(run_dir)
    assert len([w for w in warnings if "unusable" in w]) == 2
    assert any("no usable checkpoint" in w and "step 0" in w for w in warnings)


def test_no_payload_runs_code_and_each_is_passed_over(run, tmp_path):
    run_dir, weights = run
    marker = tmp_path / "pwned"
    bad = folder(run_dir, BAD)
    real = (bad / METADATA).read_bytes()
    cases = payloads(marker, real)
    assert len(cases) >= 30
    for name, data in cases.items():
        (bad / METADATA).write_bytes(data)
        rehash(bad)
        guard, model = resume(run_dir)
        guard.close()
        assert not marker.exists(), f"{name} ran code"
        assert guard.global_step == GOOD, name
        assert_weights(model, weights[GOOD])
        last = [w for w in checkpoint_warnings(run_dir) if f"step-{BAD}" in w][-1]
        assert ".metadata" in last, (name, last)


def test_the_stealth_payload_would_have_run_under_a_plain_unpickle(run, tmp_path):
    """The payload suite is live: the stealth variant runs its command through pickle itself."""
    import pickle

    marker = tmp_path / "pwned"
    real = (folder(run[0], BAD) / METADATA).read_bytes()
    pickle.loads(payloads(marker, real)["stealth: payload then the real metadata"])
    assert marker.exists()


@pytest.mark.parametrize(
    "name",
    [
        "BUILD on an allowed class, then the real metadata",
        "BUILD on an allowed function",
        "BUILD on a shared enum member",
    ],
)
def test_the_payloads_that_change_shared_objects_would_have_under_the_allow_list_alone(
    run, tmp_path, name
):
    """An exact list of globals is not enough: BUILD sets fields of what a global names. In a
    process of its own, the allow-listed unpickler without the program check is fooled."""
    real = (folder(run[0], BAD) / METADATA).read_bytes()
    data = payloads(tmp_path / "pwned", real)[name]
    (tmp_path / "payload").write_bytes(data)
    script = (
        "import io, pathlib, sys\n"
        "from trainguard.actions.checkpoint_files import MetadataUnpickler\n"
        "MetadataUnpickler(io.BytesIO(pathlib.Path(sys.argv[1]).read_bytes())).load()\n"
        "import torch.serialization as s\n"
        "from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as E\n"
        "print(getattr(pathlib.PosixPath, '__repr__') is s._get_layout"
        " or 'x' in vars(pathlib.PosixPath) or '__repr__' in vars(s._get_layout)"
        " or '__repr__' in vars(E(1)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "payload")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_a_checkpoint_of_another_optimizer_is_one_clear_error(run):
    run_dir, _ = run
    with pytest.raises(CheckpointMismatch, match="its optimizer is AdamW, the run's is SGD"):
        resume(run_dir, optimizer="sgd")
    guard, _ = resume(run_dir)  # the failed resume left the run folder free and intact
    guard.close()
    assert guard.global_step == BAD


def test_a_checkpoint_of_another_model_names_what_differs(run):
    run_dir, _ = run
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(CheckpointMismatch) as caught:
        tg.Guard.resume(run_dir, model, opt, config=tiny_config())
    message = str(caught.value)
    assert "3 model tensor(s) differ in shape (0.bias: [8] saved, [16] now)" in message
    assert "\n" not in message and "new run_dir" in message
    deeper = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    deeper.add_module("3", torch.nn.Linear(2, 2))
    opt = torch.optim.AdamW(deeper.parameters(), lr=0.01)
    with pytest.raises(CheckpointMismatch, match=r"the model has 2 tensor\(s\) it lacks \(3.bias"):
        tg.Guard.resume(run_dir, deeper, opt, config=tiny_config())


def test_a_failed_background_write_is_a_warning_and_training_goes_on(tmp_path, monkeypatch):
    model, opt = tiny_setup()
    config = tiny_config()
    config.recovery.async_checkpoints = True
    guard = tg.Guard(model, opt, config=config, run_dir=tmp_path)
    train(guard, model, GOOD)
    guard.checkpoints.wait()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CheckpointStore, "_finish", full_disk)
    train(guard, model, 2 * GOOD + 1)
    guard.close()
    assert guard.global_step == 2 * GOOD + 1
    assert [p.name for p in guard.checkpoints.directory.iterdir()] == [f"step-{GOOD}"]
    (warning,) = checkpoint_warnings(tmp_path)
    assert "checkpoint of step 20 could not be written (No space left on device)" in warning


def test_a_dcp_checkpoint_exception_never_escapes_into_training(tmp_path, monkeypatch):
    """DCP's CheckpointException derives from BaseException, past an `except Exception`."""
    model, opt = tiny_setup()
    guard = tg.Guard(model, opt, config=tiny_config(), run_dir=tmp_path)
    train(guard, model, GOOD)

    def dcp_fails(*args, **kwargs):
        raise CheckpointException("save failed", {0: (OSError(errno.EIO, "I/O error"), None)})

    monkeypatch.setattr(checkpoints_module, "dcp_save", dcp_fails)
    train(guard, model, 2 * GOOD)
    guard.close()
    assert guard.global_step == 2 * GOOD
    assert sorted(p.name for p in guard.checkpoints.directory.iterdir()) == [f"step-{GOOD}"]
    (warning,) = checkpoint_warnings(tmp_path)
    assert "OSError: [Errno 5] I/O error" in warning


@pytest.mark.parametrize("dedup", [False, True], ids=["dcp-files", "blobs"])
def test_a_full_disk_never_stops_training_and_resume_works_on_it(tmp_path, dedup):
    """The checkpoint folder on a real 1 MiB tmpfs (as root), else a folder whose writes fail."""
    checkpoints = tmp_path / "checkpoints"
    disk = TmpfsDisk.mount(checkpoints, "1m")
    try:
        model, opt = tiny_setup()
        guard = tg.Guard(model, opt, config=tiny_config(dedup), run_dir=tmp_path)
        train(guard, model, GOOD)
        assert (checkpoints / f"step-{GOOD}").is_dir()
        if disk is not None:
            disk.fill()
        else:
            os.chmod(checkpoints, 0o500)  # not root: no new folder can be made there
        train(guard, model, 4 * GOOD)
        guard.close()
        assert guard.global_step == 4 * GOOD
        left = sorted(p.name for p in checkpoints.iterdir() if p.name not in ("filler", "blobs"))
        assert left == [f"step-{GOOD}"]  # no temporary folder, the older checkpoint kept
        if dedup:  # and no blob of the failed writes, whole or partial
            kept = json.loads((checkpoints / f"step-{GOOD}" / "manifest.json").read_text())
            assert {p.name for p in (checkpoints / "blobs").iterdir()} == set(kept["blobs"])
        warnings = checkpoint_warnings(tmp_path)
        assert len(warnings) == 3 and all("could not be written" in w for w in warnings)
        guard, model = resume(tmp_path)
        guard.close()
        assert guard.global_step == GOOD
    finally:
        if disk is not None:
            disk.unmount()


def test_the_leftovers_of_an_interrupted_write_are_removed_on_resume(run):
    run_dir, _ = run
    leftover = run_dir / "checkpoints" / ".step-30.tmp-deadbeef"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"\0" * 1000)
    guard, _ = resume(run_dir)
    guard.close()
    assert not leftover.exists()
    assert guard.global_step == BAD
    assert any(
        "incomplete checkpoint" in w and "removed" in w for w in checkpoint_warnings(run_dir)
    )


def test_a_checkpoint_with_plain_sha256_digests_of_an_earlier_release_still_resumes(run):
    """Manifests written before the digests were bound to the step still verify."""
    run_dir, weights = run
    bad = folder(run_dir, BAD)
    manifest = json.loads((bad / "manifest.json").read_text())
    del manifest["checksums"]
    manifest["files"] = {
        n: hashlib.sha256((bad / n).read_bytes()).hexdigest() for n in manifest["files"]
    }
    (bad / "manifest.json").write_text(json.dumps(manifest))
    assert_resumes_to(run_dir, BAD, weights)


def test_a_checkpoint_without_a_scheduler_resumed_with_one_is_one_clear_error(run):
    run_dir, _ = run
    model, opt = tiny_setup()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    with pytest.raises(CheckpointMismatch, match="it has no scheduler state, the run has a StepLR"):
        tg.Guard.resume(run_dir, model, opt, scheduler, config=tiny_config())


def test_a_new_run_in_a_used_run_dir_replaces_none_of_its_checkpoints(run):
    run_dir, weights = run
    model, opt = tiny_setup()
    guard = tg.Guard(model, opt, config=tiny_config(), run_dir=run_dir)  # not resume: step 0
    train(guard, model, GOOD)
    guard.close()
    (aside,) = run_dir.glob("checkpoints-earlier-*")
    assert sorted(p.name for p in aside.iterdir()) == [f"step-{GOOD}", f"step-{BAD}"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step-{GOOD}"]
    (warning,) = checkpoint_warnings(run_dir)
    assert f"moved to {aside.name}" in warning and "tg.Guard.resume" in warning
    shutil.rmtree(run_dir / "checkpoints")
    aside.rename(run_dir / "checkpoints")  # the earlier run, whole: it resumes where it stood
    assert_resumes_to(run_dir, BAD, weights)


def test_a_resumed_run_keeps_its_checkpoints_in_place(run):
    run_dir, _ = run
    guard, model = resume(run_dir)
    train(guard, model, BAD + GOOD)
    guard.close()
    assert not list(run_dir.glob("checkpoints-earlier-*"))
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == [f"step-{GOOD}", f"step-{BAD}", f"step-{BAD + GOOD}"]
