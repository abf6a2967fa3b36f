"""Checkpoints by change: an unchanged tensor is not written again, each checkpoint verifies every
blob it uses, deleting an old checkpoint never breaks a newer one, and a crash between the blobs
and the manifest leaves the store usable."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import trainguard as tg
from finetune import build, config, frozen_share, loader, stored_bytes, train
from trainguard.actions.checkpoint_blobs import BlobWriter, collect_blobs, read_table
from trainguard.actions.checkpoint_files import (
    MANIFEST,
    TENSOR_TABLE,
    DamagedCheckpoint,
    file_digest,
)
from trainguard.actions.checkpoints import CheckpointStore

from helpers import read_jsonl


def manifest(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step-{step}" / MANIFEST).read_text())


def blob_file(run_dir: Path, digest: str) -> Path:
    return run_dir / "checkpoints" / "blobs" / digest


def checkpoint_warnings(run_dir: Path) -> list[str]:
    return [e["message"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "checkpoint"]


def full_bytes(run_dir: Path, step: int) -> int:
    """The bytes of every tensor a checkpoint holds, as a checkpoint without sharing writes."""
    path = run_dir / "checkpoints" / f"step-{step}" / TENSOR_TABLE
    table = json.loads(path.read_text())["tensors"]
    return sum(c["bytes"] for entry in table.values() for c in entry["chunks"])


def run_to(run_dir: Path, until: int, **cfg) -> tuple[tg.Guard, torch.nn.Module, list[str]]:
    model, opt = build()
    guard = tg.Guard(model, opt, config=config(**cfg), run_dir=run_dir)
    return guard, model, train(guard, model, loader(), until)


def test_a_frozen_base_is_written_once_and_resumes_bit_exact(tmp_path):
    """90% of the parameters frozen, AdamW on the rest: after the first save each one writes the
    head, its two moments and the random state, and nothing of the base; a run resumed from its
    newest checkpoint follows the uninterrupted one bit for bit."""
    model, opt = build()
    assert frozen_share(model) == pytest.approx(0.90, abs=0.002)
    head = sum(p.numel() * 4 for p in model.head.parameters())
    rng = torch.get_rng_state().numel()
    guard = tg.Guard(model, opt, config=config(every=4), run_dir=tmp_path / "run")
    data, written, before = loader(), [], stored_bytes(tmp_path / "run")
    losses = []
    for until in (4, 8, 12, 16):
        losses += train(guard, model, data, until)
        guard.checkpoints.wait()
        after = stored_bytes(tmp_path / "run")
        new = [path for path in after if path not in before and path.startswith("blobs/")]
        written.append(sum(after[path] for path in new))
        before = after
        if until == 4:  # the first save writes every blob it uses
            assert written[0] == sum(manifest(tmp_path / "run", 4)["blobs"].values())
    guard.close()
    full = full_bytes(tmp_path / "run", 16)
    assert written[0] >= 0.95 * full  # less only by identical tensors (ones, zeros) stored once
    for size in written[1:]:
        # the head and its two AdamW moments, the random state (and 8 bytes of step counters):
        # never a byte of the frozen base
        assert 3 * head <= size <= 3 * head + rng + 16, (size, full)
    table = json.loads((tmp_path / "run/checkpoints/step-16" / TENSOR_TABLE).read_text())
    frozen = table["tensors"]["model.encoder.0.linear1.weight"]["chunks"][0]["blob"]
    assert all(frozen in manifest(tmp_path / "run", s)["blobs"] for s in (8, 12, 16))

    interrupted = tmp_path / "interrupted"
    guard, _, first = run_to(interrupted, 10, every=4)
    guard.close()  # stopped at step 10: its newest checkpoint is of step 8
    model, opt = build()
    guard = tg.Guard.resume(interrupted, model, opt, config=config(every=4))
    assert guard.global_step == 8
    second = train(guard, model, loader(), 16)
    guard.close()
    assert first[:8] + second == losses  # the same batches, dropout and updates, as bits
    final, final_opt = build()
    tg.Guard.resume(tmp_path / "run", final, final_opt, config=config(every=4)).close()
    for a, b in zip(model.state_dict().values(), final.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    state_a, state_b = opt.state_dict()["state"], final_opt.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for pid in state_a:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state_a[pid][key], state_b[pid][key])


def test_a_changed_tensor_is_always_written_even_behind_autograd_back(tmp_path):
    """A frozen tensor changed through `.data` (no version bump) and a 0.0 turned -0.0 (equal as
    numbers, not as bytes) are written again, and resume restores them."""
    run_dir = tmp_path / "run"
    model, opt = build()
    guard = tg.Guard(model, opt, config=config(every=2, asynchronous=False), run_dir=run_dir)
    data = loader()
    train(guard, model, data, 2)
    bias = model.encoder[0].linear1.bias
    weight = model.encoder[1].linear2.weight
    version = weight._version
    bias.data.zero_()
    train(guard, model, data, 4)
    bias.data.neg_()  # every 0.0 becomes -0.0
    weight.data[0, 0] += 1.0
    assert weight._version == version  # invisible to the version counter
    train(guard, model, data, 6)
    guard.close()
    blobs = [set(manifest(run_dir, s)["blobs"]) for s in (2, 4, 6)]
    assert blobs[1] != blobs[0] and blobs[2] != blobs[1]
    resumed, opt2 = build()
    tg.Guard.resume(run_dir, resumed, opt2, config=config(every=2)).close()
    restored = resumed.encoder[0].linear1.bias
    assert torch.equal(restored, bias) and bool(torch.signbit(restored).all())
    assert torch.equal(resumed.encoder[1].linear2.weight, weight)


DAMAGES = {
    "flipped byte": lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]),
    "truncated": lambda f: f.write_bytes(f.read_bytes()[:-4]),
    "deleted": lambda f: f.unlink(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_blob_fails_its_checkpoint_and_resume_falls_back(tmp_path, damage):
    run_dir = tmp_path / "run"
    guard, _, _ = run_to(run_dir, 8, every=4, asynchronous=False)
    guard.close()
    only_newest = sorted(set(manifest(run_dir, 8)["blobs"]) - set(manifest(run_dir, 4)["blobs"]))
    guard, replay, _ = run_to(tmp_path / "replay", 4, every=0)
    guard.close()
    at_4 = {k: v.clone() for k, v in replay.state_dict().items()}  # trained for 4 steps
    DAMAGES[damage](blob_file(run_dir, only_newest[0]))
    model, opt = build()
    guard = tg.Guard.resume(run_dir, model, opt, config=config(every=4))
    guard.close()
    assert guard.global_step == 4
    for key, value in model.state_dict().items():
        assert torch.equal(value, at_4[key]), key
    (warning,) = [w for w in checkpoint_warnings(run_dir) if "step-8" in w]
    word = "missing" if damage == "deleted" else "fails its checksum"
    assert f"blob {only_newest[0][:12]}" in warning and word in warning, warning


def test_an_unknown_storage_is_one_line_saying_what_to_do(tmp_path):
    run_dir = tmp_path / "run"
    guard, _, _ = run_to(run_dir, 4, every=4, asynchronous=False)
    guard.close()
    path = run_dir / "checkpoints" / "step-4"
    record = manifest(run_dir, 4)
    record["storage"] = "blobs-v9"
    (path / MANIFEST).write_text(json.dumps(record))
    with pytest.raises(tg.TrainguardError, match="upgrade trainguard"):
        CheckpointStore(run_dir / "checkpoints").verify(path)


def test_retention_deletes_old_checkpoints_and_only_the_blobs_none_kept_uses(tmp_path):
    run_dir = tmp_path / "run"
    guard, model, _ = run_to(run_dir, 4, every=2, keep=2, asynchronous=False)
    frozen_blobs = set(manifest(run_dir, 2)["blobs"]) & set(manifest(run_dir, 4)["blobs"])
    # a crash in the middle of deleting an old checkpoint: the folder was renamed, not removed
    shutil.copytree(run_dir / "checkpoints/step-2", run_dir / "checkpoints/.step-2.deleted-x")
    original = BlobWriter.finish

    def crash(self, *args, **kwargs):  # every blob of step 6 written, then no table or manifest
        raise OSError(28, "No space left on device")

    BlobWriter.finish = crash  # type: ignore[method-assign]
    try:
        train(guard, model, loader(), 6)
    finally:
        BlobWriter.finish = original  # type: ignore[method-assign]
    guard.checkpoints.wait()
    assert any("step 6 could not be written" in w for w in checkpoint_warnings(run_dir))
    assert not (run_dir / "checkpoints/step-6").exists()
    kept = set(manifest(run_dir, 4)["blobs"]) | set(manifest(run_dir, 2)["blobs"])
    assert {p.name for p in (run_dir / "checkpoints" / "blobs").iterdir()} == kept
    train(guard, model, loader(), 12)  # saves at 8, 10, 12: step-2 .. step-8 go
    guard.close()
    store = CheckpointStore(run_dir / "checkpoints")
    assert [p.name for p in store.complete()] == ["step-12", "step-10"]
    for path in store.complete():
        store.verify(path)  # every blob a kept checkpoint uses is there and whole
    used = set(manifest(run_dir, 12)["blobs"]) | set(manifest(run_dir, 10)["blobs"])
    on_disk = {p.name for p in (run_dir / "checkpoints" / "blobs").iterdir()}
    assert on_disk == used  # the old ones' own blobs, step 6's orphans and leftovers: gone
    assert frozen_blobs <= used  # written at step 2, still used: never rewritten or deleted
    assert not list((run_dir / "checkpoints").glob(".step-*"))


def test_a_checkpoint_of_the_old_format_still_resumes_and_both_formats_coexist(tmp_path):
    run_dir = tmp_path / "run"
    guard, _, _ = run_to(run_dir, 4, every=4, dedup=False, asynchronous=False)
    guard.close()
    assert (run_dir / "checkpoints/step-4/.metadata").is_file()
    model, opt = build()
    guard = tg.Guard.resume(run_dir, model, opt, config=config(every=4, keep=5))
    assert guard.global_step == 4
    train(guard, model, loader(), 8)
    guard.close()
    assert "storage" not in manifest(run_dir, 4) and manifest(run_dir, 8)["storage"] == "blobs"
    store = CheckpointStore(run_dir / "checkpoints")
    for path in store.complete():
        store.verify(path)
    shutil.rmtree(run_dir / "checkpoints/step-8")
    model, opt = build()
    guard = tg.Guard.resume(run_dir, model, opt, config=config(every=4, keep=5))
    guard.close()
    assert guard.global_step == 4


FROZEN = "model.encoder.0.linear1.weight"  # a weight of the frozen base: its blob is reused


def blob_of(run_dir: Path, step: int, key: str) -> str:
    path = run_dir / "checkpoints" / f"step-{step}" / TENSOR_TABLE
    return json.loads(path.read_text())["tensors"][key]["chunks"][0]["blob"]


def live_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, values in opt.state_dict()["state"].items():
        state |= {f"opt.{pid}.{k}": v.clone() for k, v in values.items()}
    return state


def test_a_blobs_folder_linked_to_another_runs_never_loses_that_runs_blobs(tmp_path):
    """A second run whose `checkpoints/blobs` links to the first run's: refused at the start in
    one line; the same link planted mid-run: the second run's saves fail with a warning, its
    collector deletes nothing there, and the first run keeps every blob and resumes at its
    newest step."""
    guard, _, _ = run_to(tmp_path / "a", 10, every=2, asynchronous=False)
    guard.close()
    shared = tmp_path / "a" / "checkpoints" / "blobs"
    first = {p.name: p.read_bytes() for p in shared.iterdir()}
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    (tmp_path / "b" / "checkpoints" / "blobs").symlink_to(shared)
    model, opt = build()
    with pytest.raises(tg.TrainguardError, match=r"blobs is a symbolic link; .* never writes"):
        tg.Guard(model, opt, config=config(every=2, keep=2), run_dir=tmp_path / "b")
    (tmp_path / "b" / "checkpoints" / "blobs").unlink()
    model, opt = build()
    opt.param_groups[0]["lr"] = 1e-2  # another run: other head weights, other blobs
    guard = tg.Guard(model, opt, config=config(every=2, keep=2), run_dir=tmp_path / "b")
    data = loader()
    train(guard, model, data, 4)
    guard.checkpoints.wait()  # type: ignore[union-attr]
    own = tmp_path / "b" / "checkpoints" / "blobs"
    own.rename(own.with_name("blobs-moved"))
    own.symlink_to(shared)  # planted while the run goes on
    train(guard, model, data, 10)
    guard.close()
    assert {p.name: p.read_bytes() for p in shared.iterdir()} == first
    said = [w for w in checkpoint_warnings(tmp_path / "b") if "symbolic link" in w]
    assert said, checkpoint_warnings(tmp_path / "b")
    model, opt = build()
    guard = tg.Guard.resume(tmp_path / "a", model, opt, config=config(every=2))
    guard.close()
    assert guard.global_step == 10


def test_the_collector_never_follows_or_deletes_through_a_link(tmp_path):
    """A linked blobs folder is left alone; in a real one, an unused blob goes, and a link named
    like a blob stays with its target."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"another run's bytes")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    unused, linked, kept = "a" * 64, "b" * 64, "c" * 64
    for name in (unused, kept):
        (blobs / name).write_bytes(b"x" * 10)
    (blobs / linked).symlink_to(outside)
    (tmp_path / "link").symlink_to(blobs)
    assert collect_blobs(tmp_path / "link", {kept}) == 0
    assert (blobs / unused).exists()
    assert collect_blobs(blobs, {kept}) == 10
    assert sorted(p.name for p in blobs.iterdir()) == [linked, kept]
    assert outside.read_bytes() == b"another run's bytes"


