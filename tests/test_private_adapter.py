"""`trainguard._torch_private` against the installed torch: each private use it holds, exercised
for real, with the torch release it is checked against pinned. An upgrade that moves, renames or
changes one fails here, naming the adapter's function; a new torch release fails the pin until
these checks have run on it and `SUPPORTED_TORCH` names it."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from trainguard import _torch_private as tp
from trainguard.actions.checkpoint_files import read_metadata

SUPPORTED_TORCH = ("2.13",)  # release series the adapter is checked against


def _series(version: str) -> str:
    match = re.match(r"(\d+)\.(\d+)", version)
    assert match is not None, version
    return f"{match.group(1)}.{match.group(2)}"


def test_torch_release_is_one_the_adapter_supports() -> None:
    series = _series(torch.__version__)
    assert series in SUPPORTED_TORCH, (
        f"trainguard._torch_private is checked against torch {', '.join(SUPPORTED_TORCH)}; "
        f"torch {torch.__version__} is installed: run this file on it, fix any function that "
        "fails, then add its series to SUPPORTED_TORCH"
    )


def _grads() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen) * 4]


def test_foreach_norm() -> None:
    tensors = [*_grads(), torch.randn(6).to(torch.bfloat16)]
    norms = tp.foreach_norm(tensors)
    expected = [torch.linalg.vector_norm(t) for t in tensors]
    assert len(norms) == 3, "foreach_norm: one norm a tensor"
    for got, want in zip(norms, expected, strict=True):
        assert got.dtype == want.dtype and torch.allclose(got.float(), want.float()), "foreach_norm"
    as_float = tp.foreach_norm(tensors, torch.float32)
    assert all(n.dtype == torch.float32 for n in as_float), "foreach_norm: dtype not honoured"
    l1 = tp.foreach_norm(tensors, torch.float32, ord=1)
    for got, t in zip(l1, tensors, strict=True):
        assert torch.allclose(got, t.float().abs().sum()), "foreach_norm: ord=1 not honoured"


def test_foreach_mul_sub_clone_copy() -> None:
    grads = _grads()
    before = [g.clone() for g in grads]
    tp.foreach_mul_(grads, torch.tensor(0.5))
    assert all(torch.equal(g, b * 0.5) for g, b in zip(grads, before, strict=True)), "foreach_mul_"
    tp.foreach_mul_(grads, [torch.tensor(2.0), torch.tensor(4.0)])
    assert torch.equal(grads[0], before[0]) and torch.equal(grads[1], before[1] * 2), (
        "foreach_mul_: one factor a tensor"
    )
    tp.foreach_mul_(grads, [0.5, 0.25])
    assert torch.equal(grads[0], before[0] * 0.5) and torch.equal(grads[1], before[1] * 0.5), (
        "foreach_mul_: one host float a tensor"
    )
    tp.foreach_mul_(grads, [2.0, 2.0])
    copies = tp.foreach_clone(grads)
    assert all(torch.equal(c, g) for c, g in zip(copies, grads, strict=True)), "foreach_clone"
    assert all(c.data_ptr() != g.data_ptr() for c, g in zip(copies, grads, strict=True)), (
        "foreach_clone: shares memory"
    )
    tp.foreach_sub_(copies, grads)
    assert all(not c.any() for c in copies), "foreach_sub_"
    targets = [torch.empty_like(g) for g in grads]
    tp.foreach_copy_(targets, grads, non_blocking=True)
    assert all(torch.equal(t, g) for t, g in zip(targets, grads, strict=True)), "foreach_copy_"


def test_scaler_scale_and_found_inf() -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scale = tp.scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor), "scaler_scale: no device tensor"
    assert float(scale) == scaler.get_scale() == 1024.0, "scaler_scale: not the scale"
    assert model.weight.grad is not None
    model.weight.grad[0, 0] = float("inf")
    scaler.unscale_(optimizer)
    found = tp.scaler_found_inf(scaler, optimizer)
    assert found and sum(float(t) for t in found.values()) == 1.0, "scaler_found_inf: no inf"
    scaler.step(optimizer)
    scaler.update()
    assert tp.scaler_found_inf(scaler, optimizer) == {}, "scaler_found_inf: after update"


def _replaced_step_warnings(mark: bool) -> list[str]:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)

    def step(*args: Any, **kwargs: Any) -> None:  # taken elsewhere, or skipped
        if mark:
            tp.mark_optimizer_stepped(optimizer)

    if mark:
        tp.mark_step_wrapped(step)
    optimizer.step = step  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
        scheduler.step()
    return [str(w.message) for w in caught]


def test_found_inf_skips_a_fused_optimizer_on_the_device() -> None:
    gen = torch.Generator().manual_seed(1)
    param = nn.Parameter(torch.randn(8, generator=gen))
    fused = torch.optim.AdamW([param], lr=0.1, fused=True)
    assert tp.optimizer_takes_found_inf(fused), "optimizer_takes_found_inf: fused AdamW"
    plain = torch.optim.AdamW([nn.Parameter(torch.randn(2))], lr=0.1, foreach=True)
    assert not tp.optimizer_takes_found_inf(plain), "optimizer_takes_found_inf: foreach AdamW"
    param.grad = torch.randn(8, generator=gen)
    fused.step()  # the state exists
    before = (param.detach().clone(), {k: v.clone() for k, v in fused.state[param].items()})
    tp.set_found_inf(fused, torch.ones((), dtype=torch.float32))
    fused.step()
    assert torch.equal(param.detach(), before[0]), "set_found_inf: 1 did not skip the update"
    for key, value in fused.state[param].items():
        assert torch.equal(value, before[1][key]), f"set_found_inf: 1 changed {key}"
    tp.set_found_inf(fused, torch.zeros((), dtype=torch.float32))
    fused.step()
    assert not torch.equal(param.detach(), before[0]), "set_found_inf: 0 skipped the update"
    tp.set_found_inf(fused, None)
    assert not hasattr(fused, "found_inf") and not hasattr(fused, "grad_scale"), "cleared"


def test_scheduler_step_marks() -> None:
    unmarked = _replaced_step_warnings(mark=False)
    assert any("overridden" in m for m in unmarked), (
        "mark_step_wrapped/mark_optimizer_stepped: torch's LR scheduler no longer checks a "
        "replaced optimizer.step; the marks may be dropped"
    )
    marked = _replaced_step_warnings(mark=True)
    assert not marked, f"mark_step_wrapped/mark_optimizer_stepped no longer quiet it: {marked}"


class _Nodes(tp.TorchDispatchMode):  # type: ignore[misc]
    """Records the autograd node around every op."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        node = tp.current_autograd_node()
        if node is not None:
            self.nodes.append(node.name())
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_and_current_autograd_node() -> None:
    x = torch.rand(4, requires_grad=True)
    with _Nodes() as mode:
        y = x.sqrt().sum()
        assert not mode.nodes, "current_autograd_node: a node outside backward"
        y.backward()
    assert "SqrtBackward0" in mode.nodes, f"TorchDispatchMode/current_autograd_node: {mode.nodes}"
    assert tp.current_autograd_node() is None, "current_autograd_node"


