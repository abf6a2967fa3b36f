"""`trace_nonfinite`: run a step with every module and op watched, and name the first one that
turned finite inputs into NaN/Inf, in the forward or the backward pass."""

from __future__ import annotations

import math
import os
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Direction = Literal["forward", "backward", "parameter"]
MAX_RECORDS = 4096
FRAMES = 20


@dataclass
class TensorStats:
    """Abs-max, abs-min (of finite values) and non-finite count of some tensors, and the dtype
    headroom absmax / finfo.max (near 1: overflow is close)."""

    absmax: float
    absmin: float
    nonfinite: int
    dtype: str
    headroom: float

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> TensorStats | None:
        data = [t.detach() for t in tensors if t.numel()]
        if not data:
            return None
        finite = [t[torch.isfinite(t)].abs() for t in data]
        absmax = max((float(t.max()) for t in finite if t.numel()), default=math.nan)
        absmin = min((float(t.min()) for t in finite if t.numel()), default=math.nan)
        dtype = data[0].dtype
        return cls(
            absmax=absmax,
            absmin=absmin,
            nonfinite=sum(int((~torch.isfinite(t)).sum()) for t in data),
            dtype=str(dtype).replace("torch.", ""),
            headroom=absmax / torch.finfo(dtype).max if math.isfinite(absmax) else math.nan,
        )


@dataclass
class ModuleRecord:
    """What one module saw in one pass: its outputs, inputs and own parameters in the forward;
    the gradients with respect to its outputs and its inputs in the backward."""

    module: str
    module_type: str
    direction: Direction
    outputs: TensorStats
    inputs: TensorStats | None = None
    parameters: TensorStats | None = None

    @property
    def absmax(self) -> float:
        return self.outputs.absmax

    @property
    def nonfinite(self) -> int:
        return self.outputs.nonfinite

    @property
    def headroom(self) -> float:
        return self.outputs.headroom


@dataclass
class NonFiniteOrigin:
    """The first module (and op inside it) whose output became non-finite from finite inputs."""

    module: str
    module_type: str
    direction: Direction
    op: str | None
    hint: str
    frames: list[str] = field(default_factory=list)
    input_absmax: float | None = None
    dtype: str | None = None

    def describe(self) -> str:
        where = f"{self.module or '(top level)'} ({self.module_type})"
        op = f", op {self.op}" if self.op else ""
        return f"NaN/Inf first appeared in {self.direction} of {where}{op}: {self.hint}"


@dataclass
class NonFiniteReport:
    """The origin, or none when the replay stayed finite (a transient fault), and the records."""

    origin: NonFiniteOrigin | None
    records: list[ModuleRecord] = field(default_factory=list)

    @property
    def transient(self) -> bool:
        return self.origin is None

    def describe(self) -> str:
        if self.origin is None:
            return (
                "the replayed step stayed finite: a transient fault (non-determinism, or a "
                "hardware error worth checking if it recurs)"
            )
        return self.origin.describe()


def _floats(values: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(values)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())


def _absmax(tensors: list[torch.Tensor]) -> float:
    finite = [t.detach().abs().nan_to_num(0.0, 0.0, 0.0).max() for t in tensors if t.numel()]
    return max((float(v) for v in finite), default=0.0)


