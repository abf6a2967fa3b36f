"""`trace_nonfinite`: run a step with every module and op watched, and name the first one that
turned finite inputs into NaN/Inf, in the forward or the backward pass; or the batch itself,
when the model's inputs (or a tensor the loss reads, such as the targets) already hold NaN/Inf."""

from __future__ import annotations

import inspect
import math
import os
import sysconfig
import traceback
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from trainguard._torch_private import TorchDispatchMode, compiled_original, current_autograd_node

Direction = Literal["forward", "backward", "parameter", "input"]
MAX_RECORDS = 4096
FRAMES = 20
MAX_SAMPLES = 1024  # sample indices kept per bad input
SHOWN_SAMPLES = 10  # of those, named in the message
MAX_DEPTH = 4  # nesting of dicts, lists and tuples walked in the model's inputs


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
class NonFiniteInput:
    """A tensor the step read that already held NaN/Inf before any op made it: a forward input
    of the model (`role` "input", named by the forward's signature, `x` or `batch['pixels']`),
    or another tensor an op read (`role` "external": the targets of a loss computed outside the
    model, a buffer, a tensor attribute), with the op and module that read it. `samples` are the
    indices along dim 0 that hold NaN/Inf."""

    name: str
    role: Literal["input", "external"]
    samples: list[int]
    nan: int
    inf: int
    shape: list[int]
    dtype: str
    op: str | None = None
    module: str | None = None

    @classmethod
    def of(
        cls, tensor: torch.Tensor, name: str, role: Literal["input", "external"]
    ) -> NonFiniteInput:
        data = tensor.detach()
        bad = ~torch.isfinite(data)
        rows = bad.reshape(bad.shape[0], -1).any(1) if data.dim() else bad.reshape(1)
        samples = rows.nonzero().flatten()[:MAX_SAMPLES].tolist() if data.dim() else []
        return cls(
            name=name,
            role=role,
            samples=[int(i) for i in samples],
            nan=int(torch.isnan(data).sum()),
            inf=int(torch.isinf(data).sum()),
            shape=list(data.shape),
            dtype=str(data.dtype).replace("torch.", ""),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        shown = ", ".join(str(i) for i in self.samples[:SHOWN_SAMPLES])
        if len(self.samples) > SHOWN_SAMPLES:
            shown += f", ... ({len(self.samples)} in all)"
        if self.samples:
            where = f"sample{'s' if len(self.samples) > 1 else ''} {shown}"
        else:
            where = "a scalar" if not self.shape else "no sample"
        if self.role == "input":
            return f"input `{self.name}` ({where})"
        inside = f" in {self.module}" if self.module else " outside the model (the targets?)"
        return f"{self.name} read by {self.op}{inside} ({where})"


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
        if self.direction == "input":
            return self.hint
        where = f"{self.module or '(top level)'} ({self.module_type})"
        op = f", op {self.op}" if self.op else ""
        return f"NaN/Inf first appeared in {self.direction} of {where}{op}: {self.hint}"


@dataclass
class NonFiniteReport:
    """The origin, or none when the replay stayed finite (a transient fault), and the records;
    `inputs`, the tensors of the batch that held NaN/Inf, when the batch was the origin."""

    origin: NonFiniteOrigin | None
    records: list[ModuleRecord] = field(default_factory=list)
    inputs: list[NonFiniteInput] = field(default_factory=list)

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


def _op_tensors(values: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results: nested lists, tuples and dicts walked."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, dict):
        values = list(values.values())
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _op_tensors(v)]
    return []


def _floats(values: Any) -> list[torch.Tensor]:
    return [t for t in _op_tensors(values) if t.is_floating_point()]


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())


def _any_nan(tensors: list[torch.Tensor]) -> bool:
    return any(bool(torch.isnan(t).any()) for t in tensors if t.numel())


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


UNINITIALIZED = ("aten.empty", "aten.new_empty")  # ops whose output memory is not yet written


