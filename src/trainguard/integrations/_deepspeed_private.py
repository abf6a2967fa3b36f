"""The DeepSpeed internals the DeepSpeed integration reads, in one place.

DeepSpeed has no public API for this rank's reduced gradient partition before the optimizer
step, nor for holding one step back; each name used here is pinned by
`tests/test_deepspeed.py::test_the_private_deepspeed_names_still_exist`, so a DeepSpeed release
that moves one fails there first. Everything else the integration uses is public: the engine's
`backward`, `step`, `is_gradient_accumulation_boundary`, `was_step_applied`, `lr_scheduler`,
`basic_optimizer`, `global_steps`, `save_checkpoint`, `load_checkpoint`, and the ZeRO
optimizers' `state_dict`, `load_state_dict`, `loss_scale` and checkpoint prologue/epilogue,
which `engine.load_checkpoint` itself calls. Two more mechanisms stand in
for missing API: a skip shadows the basic optimizer's `step` for one call (`update_held`), and
the Hugging Face callback finds the Trainer's engine among the optimizer's referrers
(`engine_of`), as the Trainer hands callbacks the optimizer but not the engine. A resume reads
DeepSpeed's files through a `weights_only` load in place of its checkpoint engine's
(`weights_only_loads`), allowing only the DeepSpeed classes a ZeRO checkpoint pickles
(`CHECKPOINT_GLOBALS`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

# this rank's reduced gradient partition at the accumulation boundary, by param group (ZeRO 1-3)
GRADIENT_PARTITIONS = "averaged_gradients"
# the parameters whose partitions those are, by param group: ZeRO-3, then ZeRO-1/2
PARTITION_PARAMS = ("fp16_groups", "params_in_partition")
OFFLOAD_FLAGS = ("cpu_offload", "offload_optimizer")  # ZeRO-Offload keeps gradients elsewhere
DP_GROUP = "dp_process_group"
# ZeRO-1/2: copy this rank's fp32 partition into the module's weights and all-gather them
REGATHER = "update_lp_params"
CHECKPOINT_ENGINE = "checkpoint_engine"  # the engine's reader and writer of checkpoint files
# the only globals (module, name) a ZeRO-1/2/3 checkpoint of DeepSpeed 0.19 pickles, besides
# torch's tensors and containers: the loss scaler (a plain object), ZeRO's stage (an IntEnum) and
# ZeRO-1/2's parameter slice map (a dataclass of two ints)
CHECKPOINT_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def gradient_partitions(optimizer: Any) -> list[torch.Tensor]:
    """This rank's gradient partition after the boundary's backward (reduced across the
    data-parallel ranks, still multiplied by the fp16 loss scale): a flat list of tensors."""
    groups: dict[int, list[torch.Tensor] | None] = getattr(optimizer, GRADIENT_PARTITIONS)
    return [t for i in sorted(groups) for t in (groups[i] or ())]


def partition_names(optimizer: Any, names: dict[int, str]) -> list[str]:
    """A name for each tensor of `gradient_partitions`: the parameter's where the partition is
    one tensor a parameter, else the param group's (ZeRO-1/2 keep one flat partition a group).
    Per-parameter: for incident steps only."""
    groups: dict[int, list[torch.Tensor] | None] = getattr(optimizer, GRADIENT_PARTITIONS)
    params_by_group: list[list[torch.Tensor]] | None = None
    for attribute in PARTITION_PARAMS:
        params_by_group = getattr(optimizer, attribute, None)
        if params_by_group is not None:
            break
    out: list[str] = []
    for i in sorted(groups):
        tensors = groups[i] or []
        params = params_by_group[i] if params_by_group is not None else []
        if len(params) == len(tensors):
            out.extend(names.get(id(p), f"param_group{i}.{j}") for j, p in enumerate(params))
        else:
            out.extend(f"param_group{i}.partition{j}" for j in range(len(tensors)))
    return out


def regather_weights(optimizer: Any) -> None:
    """ZeRO-1/2: the module's (low-precision) weights made again from every rank's fp32
    partition, all-gathered across the data-parallel group (a collective)."""
    getattr(optimizer, REGATHER)()


def offloads_optimizer(optimizer: Any) -> bool:
    """Whether ZeRO-Offload keeps the gradient partitions and optimizer state on the host."""
    return any(bool(getattr(optimizer, flag, False)) for flag in OFFLOAD_FLAGS)


def data_parallel_size(optimizer: Any) -> int:
    group = getattr(optimizer, DP_GROUP, None)
    return dist.get_world_size(group=group) if dist.is_initialized() else 1


@contextlib.contextmanager
def update_held(basic_optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, the engine's `step()` runs all its bookkeeping (gradients released, counters,
    loss scale) but the basic optimizer leaves this rank's fp32 partition and its state as they
    were: a skipped step. (An instance attribute shadows the optimizer's `step` for the call.)"""

    def held(*args: Any, **kwargs: Any) -> None:
        return None

    own = vars(basic_optimizer).get("step")  # a wrapper someone put on this instance
    basic_optimizer.step = held  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        if own is None:
            del basic_optimizer.step
        else:
            basic_optimizer.step = own  # type: ignore[method-assign]