def _hint(op: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> str:
    name = op.split(".")[1] if op.startswith("aten.") else op
    dtype = outputs[0].dtype if outputs else None
    if dtype in (torch.float16, torch.bfloat16):
        limit = torch.finfo(dtype).max
        if any(bool(torch.isinf(t).any()) for t in outputs):
            return (
                f"{dtype} overflow: a value passed {limit:.6g}; compute this in fp32 or scale down"
            )
    if name.startswith("log"):
        return "log of zero or of a negative number; clamp the argument (e.g. x.clamp_min(eps))"
    if name.startswith("div") or name == "reciprocal":
        return "division by zero (a zero variance or norm?); add an epsilon to the denominator"
    if name.startswith("sqrt") or name.startswith("rsqrt"):
        return "sqrt of a negative number, or its gradient at 0; add an epsilon inside the sqrt"
    if name.startswith("pow"):
        return "pow of a negative base or a zero with a negative exponent"
    if "softmax" in name:
        return "softmax over a row that is all -inf (a fully masked row?)"
    if name in ("exp", "expm1"):
        return "exp overflow: the argument is too large; subtract the max first"
    if any(bool(torch.isinf(t).any()) for t in outputs):
        return "an overflow to Inf"
    return "an operation produced NaN from finite inputs"


class _Watch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Checks every op: the first whose output is non-finite while its inputs are finite."""

    def __init__(self, state: _TraceState) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.state = state

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        state = self.state
        if state.origin is None:
            outputs = _floats(out)
            if outputs and not _all_finite(outputs):
                inputs = _floats((args, kwargs))
                if _all_finite(inputs):
                    state.found_op(str(func), inputs, outputs)
        return out


@dataclass
class _TraceState:
    direction: Direction = "forward"
    stack: list[tuple[str, str]] = field(default_factory=list)
    origin: NonFiniteOrigin | None = None
    records: list[ModuleRecord] = field(default_factory=list)

    def current(self) -> tuple[str, str]:
        return self.stack[-1] if self.stack else ("", "(top level)")

    def found_op(self, op: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        module, module_type = self.current()
        name = op if op.startswith("aten.") else f"aten.{op}"
        hint = _hint(name, inputs, outputs)
        if self.direction == "backward":
            node = torch._C._current_autograd_node()
            if node is not None:  # the backward of which forward op: SqrtBackward0 -> sqrt
                forward_op = node.name().removesuffix("Backward0").removesuffix("Backward1")
                name = f"{name} in {node.name()}"
                hint = "in the gradient of " + _hint(f"aten.{forward_op.lower()}", inputs, outputs)
        frames = [
            f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
            for f in traceback.extract_stack()
            if f"{os.sep}torch{os.sep}" not in f.filename and f.filename != __file__
        ][-FRAMES:]
        self.origin = NonFiniteOrigin(
            module=module,
            module_type=module_type,
            direction=self.direction,
            op=name,
            hint=hint,
            frames=frames,
            input_absmax=_absmax(inputs),
            dtype=str(outputs[0].dtype).replace("torch.", ""),
        )

    def record(
        self,
        name: str,
        module: nn.Module,
        produced: list[torch.Tensor],
        received: list[torch.Tensor],
    ) -> None:
        if len(self.records) >= MAX_RECORDS:
            return
        outputs = TensorStats.of(produced)
        if outputs is None:
            return
        params: list[torch.Tensor] = [
            p for p in module.parameters(recurse=False) if p.is_floating_point()
        ]
        self.records.append(
            ModuleRecord(
                module=name,
                module_type=type(module).__name__,
                direction=self.direction,
                outputs=outputs,
                inputs=TensorStats.of(received),
                parameters=TensorStats.of(params) if self.direction == "forward" else None,
            )
        )


def trace_nonfinite(model: nn.Module, fn: Callable[[], torch.Tensor]) -> NonFiniteReport:
    """Run `loss = fn()` and `loss.backward()` with every module and op of `model` watched; say
    where NaN/Inf first appeared. Slow (a host sync per op): for replaying one failing step."""
    state = _TraceState()
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param.detach()).all()):
            owner = name.rsplit(".", 1)[0] if "." in name else ""
            module = model.get_submodule(owner) if owner else model
            state.origin = NonFiniteOrigin(
                module=owner,
                module_type=type(module).__name__,
                direction="parameter",
                op=None,
                hint=f"the parameter {name} itself holds NaN/Inf (a bad update, or a corrupt "
                "checkpoint); restore a known-good state",
            )
            return NonFiniteReport(state.origin)

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(_push(state, name, module)))
        handles.append(module.register_forward_hook(_pop(state, name, module)))
        handles.append(module.register_full_backward_pre_hook(_push(state, name, module)))
        handles.append(module.register_full_backward_hook(_pop(state, name, module)))
    try:
        with _Watch(state):
            loss = fn()
            state.stack.clear()
            state.direction = "backward"
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                with warnings.catch_warnings():  # hooks on modules whose inputs need no grad
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    loss.backward()  # type: ignore[no-untyped-call]
    finally:
        for handle in handles:
            handle.remove()
    return NonFiniteReport(state.origin, state.records)


def _push(state: _TraceState, name: str, module: nn.Module) -> Callable[..., None]:
    def hook(*args: Any) -> None:
        state.stack.append((name, type(module).__name__))

    return hook


def _pop(state: _TraceState, name: str, module: nn.Module) -> Callable[..., None]:
    def hook(mod: nn.Module, first: Any, second: Any) -> None:
        # forward hooks get (inputs, outputs), full backward hooks (grad_input, grad_output):
        # either way the second is about the module's outputs
        state.record(name, module, _floats(second), _floats(first))
        if state.stack and state.stack[-1][0] == name:
            state.stack.pop()

    return hook