def _relink(f: Path) -> None:
    """The blob replaced by a link to a copy of its bytes elsewhere."""
    copy = f.with_name("..").resolve() / f"copy-{f.name}"
    copy.write_bytes(f.read_bytes())
    f.unlink()
    f.symlink_to(copy)


REPAIRS = {**DAMAGES, "a link": _relink}
REPAIR_WORDS = {
    "flipped byte": "was damaged on disk (its bytes fail their checksum)",
    "truncated": "was damaged on disk",
    "deleted": "had vanished from blobs/",
    "a link": "was not a regular file",
}


@pytest.mark.parametrize("damage", sorted(REPAIRS))
def test_a_damaged_reused_blob_is_rewritten_by_the_next_save(tmp_path, damage):
    """A frozen weight's blob damaged on disk after the first save is rewritten by the next
    save, which says so naming the blob and the tensor; every checkpoint then verifies and the
    newest resumes bit for bit."""
    run_dir = tmp_path / "run"
    model, opt = build()
    guard = tg.Guard(model, opt, config=config(every=2, asynchronous=False), run_dir=run_dir)
    data = loader()
    train(guard, model, data, 2)
    digest = blob_of(run_dir, 2, FROZEN)
    REPAIRS[damage](blob_file(run_dir, digest))
    train(guard, model, data, 6)
    live = live_state(model, opt)
    guard.close()
    assert blob_of(run_dir, 6, FROZEN) == digest  # the same bytes, the same blob, reused
    fixed = blob_file(run_dir, digest)
    assert not fixed.is_symlink()
    assert hashlib.sha256(fixed.read_bytes()).hexdigest() == digest
    (said,) = [w for w in checkpoint_warnings(run_dir) if "rewritten" in w]
    assert said.startswith(f"blob {digest[:12]} of {FROZEN} {REPAIR_WORDS[damage]}"), said
    assert said.endswith("; rewritten from the live tensor at step 4"), said
    store = CheckpointStore(run_dir / "checkpoints")
    for path in store.complete():
        store.verify(path)
    resumed, opt2 = build()
    guard = tg.Guard.resume(run_dir, resumed, opt2, config=config(every=2))
    guard.close()
    assert guard.global_step == 6
    restored = live_state(resumed, opt2)
    assert restored.keys() == live.keys()
    for key, value in live.items():
        assert torch.equal(restored[key], value), key


