"""Host reads and host-to-device copies on the step path, counted on a CPU that stands in for a
device (`fake_device`): the harness itself, the one read an ordinary step makes today, the
distributed exchange's figures sent from pinned buffers, and every hot-path read through
`trainguard.signals.host_reads`."""

from __future__ import annotations

import ast
import gc
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fake_device
import trainguard as tg
from fake_device import (
    SyncForbidden,
    UploadForbidden,
    count_host_reads,
    count_uploads,
    forbid_syncs,
    is_host,
    mark_host,
    mark_optimizer_steps,
    unmark_host,
)
from test_distributed import launch
from trainguard.distributed.upload import FigureUpload
from trainguard.signals import host_reads
from trainguard.signals.host_reads import COUNTS, read_now, reads_counted

SRC = Path(tg.__file__).parent


# -- the harness ---------------------------------------------------------------------------------


def test_the_harness_counts_each_kind_of_host_read():
    t = torch.tensor([1.0, 0.0, 2.0])
    with count_host_reads() as reads:
        t[0].item()
        float(t[1])
        int(t[2])
        bool(t[0])
        if t.any():  # a bool of a device tensor
            pass
        t.tolist()
        t.numpy()
        t.nonzero()
        t[t > 0]  # a bool mask: a nonzero inside
        torch.equal(t, t)
    assert dict(reads.by_kind) == {
        "item": 5,
        "tolist": 1,
        "numpy": 1,
        "nonzero": 1,
        "bool_index": 1,
        "equal": 1,
    }
    assert reads.total == 10 and reads.skipped == 0
    reads.reset()
    assert reads.total == 0
    t.tolist()  # outside the block: not counted, and tolist is torch's own again
    assert reads.total == 0 and torch.Tensor.tolist.__qualname__ != "counted_tolist"


def test_the_harness_leaves_out_reads_of_marked_host_tensors_and_their_views():
    slot = mark_host(torch.zeros(8))  # a pinned slot a lagged reader fills
    device = torch.ones(3)
    assert is_host(slot) and is_host(slot[2:4]) and not is_host(device)
    with count_host_reads(stacks=True) as reads:
        slot.tolist()
        slot[:4].tolist()
        float(slot[5])
        device.tolist()
    assert reads.total == 1 and reads.skipped == 3
    assert reads.stacks is not None and "device.tolist()" in reads.stacks[0]
    unmark_host(slot)
    with count_host_reads() as reads:
        slot.tolist()
    assert reads.total == 1


def test_a_mark_ends_with_its_tensor():
    slot = mark_host(torch.zeros(4))
    address = slot.untyped_storage().data_ptr()
    del slot
    gc.collect()
    again = torch.zeros(4)  # the address may come back, for a tensor nobody marked
    assert address not in fake_device._HOST and not is_host(again)


def test_forbid_syncs_raises_on_every_synchronize_and_restores_them():
    original = torch.cuda.synchronize, torch.cuda.Stream.synchronize
    with forbid_syncs() as syncs:
        with pytest.raises(SyncForbidden):
            torch.cuda.synchronize()
        with pytest.raises(SyncForbidden):
            torch.cuda.Stream.synchronize(object())  # what current_stream().synchronize calls
        if hasattr(torch, "accelerator"):
            with pytest.raises(SyncForbidden):
                torch.accelerator.synchronize()
    assert syncs.total == 3 if hasattr(torch, "accelerator") else 2
    assert (torch.cuda.synchronize, torch.cuda.Stream.synchronize) == original


def test_count_uploads_counts_tensors_built_with_a_device_from_the_library_only():
    with count_uploads(only_from=None) as everyone:
        torch.tensor([1.0], device="cpu")
        torch.as_tensor([1.0], device="cpu")
        torch.tensor([1.0])  # built on the host: no copy
    assert everyone.total == 2
    with count_uploads() as ours:
        torch.tensor([1.0], device="cpu")  # this test module is not trainguard
    assert ours.total == 0
    with count_uploads(raise_on_upload=True, only_from=None), pytest.raises(UploadForbidden):
        torch.tensor(0.0, device="cpu")


