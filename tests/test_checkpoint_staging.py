"""Checkpoints that block training for a staging copy only: a due checkpoint is deferred while the
previous one is written (agreed by every rank), nothing on the checkpoint path syncs the whole
device, and a tensor known unchanged since the last save is neither copied nor hashed."""

from __future__ import annotations

import ast
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainguard as tg
from finetune import VOCAB, Finetuned, build, loader
from test_distributed import launch
from trainguard.actions import host_memory, snapshots
from trainguard.actions.checkpoint_blobs import BlobWriter
from trainguard.actions.checkpoint_files import MANIFEST
from trainguard.actions.checkpoints import CheckpointStore
from trainguard.detectors import Detector
from trainguard.events import Event

from helpers import read_jsonl

SRC = Path(__file__).resolve().parents[1] / "src" / "trainguard"


def _config(every: int, asynchronous: bool = True, **recovery: Any) -> tg.GuardConfig:
    return tg.GuardConfig(
        console=False,
        diagnosis={"lint": False},
        recovery={
            "checkpoint_every": every,
            "keep_checkpoints": 10,
            "async_checkpoints": asynchronous,
            **recovery,
        },
    )


def _step(guard: tg.Guard, model: nn.Module, tokens: torch.Tensor) -> tg.Decision:
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    decision = guard.step(loss)
    assert guard.optimizer is not None
    guard.optimizer.zero_grad(set_to_none=True)
    return decision


def _steps_on_disk(run_dir: Path) -> list[int]:
    store = CheckpointStore(run_dir / "checkpoints")
    return sorted(int(p.name.removeprefix("step-")) for p in store.complete())


def _no_leftovers(run_dir: Path) -> None:
    """No temporary folder, no half-written blob, no blob that no kept checkpoint names."""
    folder = run_dir / "checkpoints"
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    blobs = {p.name for p in (folder / "blobs").iterdir()}
    named = set()
    for path in folder.glob("step-*"):
        named |= set(json.loads((path / MANIFEST).read_text())["blobs"])
    assert blobs == named


# -- 1. a due checkpoint never waits for the previous write ---------------------------------------


def test_a_due_checkpoint_is_deferred_while_the_last_is_written(tmp_path, monkeypatch):
    """The write of step 2 is held in the writer thread: the checkpoint due at step 4 is deferred
    at once (one info event), a warning once it has waited a whole interval, and it is taken at
    the first step after the writer is free; every kept checkpoint verifies and resumes."""
    gate, holding = threading.Event(), threading.Event()
    original = BlobWriter.write_data

    def held(self: BlobWriter, plan: Any, planner: Any) -> Any:
        if self.step == 2:
            holding.set()
            gate.wait(60)  # a regression that waits on the training thread fails, not hangs
        return original(self, plan, planner)

    monkeypatch.setattr(BlobWriter, "write_data", held)
    run_dir = tmp_path / "run"
    model, opt = build()
    guard = tg.Guard(model, opt, config=_config(every=2), run_dir=run_dir)
    assert guard.checkpointing is not None and not guard.checkpointing.defers  # on the host
    guard.checkpointing.defers = True  # as on a device
    decisions: dict[int, tg.Decision] = {}
    weights: dict[int, dict[str, torch.Tensor]] = {}
    data = loader()
    while guard.global_step < 9:
        for (tokens,) in guard.batches(data):
            if guard.global_step >= 9:
                break
            step = guard.global_step
            decisions[step] = _step(guard, model, tokens)
            weights[guard.global_step] = {k: v.clone() for k, v in model.state_dict().items()}
            if 1 <= step <= 5:  # the write of step 2 held from the step reaching 2
                assert holding.wait(60)
                assert not gate.is_set() and guard.checkpoints.writing  # returned at once
            if step >= 5:  # released at 6; each write then over before the next step
                gate.set()
                guard.checkpoints.wait()
    guard.close()
    said = [e for e in decisions[3].events if e.kind == "checkpoint"]  # the step reaching 4
    assert [(e.severity, e.metrics) for e in said] == [
        ("info", {"deferred_step": 4, "writing_step": 2})
    ]
    assert "deferred" in said[0].message and "step 2 is still being written" in said[0].message
    assert not [e for e in decisions[4].events if e.kind == "checkpoint"]  # said once
    (late,) = [e for e in decisions[5].events if e.kind == "checkpoint"]  # 6: a whole interval
    assert late.severity == "warning" and late.metrics["deferred_step"] == 4
    assert _steps_on_disk(run_dir) == [2, 7, 8]  # the deferred one at 7, the next one on time
    recorded = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "checkpoint"]
    assert [(e["step"], e["severity"]) for e in recorded] == [(4, "info"), (6, "warning")]
    _no_leftovers(run_dir)
    for step in (2, 7, 8):
        store = CheckpointStore(run_dir / "checkpoints")
        store.verify(run_dir / "checkpoints" / f"step-{step}")
    resumed, opt2 = build()
    guard = tg.Guard.resume(run_dir, resumed, opt2, config=_config(every=2))
    guard.close()
    assert guard.global_step == 8
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, weights[8][key]), key