def engine_of(optimizer: Any) -> Any:
    """The `DeepSpeedEngine` that holds this ZeRO optimizer, or None. The Hugging Face Trainer
    hands its callbacks the optimizer but not the engine (Accelerate keeps it); the engine is
    found among the optimizer's referrers, once, at the start of training."""
    from deepspeed import DeepSpeedEngine

    for holder in gc.get_referrers(optimizer):
        owners = gc.get_referrers(holder) if isinstance(holder, dict) else [holder]
        for owner in owners:
            if isinstance(owner, DeepSpeedEngine) and owner.optimizer is optimizer:
                return owner
    return None


def engine_step(engine: Any) -> None:
    """The engine's own `step()`, whatever an instance attribute put in its place (the Hugging
    Face callback routes the Trainer's `engine.step()` through the guard)."""
    type(engine).step(engine)


def checkpoint_globals() -> list[Any]:
    """The classes of `CHECKPOINT_GLOBALS`, for `torch.serialization.safe_globals`."""
    return [getattr(importlib.import_module(m), n) for m, n in CHECKPOINT_GLOBALS]


def unsafe_globals(path: str) -> list[str]:
    """The globals the pickle of a `torch.save` file names beyond torch's weights-only set and
    `CHECKPOINT_GLOBALS`, read without unpickling (`ValueError` for a file torch.save did not
    write)."""
    with torch.serialization.safe_globals(checkpoint_globals()):
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))


def unsupported_checkpoints(engine: Any) -> str | None:
    """Why the guard cannot verify this engine's checkpoints (None where it can): they must be
    written by torch's own checkpoint engine, synchronously, into the tag's folder alone."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    writer = getattr(engine, CHECKPOINT_ENGINE, None)
    if type(writer) is not TorchCheckpointEngine:
        return f"DeepSpeed's {type(writer).__name__} (checkpoint.writer or datastates)"
    if engine.load_universal_checkpoint():
        return "universal checkpoints (checkpoint.load_universal)"
    return None


@contextlib.contextmanager
def weights_only_loads(engine: Any) -> Iterator[None]:
    """Inside, `engine.load_checkpoint` reads every file with `torch.load(weights_only=True)`,
    allowing only `CHECKPOINT_GLOBALS` (an instance attribute shadows the checkpoint engine's
    `load`, which calls `torch.load(weights_only=False)`)."""
    reader = getattr(engine, CHECKPOINT_ENGINE)
    allowed = checkpoint_globals()

    def load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    own = vars(reader).get("load")
    reader.load = load
    try:
        yield
    finally:
        if own is None:
            del reader.load
        else:
            reader.load = own
