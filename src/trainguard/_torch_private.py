"""Every use of a private torch name in trainguard: a small function each, two classes by name.

torch 2.13 offers no public API for these; `tests/test_private_adapter.py` pins the versions they
are checked against and exercises each one against the installed torch, so an upgrade that moves
or renames one fails there by name. Nothing else in trainguard touches a private torch name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.utils._python_dispatch import TorchDispatchMode

# Two classes, named here rather than wrapped, as subclassing and exact type checks need them:
# the base of a mode that sees every aten op (torch 2.13 exports it only from a private module),
# and the class of DCP's per-tensor storage entries in a checkpoint's metadata (DCP keeps it
# private; `checkpoint_files` checks loaded metadata against it exactly).
DcpStorageInfo = _StorageInfo

__all__ = [
    "DcpStorageInfo",
    "TorchDispatchMode",
    "compiled_original",
    "current_autograd_node",
    "foreach_clone",
    "foreach_copy_",
    "foreach_mul_",
    "foreach_norm",
    "foreach_sub_",
    "mark_optimizer_stepped",
    "mark_step_wrapped",
    "optimizer_takes_found_inf",
    "scaler_found_inf",
    "scaler_scale",
    "set_found_inf",
    "tensor_version",
]

# -- multi-tensor kernels (torch.foreach is public only after 2.13) ----------------------------


def foreach_norm(
    tensors: list[torch.Tensor], dtype: torch.dtype | None = None, ord: float = 2
) -> tuple[torch.Tensor, ...]:
    """Each tensor's `ord`-norm (2 unless told) in one fused kernel; torch 2.13's public norms
    are one or total."""
    return torch._foreach_norm(tensors, ord, dtype=dtype)


def foreach_mul_(
    tensors: list[torch.Tensor], factor: torch.Tensor | list[torch.Tensor] | list[float]
) -> None:
    """Scale tensors in place by a device scalar (or one each: tensors, or host floats that
    cross to the device as kernel arguments) in one fused kernel, with no sync."""
    torch._foreach_mul_(tensors, factor)


def foreach_sub_(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> None:
    """Subtract `others` from `tensors` in place, pairwise, in one fused kernel."""
    torch._foreach_sub_(tensors, others)


def foreach_clone(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the tensors in one fused kernel (a per-tensor `clone` launches one each)."""
    return list(torch._foreach_mul(tensors, 1.0))


def foreach_copy_(
    targets: list[torch.Tensor], sources: list[torch.Tensor], non_blocking: bool = False
) -> None:
    """Copy sources into targets pairwise in one fused call (pinned host buffers: asynchronous)."""
    torch._foreach_copy_(targets, sources, non_blocking=non_blocking)


# -- GradScaler -------------------------------------------------------------------------------


def scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The loss scale as a device tensor; the public `get_scale()` syncs with the host."""
    getter = getattr(scaler, "_get_scale_async", None)
    return getter() if getter is not None else None


def scaler_found_inf(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Per device, whether the last `unscale_` found inf/NaN; no public API exposes it."""
    try:
        found: dict[str, torch.Tensor] = scaler._found_inf_per_device(optimizer)
    except (AttributeError, KeyError):
        return {}
    return found


# -- the optimizer's own skip ------------------------------------------------------------------


def optimizer_takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` skips itself on the device when its `found_inf` is 1 (torch's
    fused Adam, AdamW, SGD and Adagrad: how GradScaler skips them with no sync); torch marks
    them with a private flag, and no public API says so."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def set_found_inf(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> None:
    """Set (a float32 0-dim tensor on the parameters' device, exactly 1.0 to skip) or clear the
    `found_inf` and `grad_scale` a fused optimizer's `step()` reads; GradScaler sets the same
    two attributes, and no public API does."""
    if found_inf is None:
        for name in ("found_inf", "grad_scale"):
            if name in optimizer.__dict__:
                delattr(optimizer, name)
        return
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    optimizer.grad_scale = None  # type: ignore[attr-defined]


# -- LR scheduler's step check ----------------------------------------------------------------


def mark_step_wrapped(step: Callable[..., Any]) -> None:
    """Tell torch's LR scheduler that a replaced `optimizer.step` still counts its calls; its
    check reads a private mark, and no public API sets it."""
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def mark_optimizer_stepped(optimizer: Any) -> None:
    """Tell torch's LR scheduler the optimizer was stepped this step (the guard may skip it);
    the scheduler reads a private flag, and no public API sets it."""
    optimizer._opt_called = True


# -- autograd, dispatch, torch.compile, DCP --------------------------------------------------


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's autograd version counter: bumped by every in-place write through autograd
    (not through `.data`, nor by fused optimizer kernels); no public API reads it."""
    return int(tensor._version)


def current_autograd_node() -> Any:
    """The autograd node being run (in a backward pass), or None; no public API names it."""
    return torch._C._current_autograd_node()


def compiled_original(module: Any) -> Any:
    """The module a `torch.compile` wrapper holds, or None; the wrapper has no public accessor."""
    return getattr(module, "_orig_mod", None)