def test_read_now_reads_flat_exact_and_counts():
    before = COUNTS["now"]
    with reads_counted() as made:
        assert read_now(torch.tensor([[1.5, -math.inf], [math.nan, 2.0]]))[:2] == [1.5, -math.inf]
        big = 2**61 - 1  # int64 stays exact: no float conversion
        assert read_now(torch.tensor([big, 3])) == [big, 3]
        assert read_now(torch.tensor(0.25)) == [0.25]
    assert made == {"now": 3} and COUNTS["now"] == before + 3
    host_reads.reset_counts()
    assert COUNTS["now"] == 0


# -- the guard's step ----------------------------------------------------------------------------


def test_an_ordinary_guard_step_makes_one_host_read_no_upload_and_no_sync():
    """Today's sync path: one read a step (`GradientStats.resolve`, the packed figures), which
    the lagged path is to take off the ordinary step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False))
    x = torch.randn(4, 8)
    seen: list[tuple[Any, ...]] = []
    for step in range(12):
        loss = model(x).pow(2).mean()
        loss.backward()
        with (
            count_host_reads(stacks=True) as reads,
            reads_counted() as now,
            count_uploads(raise_on_upload=True),
            forbid_syncs(),
        ):
            decision = guard.step(loss)
        opt.zero_grad()
        if step == 0:
            assert mark_optimizer_steps(opt) == 4  # AdamW's step counts: host state
            continue
        seen.append((decision.action, dict(reads.by_kind), now["now"]))
        assert reads.total == 1, reads.stacks
    guard.close()
    assert seen == [("step", {"tolist": 1}, 1)] * 11


def test_the_float_loss_and_the_clipper_threshold_are_filled_on_the_device():
    from trainguard.fixes import AdaptiveClipper

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False))
    model(torch.randn(2, 4)).sum().backward()
    with count_uploads(raise_on_upload=True):
        guard.step(0.5)  # a Python float loss
        AdaptiveClipper(max_norm=3).clip_(model.parameters())
    guard.close()


# -- the distributed exchange ------------------------------------------------------------------


class _FakeEvent:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("wait")


class _StagedOnCpu(FigureUpload):
    """The CUDA path on a CPU: plain buffers for pinned ones, events that log their waits."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), torch.float64)
        self.staged = True
        self.log: list[str] = []
        self.buffers: list[torch.Tensor] = []

    def _new_buffer(self, n: int) -> torch.Tensor:
        self.buffers.append(torch.empty(n, dtype=self.dtype))
        return self.buffers[-1]

    def _record(self) -> Any:
        return _FakeEvent(self.log)


def test_figures_go_through_two_buffers_allocated_once_each_waited_on_by_its_event():
    upload = _StagedOnCpu()
    runs = [[1.0, 2.0, math.nan], [3.0, -math.inf, 0.1], [5.0, 6.0, 7.0], [8.0, 9.0]]
    with count_uploads(raise_on_upload=True):
        out = [upload.send(figures) for figures in runs]
    for got, figures in zip(out, runs, strict=True):  # the same bits as torch.tensor made
        assert torch.equal(
            got.view(torch.int64), torch.tensor(figures, dtype=torch.float64).view(torch.int64)
        )
    assert upload.allocations == 2 and len(upload.buffers) == 2
    # each buffer waited on its own event before it is written again, two sends later
    assert upload.log == ["record", "record", "wait", "record", "wait", "record"]
    assert upload.waits == 2
    upload.send([0.0] * 10)  # more figures: that buffer grows, with no wait on the old one
    assert upload.allocations == 3 and upload.log[-1] == "record"
    assert out[0].data_ptr() != out[2].data_ptr()  # each send a tensor of its own