EMPTY = hashlib.sha256(b"").hexdigest()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["the empty blob", TENSOR_TABLE])
def test_a_fifo_in_a_checkpoint_is_refused_without_hanging(tmp_path, where):
    """A manifest listing the empty blob, which is a FIFO, or a FIFO for a tensor table: resume
    opens neither, passes that checkpoint over with a warning and uses the one before."""
    run_dir = tmp_path / "run"
    guard, _, _ = run_to(run_dir, 4, every=2, asynchronous=False)
    guard.close()
    step_4 = run_dir / "checkpoints" / "step-4"
    if where == TENSOR_TABLE:
        (step_4 / TENSOR_TABLE).unlink()
        os.mkfifo(step_4 / TENSOR_TABLE)
    else:
        record = manifest(run_dir, 4)
        record["blobs"][EMPTY] = 0
        (step_4 / MANIFEST).write_text(json.dumps(record))
        os.mkfifo(blob_file(run_dir, EMPTY))
    model, opt = build()
    guard = tg.Guard.resume(run_dir, model, opt, config=config(every=2))
    guard.close()
    assert guard.global_step == 2
    (warning,) = [w for w in checkpoint_warnings(run_dir) if "step-4" in w]
    if where == TENSOR_TABLE:
        assert f"its {TENSOR_TABLE} is missing" in warning, warning
    else:
        assert f"its blob {EMPTY[:12]} cannot be read (a FIFO, not a regular file)" in warning, (
            warning
        )