class _Watch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Checks every op: the first whose output is non-finite while its inputs are finite."""

    def __init__(self, state: _TraceState) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.state = state

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        state = self.state
        if str(func).startswith(UNINITIALIZED):  # garbage until written: nothing to judge
            state.made_here(out)
            return out
        if state.origin is None and not state.paused:
            outputs = _floats(out)
            if outputs and not _all_finite(outputs):
                inputs = _floats((args, kwargs))
                if not inputs and not _any_nan(outputs):
                    pass  # an infinite constant made from nothing: an attention mask's -inf
                elif _all_finite(inputs):
                    state.found_op(str(func), inputs, outputs)
                elif state.direction == "forward":
                    state.found_external(str(func), inputs)
            if state.direction == "forward":
                state.made_here(out)
        return out


class _BatchHoldsNonFinite(Exception):
    """Stops the replay: the batch itself holds NaN/Inf, so nothing after it needs tracing."""


@dataclass
class _TraceState:
    direction: Direction = "forward"
    stack: list[tuple[str, str]] = field(default_factory=list)
    origin: NonFiniteOrigin | None = None
    records: list[ModuleRecord] = field(default_factory=list)
    inputs: list[NonFiniteInput] = field(default_factory=list)
    made: dict[int, weakref.ref[torch.Tensor]] = field(default_factory=dict)
    buffers: dict[int, str] = field(default_factory=dict)
    model_type: str = ""
    paused: bool = False  # the trace's own checks run unwatched

    def current(self) -> tuple[str, str]:
        return self.stack[-1] if self.stack else ("", "(top level)")

    def made_here(self, out: Any) -> None:
        """Remember the tensors an op of the replay produced: any other is from outside."""
        for t in _op_tensors(out):
            self.made[id(t)] = weakref.ref(t)

    def is_made(self, tensor: torch.Tensor) -> bool:
        ref = self.made.get(id(tensor))
        return ref is not None and ref() is tensor

    def found_inputs(self, bad: list[NonFiniteInput], absmax: float) -> None:
        """The model's forward inputs (or a tensor from outside the step) hold NaN/Inf."""
        self.inputs = bad
        listed = " and ".join(b.describe() for b in bad)
        self.origin = NonFiniteOrigin(
            module=bad[0].module or "",
            module_type=self.model_type,
            direction="input",
            op=bad[0].op,
            hint=f"the batch holds NaN/Inf in {listed}: the data, not the model; check the data "
            "pipeline (loading, augmentation, normalisation)"
            + (" for these samples" if any(b.samples for b in bad) else ""),
            frames=_user_frames(),
            input_absmax=absmax,
            dtype=bad[0].dtype,
        )
        raise _BatchHoldsNonFinite

    def found_external(self, op: str, inputs: list[torch.Tensor]) -> None:
        """An op read a non-finite tensor no op of the replay made: the batch's targets, a
        buffer, a tensor attribute."""
        outside = [t for t in inputs if not self.is_made(t) and _unexpected_nonfinite(t)]
        if not outside:
            return
        module, _ = self.current()
        bad = []
        for t in outside:
            name = self.buffers.get(id(t))
            entry = NonFiniteInput.of(t, f"buffer {name}" if name else "a tensor", "external")
            entry.op, entry.module = op, module
            bad.append(entry)
        self.found_inputs(bad, _absmax(outside))

    def found_op(self, op: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        module, module_type = self.current()
        name = op if op.startswith("aten.") else f"aten.{op}"
        hint = _hint(name, inputs, outputs)
        if self.direction == "backward":
            node = current_autograd_node()
            if node is not None:  # the backward of which forward op: SqrtBackward0 -> sqrt
                forward_op = node.name().removesuffix("Backward0").removesuffix("Backward1")
                name = f"{name} in {node.name()}"
                hint = "in the gradient of " + _hint(f"aten.{forward_op.lower()}", inputs, outputs)
        frames = _user_frames()
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

    state.model_type = type(model).__name__
    state.buffers = {id(b): name for name, b in model.named_buffers()}
    handles = [model.register_forward_pre_hook(_check_inputs(state, model), with_kwargs=True)]
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(_push(state, name, module)))
        handles.append(module.register_forward_hook(_pop(state, name, module)))
        handles.append(module.register_full_backward_pre_hook(_push(state, name, module)))
        handles.append(module.register_full_backward_hook(_pop(state, name, module)))
    try:
        with _Watch(state):
            with warnings.catch_warnings():  # the watch's hooks on modules returning dicts
                warnings.filterwarnings("ignore", message="For backward hooks to be called")
                loss = fn()
            state.stack.clear()
            state.direction = "backward"
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                with warnings.catch_warnings():  # hooks on modules whose inputs need no grad
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    loss.backward()  # type: ignore[no-untyped-call]
    except _BatchHoldsNonFinite:
        pass  # the batch is the origin: the rest of the step is not worth tracing
    finally:
        for handle in handles:
            handle.remove()
        state.made.clear()
    return NonFiniteReport(state.origin, state.records, state.inputs)