def _held_at_step_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, tg.Guard, nn.Module, Any]:
    """A deferring guard whose write of step 2's checkpoint waits for the gate it returns; the
    gate, the guard, its model and an iterator over the data."""
    gate = threading.Event()
    original = BlobWriter.write_data

    def held(self: BlobWriter, plan: Any, planner: Any) -> Any:
        if self.step == 2:
            gate.wait(60)
        return original(self, plan, planner)

    monkeypatch.setattr(BlobWriter, "write_data", held)
    model, opt = build()
    guard = tg.Guard(model, opt, config=_config(every=2), run_dir=tmp_path)
    assert guard.checkpointing is not None
    guard.checkpointing.defers = True
    return gate, guard, model, iter(loader())


def test_an_explicit_save_and_close_still_wait(tmp_path, monkeypatch):
    """`guard.save_checkpoint()` by hand waits for the write still going on, then writes."""
    gate, guard, model, data = _held_at_step_2(tmp_path, monkeypatch)
    for _ in range(3):
        (tokens,) = next(data)
        _step(guard, model, tokens)
    assert guard.checkpoints.writing
    threading.Timer(0.2, gate.set).start()
    guard.save_checkpoint()  # step 3, once step 2 is written
    guard.close()
    assert _steps_on_disk(tmp_path) == [2, 3]


def test_a_checkpoint_still_deferred_at_close_is_written_then(tmp_path, monkeypatch):
    gate, guard, model, data = _held_at_step_2(tmp_path, monkeypatch)
    for _ in range(4):
        (tokens,) = next(data)
        decision = _step(guard, model, tokens)
    assert [e.metrics["deferred_step"] for e in decision.events if e.kind == "checkpoint"] == [4]
    gate.set()
    guard.close()
    assert _steps_on_disk(tmp_path) == [2, 4]
    _no_leftovers(tmp_path)


def test_without_blobs_the_writer_waits_for_the_staging_copy_too(tmp_path, monkeypatch):
    """With `dedup_checkpoints: false` DCP's own file writer, in the background, first waits for
    the staging copy (the stager's `wait_copied`), and the checkpoints resume."""
    from trainguard.actions.checkpoints import BufferStager

    waited: list[str] = []
    original = BufferStager.wait_copied

    def counted(self: BufferStager) -> None:
        waited.append(threading.current_thread().name)
        original(self)

    monkeypatch.setattr(BufferStager, "wait_copied", counted)
    model, opt = build()
    guard = tg.Guard(model, opt, config=_config(every=2, dedup_checkpoints=False), run_dir=tmp_path)
    data = iter(loader())
    for _ in range(4):
        (tokens,) = next(data)
        _step(guard, model, tokens)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    guard.close()
    assert len(waited) == 2 and threading.main_thread().name not in waited
    assert _steps_on_disk(tmp_path) == [2, 4]
    resumed, opt2 = build()
    guard = tg.Guard.resume(tmp_path, resumed, opt2, config=_config(every=2))
    guard.close()
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, live[key]), key