def test_tensor_version() -> None:
    weight = nn.Linear(2, 2).weight
    before = tp.tensor_version(weight)
    with torch.no_grad():
        weight.mul_(2.0)
    assert tp.tensor_version(weight) == before + 1, "tensor_version: an in-place write not counted"
    detached = weight.detach()  # a state dict's tensor shares the counter of its parameter
    with torch.no_grad():
        detached.add_(1.0)
    assert tp.tensor_version(weight) == before + 2, "tensor_version: not shared with .detach()"
    weight.data.mul_(2.0)
    assert tp.tensor_version(weight) == before + 2, (
        "tensor_version: a .data write is now counted; the checkpoint stager's forget_all calls "
        "could be dropped"
    )


def test_compiled_original() -> None:
    model = nn.Linear(2, 2)
    assert tp.compiled_original(torch.compile(model)) is model, "compiled_original"
    assert tp.compiled_original(model) is None, "compiled_original: a plain module"


def test_dcp_storage_info(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process: DCP says so
        dcp.save({"w": torch.ones(3), "b": torch.zeros(2)}, checkpoint_id=tmp_path)
    metadata = FileSystemReader(tmp_path).read_metadata()
    kinds = {type(v) for v in metadata.storage_data.values()}
    assert kinds == {tp.DcpStorageInfo}, f"DcpStorageInfo: DCP's storage entries are {kinds}"
    checked = read_metadata(tmp_path)  # the allow-list of what DCP's metadata pickle names
    assert set(checked.state_dict_metadata) == {"w", "b"}, "DcpStorageInfo: read_metadata"


@pytest.mark.parametrize("name", tp.__all__)
def test_every_adapter_name_is_exercised(name: str) -> None:
    source = Path(__file__).read_text()
    assert f"tp.{name}" in source, f"{name} of trainguard._torch_private has no check here"