def test_on_a_cpu_the_figures_are_the_tensor_torch_tensor_made():
    upload = FigureUpload(torch.device("cpu"), torch.float32)
    figures = [0.1, 1e-40, math.inf, 3.0]
    got = upload.send(figures)
    want = torch.tensor(figures, device="cpu")
    assert got.dtype == want.dtype and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert upload.allocations == 0  # nothing pinned without CUDA


def test_a_distributed_step_sends_its_figures_pinned_and_reads_once(tmp_path):
    """2 gloo ranks, DDP TinyGPT, the `reduce` exchange, precursors every 4 steps: no trainguard
    `torch.tensor(..., device=...)` on any step after the first, the exchange's figures through
    `FigureUpload` once a step, and one host read a step (sampled steps too)."""
    results = launch("host_reads", 2, tmp_path)
    for result in results:
        steps = result["steps"]
        assert [s["action"] for s in steps] == ["step"] * 9
        assert [s["precursors"] for s in steps] == [i % 4 == 0 for i in range(9)]
        assert all(s["uploads"] == [] for s in steps), [s["uploads"] for s in steps]
        assert all(s["sent"] == 1 and s["read_now"] == 1 for s in steps)
        assert all(s["reads"] == {"tolist": 1} for s in steps[1:]), [s["reads"] for s in steps]


# -- every hot-path read through the helper --------------------------------------------------------

_HOT = {  # module -> the functions an ordinary step runs
    "guard.py": {
        "step",
        "_step_with",
        "_measure_step",
        "_judge",
        "_step_lagged",
        "_judge_launched",
        "_take_precursors",
        "_check_replicas",
    },
    "signals/gradients.py": {
        "measure",
        "resolve",
        "gate_flag",
        "_norms",
        "_loss_tensor",
        "_scaler_state",
    },
    "signals/lagged_reads.py": {"copy", "read"},
    "distributed/reduce.py": {"share", "_straggler", "add_rank_figures", "_name"},
    "distributed/exchange.py": {"share", "gather", "add_rank_figures"},
    "signals/precursors.py": {
        "take",
        "_measure",
        "_measure_mha",
        "_query_positions",
        "attention_figures",
        "token_accuracy",
        "agree_over_ranks",
        "reduce_rows",
        "measure",
        "_layout",
    },
    "monitor.py": {"_decide", "_publish", "_as_float", "_evaluation_number"},
}
_READS = {"item", "tolist", "numpy", "cpu", "nonzero"}


def _reads_in(path: Path, functions: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    found: list[str] = []
    seen: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            seen.add(node.name)
            for call in ast.walk(node):
                if not isinstance(call, ast.Call):
                    continue
                func = call.func
                if isinstance(func, ast.Attribute) and func.attr in _READS:
                    found.append(f"{path.name}:{call.lineno} .{func.attr}()")
                if (  # float(x)/int(x)/bool(x) of a tensor-looking expression
                    isinstance(func, ast.Name)
                    and func.id in {"float", "int", "bool"}
                    and call.args
                    and isinstance(call.args[0], ast.Subscript | ast.Call)
                    and "tensor" in ast.unparse(call.args[0]).lower()
                ):
                    found.append(f"{path.name}:{call.lineno} {ast.unparse(call)}")
                if (
                    isinstance(func, ast.Attribute)
                    and func.attr in {"tensor", "as_tensor"}
                    and any(k.arg == "device" for k in call.keywords)
                ):
                    found.append(f"{path.name}:{call.lineno} torch.{func.attr}(device=...)")
    assert seen == functions, f"{path}: {functions - seen} not found (renamed?)"
    return found


def test_hot_path_functions_read_the_host_only_through_host_reads():
    found = [r for module, fns in _HOT.items() for r in _reads_in(SRC / module, fns)]
    assert found == []


def test_the_ast_check_sees_a_read(tmp_path):
    path = tmp_path / "hot.py"
    path.write_text("def resolve(m):\n    return m.packed.tolist() + [float(m.tensor[0])]\n")
    assert len(_reads_in(path, {"resolve"})) == 2