# -- 2. no device-wide sync ----------------------------------------------------------------------


def test_no_checkpoint_step_calls_torch_cuda_synchronize(tmp_path, monkeypatch):
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.cuda.synchronize on the checkpoint path")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    model, opt = build()
    guard = tg.Guard(model, opt, config=_config(every=2), run_dir=tmp_path)
    data = iter(loader())
    for _ in range(4):
        (tokens,) = next(data)
        _step(guard, model, tokens)
    guard.close()
    assert _steps_on_disk(tmp_path) == [2, 4]


def _calls_synchronize(tree: ast.AST) -> list[int]:
    """Lines that call `torch.cuda.synchronize` (or `cuda.synchronize`, or it imported bare)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = ast.unparse(func)
            if name in ("torch.cuda.synchronize", "cuda.synchronize", "synchronize"):
                lines.append(node.lineno)
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "torch.cuda"
            and any(alias.name == "synchronize" for alias in node.names)
        ):
            lines.append(node.lineno)
    return lines


def test_no_module_calls_torch_cuda_synchronize_on_the_step_path() -> None:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        lines = _calls_synchronize(ast.parse(path.read_text()))
        name = path.relative_to(SRC).as_posix()
        if lines:
            found[name] = lines
    assert not found, f"device-wide syncs: {found}"
    planted = ast.parse("import torch\ndef f():\n    torch.cuda.synchronize()\n")
    assert _calls_synchronize(planted) == [3]  # the check finds one


# -- 3. what is unchanged is neither copied nor hashed --------------------------------------------


def _frozen_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def _all_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    params = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state = sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return params + state


def _judged_by_version(guard: tg.Guard) -> None:
    """Judge every tensor as a device tensor is (by its version counter), here on the host."""
    store = guard.checkpoints
    assert store is not None
    store._stager.by_version = lambda tensor: True


def test_a_frozen_layer_is_neither_copied_nor_hashed_at_the_next_save(tmp_path):
    model, opt = build()
    guard = tg.Guard(model, opt, config=_config(every=2, asynchronous=False), run_dir=tmp_path)
    _judged_by_version(guard)
    store = guard.checkpoints
    assert store is not None
    data = iter(loader())
    figures, allocations = [], []
    for _ in range(4):
        (tokens,) = next(data)
        _step(guard, model, tokens)
        if guard.global_step % 2 == 0:
            figures.append((store.copied, store.written["hashed"], store.written["written"]))
            allocations.append(host_memory.COUNTS.allocations)
    total, frozen = _all_bytes(model, opt), _frozen_bytes(model)
    assert frozen > 0.7 * total
    (copied0, hashed0, _), (copied1, hashed1, written1) = figures
    assert copied0 >= total and hashed0 >= total  # the first save: everything
    # the second: the head, its moments and step counters, the random state; no frozen byte
    assert copied1 <= total - frozen + 6000 and hashed1 == copied1
    assert written1 <= copied1
    assert allocations[1] == allocations[0]  # the buffers of the first save, reused
    guard.close()


def test_a_buffer_a_kernel_updates_unseen_is_copied_at_every_save(tmp_path):
    """BatchNorm's running statistics change in each forward without a version bump: judged as
    device tensors are, they are copied at every save, and each checkpoint holds them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    guard = tg.Guard(model, opt, config=_config(every=2, asynchronous=False), run_dir=tmp_path)
    _judged_by_version(guard)
    store = guard.checkpoints
    assert store is not None
    stats = model[1].running_mean
    live = {}
    for i in range(4):
        version = stats._version
        loss = model(torch.randn(16, 4, generator=torch.Generator().manual_seed(i))).pow(2).mean()
        assert stats._version == version  # the forward changed it unseen
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
        live[guard.global_step] = stats.clone()
    guard.close()
    for step in (2, 4):
        path = tmp_path / "checkpoints" / f"step-{step}"
        tensors, _ = store.load(path, store.verify(path))
        assert torch.equal(tensors["model.1.running_mean"], live[step]), step
    assert not torch.equal(live[2], live[4])