def _tamper_table(run_dir: Path, step: int, change) -> None:
    """Change a checkpoint's tensor table and re-sign it in its manifest, as an attacker can."""
    path = run_dir / "checkpoints" / f"step-{step}"
    table = json.loads((path / TENSOR_TABLE).read_text())
    change(table["tensors"])
    (path / TENSOR_TABLE).write_text(json.dumps(table))
    record = manifest(run_dir, step)
    record["files"][TENSOR_TABLE] = file_digest(path / TENSOR_TABLE, step)
    (path / MANIFEST).write_text(json.dumps(record))


def test_a_tensor_table_whose_chunks_do_not_cover_a_tensor_is_refused(tmp_path):
    """`"chunks": []` (no bytes at all: it would load as uninitialised memory) fails its
    checkpoint with a warning naming the tensor; so do chunks that overlap where others leave a
    gap, and chunks too few; chunks that tile a tensor are accepted."""
    run_dir = tmp_path / "run"
    guard, _, _ = run_to(run_dir, 4, every=2, asynchronous=False)
    guard.close()
    _tamper_table(run_dir, 4, lambda t: t[FROZEN].update(chunks=[]))
    model, opt = build()
    guard = tg.Guard.resume(run_dir, model, opt, config=config(every=2))
    guard.close()
    assert guard.global_step == 2
    (warning,) = [w for w in checkpoint_warnings(run_dir) if "step-4" in w]
    assert f"the chunks of {FROZEN} do not cover it exactly" in warning, warning

    path = run_dir / "checkpoints" / "step-2"
    table = json.loads((path / TENSOR_TABLE).read_text())["tensors"]
    rows, cols = table[FROZEN]["size"]
    blobs = {"a" * 64: (rows - 1) * cols * 4, "b" * 64: cols * 4, "c" * 64: rows // 2 * cols * 4}

    def chunk(row: int, height: int, blob: str) -> dict:
        return {"offsets": [row, 0], "sizes": [height, cols], "blob": blob, "bytes": blobs[blob]}

    layouts = {  # row 0 twice and the last row never: as many bytes as the tensor
        "overlap and gap": [chunk(0, rows - 1, "a" * 64), chunk(0, 1, "b" * 64)],
        "half": [chunk(0, rows // 2, "c" * 64)],
        "tiled": [chunk(0, rows // 2, "c" * 64), chunk(rows // 2, rows // 2, "c" * 64)],
    }
    original = (path / TENSOR_TABLE).read_text()
    for name, chunks in layouts.items():
        tampered = json.loads(original)
        tampered["tensors"][FROZEN]["chunks"] = chunks
        (path / TENSOR_TABLE).write_text(json.dumps(tampered))
        listed = {**manifest(run_dir, 2)["blobs"], **blobs}
        if name == "tiled":
            assert len(read_table(path, listed).state_dict_metadata[FROZEN].chunks) == 2
        else:
            with pytest.raises(DamagedCheckpoint, match=f"chunks of {FROZEN} do not cover"):
                read_table(path, listed)