def _check_inputs(state: _TraceState, model: nn.Module) -> Callable[..., None]:
    """A forward pre-hook on the root module: its inputs holding NaN/Inf stop the replay."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if state.origin is not None:
            return
        state.paused = True
        try:
            bad, absmax = _bad_inputs(model, args, kwargs)
        finally:
            state.paused = False
        if bad:
            state.found_inputs(bad, absmax)

    return hook


def _bad_inputs(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[NonFiniteInput], float]:
    """The floating tensors among a forward's inputs that hold NaN/Inf (integer ones cannot),
    and the abs-max of the finite values of all of them."""
    names = _argument_names(model, len(args))
    named = [(names[i], value) for i, value in enumerate(args)] + list(kwargs.items())
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, value in named:
        _tensors(value, name, tensors, 0)
    bad = [
        NonFiniteInput.of(t, name, "input")
        for name, t in tensors
        if (t.is_floating_point() or t.is_complex()) and _unexpected_nonfinite(t)
    ]
    return bad, _absmax([t for _, t in tensors if t.is_floating_point()])


def _argument_names(model: nn.Module, count: int) -> list[str]:
    """Names of the first `count` positional arguments of the model's forward; a wrapper whose
    forward takes only *args (DDP, torch.compile) is named by the module it wraps."""
    target = model
    for _ in range(3):
        positional, star = _positional(target)
        inner = getattr(target, "module", None) or compiled_original(target)
        if positional or not isinstance(inner, nn.Module):
            break
        target = inner
    positional, star = _positional(target)
    return [
        positional[i] if i < len(positional) else f"{star}[{i - len(positional)}]"
        for i in range(count)
    ]


def _positional(module: nn.Module) -> tuple[list[str], str]:
    """The positional parameter names of `module.forward`, and the name of its *args."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return [], "args"
    names, star = [], "args"
    for p in parameters:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            star = p.name
            break
    return names, star


def _tensors(value: Any, name: str, out: list[tuple[str, torch.Tensor]], depth: int) -> None:
    """Every tensor in `value`, walking dicts, lists and tuples, each with its path; a Python
    float that is NaN/Inf (an input scale) as a scalar tensor."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta" and value.numel():
            out.append((name, value))
    elif isinstance(value, float):
        if not math.isfinite(value):
            out.append((name, torch.tensor(value, dtype=torch.float64)))
    elif depth >= MAX_DEPTH:
        return
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _tensors(item, f"{name}[{key!r}]", out, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _tensors(item, f"{name}[{i}]", out, depth + 1)


def _unexpected_nonfinite(tensor: torch.Tensor) -> bool:
    """NaN or Inf that no data should hold: -inf among values all <= 0 is an additive mask
    (0 or -inf, causal masks, ALiBi biases) and is left alone."""
    data = tensor.detach()
    if _all_finite([data]):
        return False
    if data.is_complex() or bool(torch.isnan(data).any()) or bool((data == math.inf).any()):
        return True
    return bool((data[torch.isfinite(data)] > 0).any())


PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # trainguard/
DEMO_DIR = os.path.join(PACKAGE_DIR, "demo")  # the demo plays the user's code
LIBRARY_DIRS = tuple(
    sorted({os.path.abspath(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")})
)


def is_user_frame(filename: str) -> bool:
    """Whether a frame is the user's code: not trainguard's own, not an installed library's,
    not the standard library's."""
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path.startswith(DEMO_DIR + os.sep):
        return True
    if path.startswith("<") or path.startswith(PACKAGE_DIR + os.sep):
        return False
    if f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path:
        return False
    return not any(path.startswith(d + os.sep) for d in LIBRARY_DIRS)


def _user_frames() -> list[str]:
    """The last frames of the user's code, innermost last; where none is the user's (a
    library's own training loop), every frame but torch's and trainguard's."""
    stack = traceback.extract_stack()
    frames = [f for f in stack if is_user_frame(f.filename)] or [
        f
        for f in stack
        if f"{os.sep}torch{os.sep}" not in f.filename
        and not os.path.abspath(f.filename).startswith(PACKAGE_DIR + os.sep)
    ]
    return [f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in frames][
        -FRAMES:
    ]


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