class Divergence(Detector):
    """A stub detector saying the run diverged from `start` at step `at`: a rollback."""

    name = "planted"

    def __init__(self, at: int, start: int) -> None:
        self.at, self.start = at, start

    def update(self, point: Any) -> list[Event]:
        if point.step != self.at:
            return []
        window = {"window": point.step - self.start}
        return [Event(point.step, "divergence", "critical", "planted divergence", window)]


def test_a_weight_a_rollback_rewrites_unseen_is_copied_and_hashed_again(tmp_path, monkeypatch):
    """A frozen weight changed after the snapshot of step 3 and saved at step 4; a rollback to
    step 3 restores it through `.data` (whichever way it restores; no version counter sees it):
    the checkpoint of step 4
    written again after the rollback holds the restored weight, copied and hashed anew."""
    model, opt = build()
    cfg = _config(every=2, asynchronous=False, snapshot_every=1, snapshots=5, rollback_margin=0)
    guard = tg.Guard(model, opt, config=cfg, run_dir=tmp_path)
    guard.detectors.detectors.append(Divergence(at=5, start=3))
    _judged_by_version(guard)
    store = guard.checkpoints
    assert store is not None

    def unseen_restore(self: nn.Module, state: dict[str, Any], strict: bool = True) -> Any:
        for key, value in self.state_dict(keep_vars=True).items():
            value.data.copy_(state[key])  # the version counter sees none of it

    def unseen_copy(targets: list[Any], sources: list[Any], non_blocking: bool = False) -> None:
        for target, source in zip(targets, sources, strict=True):
            target.data.copy_(source)

    monkeypatch.setattr(Finetuned, "load_state_dict", unseen_restore)
    monkeypatch.setattr(snapshots, "foreach_copy_", unseen_copy)  # a restore in place
    frozen = model.encoder[0].linear1.weight
    data = loader()
    actions: list[str] = []
    restored = None
    while len(actions) < 7:
        for (tokens,) in guard.batches(data):
            if len(actions) >= 7:
                break
            actions.append(_step(guard, model, tokens).action)
            if guard.global_step == 3 and restored is None:  # after the snapshot of step 3
                restored = frozen.detach().clone()
                with torch.no_grad():
                    frozen.add_(1.0)
    monkeypatch.undo()
    assert actions[5] == "rollback"
    assert restored is not None and torch.equal(frozen, restored)  # the rollback put it back
    copied_after = store.copied  # the last save: step 4 again, after the rollback
    assert guard.global_step == 4 and copied_after >= _all_bytes(model, opt)
    guard.close()
    path = tmp_path / "checkpoints" / "step-4"
    tensors, _ = store.load(path, store.verify(path))
    assert torch.equal(tensors["model.encoder.0.linear1.weight"], restored)


# -- 4. every rank defers together -----------------------------------------------------------------


@pytest.mark.timeout(180)  # ranks that disagree hang in DCP's collectives: fail instead
def test_every_rank_defers_while_one_ranks_writer_is_slow_then_all_save_together(tmp_path):
    results = launch("slow_writer", 2, tmp_path)
    assert [r["busy_at_4"] for r in results] == [True, False]  # rank 1 defers by agreement
    assert results[0]["saved_at"] == results[1]["saved_at"]
    assert results[0]["saved_at"] == [2, 7, 8]  # 4 and 6 fell due while rank 0 still wrote 2
    for r in results:
        assert r["deferred"] == [[4, "info"], [6, "warning"]]
    assert _steps_on_disk(tmp_path) == [2, 7, 8]
    _no_leftovers(tmp_path)
    for step in (2, 7, 8):
        CheckpointStore(tmp_path / "checkpoints").verify(tmp_path / "checkpoints" / f"step-{step}")
