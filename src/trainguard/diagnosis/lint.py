"""`lint`: a check of a training set-up before it runs, each finding with a concrete fix."""

from __future__ import annotations

import copy
import inspect
import itertools
import math
import operator
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainguard._torch_private import optimizer_takes_found_inf
from trainguard.events import Severity

# A table of peak LRs by model size (parameters -> LR), interpolated log-log by parameter count.
PEAK_LR_TABLE = ((7e9, 3e-4), (70e9, 1e-4), (405e9, 8e-5))
SMALL_MODEL_SLACK = 2.0  # below 7B the line is extrapolated: only twice over it is reported
RESIDUAL_OUT = re.compile(
    r"(attn|attention|self_attn)\.(c_proj|proj|o_proj|out_proj|dense)\.weight$"
    r"|(mlp|ffn|feed_forward)\.(c_proj|fc2|down_proj|dense_4h_to_h|w2|2)\.weight$"
)
NORM_FUNCTIONS = (F.layer_norm, F.rms_norm, torch.layer_norm)
ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
MUL_FUNCTIONS = (operator.mul, torch.mul)
WARMUP_HORIZON = 20_000  # scheduler steps simulated to find the warmup
PEAK_TOLERANCE = 1e-6  # an LR this close to the peak (relative) has reached it: float rounding


@dataclass
class Finding:
    """One problem with the set-up: a code, a severity, what is wrong, and how to fix it."""

    code: str
    severity: Severity
    message: str
    fix: str

    def to_dict(self) -> dict[str, str]:
        return {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "fix": self.fix,
        }


def peak_lr_limit(n_params: int) -> float:
    """The table's peak LR for a model of `n_params` parameters (log-log interpolation)."""
    segments = list(itertools.pairwise(PEAK_LR_TABLE))
    (n0, lr0), (n1, lr1) = next((seg for seg in segments if n_params <= seg[1][0]), segments[-1])
    slope = math.log(lr1 / lr0) / math.log(n1 / n0)
    return float(lr0 * (max(n_params, 1) / n0) ** slope)


def lint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    max_grad_norm: float | None = 1.0,
    total_steps: int | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> list[Finding]:
    """Check a set-up: warmup, peak LR for the model size, fp16 without a loss scaler, clipping,
    Adam's beta2 and epsilon, post-LN depth, residual-projection scaling, init std, biases."""
    findings: list[Finding] = []
    n_params = sum(p.numel() for p in model.parameters())
    n_layers = _depth(model)
    if optimizer is not None:
        findings += _schedule(optimizer, scheduler, total_steps, n_params)
        findings += _adam(optimizer)
        findings += _unfused(optimizer)
    findings += _precision(model, scaler, autocast_dtype)
    if max_grad_norm is None:
        findings.append(
            Finding(
                "no-clipping",
                "warning",
                "gradients are not clipped: one bad batch can move the weights arbitrarily far",
                "clip the global gradient norm at 1.0 (GuardConfig.max_grad_norm=1.0), or adapt "
                "the threshold with trainguard.fixes.AdaptiveClipper",
            )
        )
    findings += _post_ln(model)
    findings += _init(model, n_layers)
    return findings


def _lr_trace(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[float]:
    """The first group's LR over `steps` scheduler steps (fewer where the scheduler's own
    `total_steps`, as OneCycleLR's, ends sooner), leaving scheduler and optimizer as they were."""
    own_total = getattr(scheduler, "total_steps", None)
    if isinstance(own_total, int) and isinstance(getattr(scheduler, "last_epoch", None), int):
        steps = min(steps, max(0, own_total - scheduler.last_epoch))
    saved_sched = copy.deepcopy(scheduler.state_dict())
    saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    lrs = [float(optimizer.param_groups[0]["lr"])]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(steps):
                if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    break
                scheduler.step()
                lrs.append(float(optimizer.param_groups[0]["lr"]))
    finally:
        scheduler.load_state_dict(saved_sched)
        for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
            group.update(saved)
    return lrs


def _schedule(
    optimizer: torch.optim.Optimizer, scheduler: Any, total: int | None, n_params: int
) -> list[Finding]:
    findings = []
    horizon = min(total or WARMUP_HORIZON, WARMUP_HORIZON)
    lrs = (
        _lr_trace(optimizer, scheduler, horizon)
        if scheduler is not None
        else [float(optimizer.param_groups[0]["lr"])]
    )
    peak = max(lrs)
    first, warmup = _warmup(lrs)
    if scheduler is None or lrs[first] >= 0.5 * peak:
        findings.append(
            Finding(
                "no-warmup",
                "warning",
                f"the LR starts at {lrs[first]:.3g}, already near its peak {peak:.3g}: no warmup",
                "warm the LR up linearly from 0 over 1-5% of the steps "
                "(trainguard.fixes.WarmupCosineRestarts)",
            )
        )
    elif total and warmup < 0.01 * total:
        findings.append(
            Finding(
                "short-warmup",
                "warning",
                f"the warmup lasts {warmup} steps, {warmup / total:.2%} of {total}: under 1%",
                f"warm up over at least {math.ceil(0.01 * total)} steps (1-5% of the run)",
            )
        )
    limit = peak_lr_limit(n_params)
    slack = SMALL_MODEL_SLACK if n_params < PEAK_LR_TABLE[0][0] else 1.0
    if peak > slack * limit:
        findings.append(
            Finding(
                "peak-lr",
                "warning",
                f"peak LR {peak:.3g} is above {slack * limit:.3g} for a model of "
                f"{n_params / 1e6:,.1f}M parameters (peak LRs by size: 7B 3e-4, 70B 1e-4, "
                "405B 8e-5)",
                f"lower the peak LR to about {limit:.2g}",
            )
        )
    return findings


def _warmup(lrs: list[float]) -> tuple[int, int]:
    """The first step that trains (LR above 0), and the warmup: the steps the LR takes to climb
    from 0 to its peak, from step 0 at 0 or from one step before a step 0 already above it (HF's
    `warmup_steps=20` is 20 steps, `(s + 1) / 100` in a LambdaLR 100)."""
    peak = max(lrs)
    if peak <= 0:
        return 0, 0
    first = next(i for i, lr in enumerate(lrs) if lr > 0)
    top = next(i for i, lr in enumerate(lrs) if lr >= peak * (1 - PEAK_TOLERANCE))
    return first, top + (lrs[0] > 0) if top > 0 else 0


def _adam(optimizer: torch.optim.Optimizer) -> list[Finding]:
    findings = []
    for i, group in enumerate(optimizer.param_groups):
        betas = group.get("betas")
        if betas is None:
            continue
        if float(betas[1]) > 0.99:
            findings.append(
                Finding(
                    "adam-beta2",
                    "warning",
                    f"param group {i}: Adam beta2 {float(betas[1])} > 0.99 reacts slowly when "
                    "the gradient scale changes, which lets loss spikes grow",
                    "use beta2 = 0.95 (common for large transformers)",
                )
            )
        eps = float(group.get("eps", 0.0))
        scales = [
            float(state["exp_avg_sq"].sqrt().median())
            for p in group["params"]
            if (state := optimizer.state.get(p)) and "exp_avg_sq" in state
        ]
        typical = sorted(scales)[len(scales) // 2] if scales else None
        too_large = eps > 0.1 * typical if typical else eps >= 1e-5
        if too_large:
            against = f"the typical gradient scale {typical:.3g}" if typical else "1e-5"
            findings.append(
                Finding(
                    "adam-eps",
                    "warning",
                    f"param group {i}: Adam epsilon {eps:.3g} is large against {against}: it "
                    "damps the updates of small-gradient parameters",
                    "use epsilon 1e-8 (or 1e-6 below that scale's tenth)",
                )
            )
            break
    return findings


FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def on_gpu(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any of the optimizer's parameters is on a GPU."""
    return any(p.is_cuda for g in optimizer.param_groups for p in g["params"])


def _unfused(optimizer: torch.optim.Optimizer) -> list[Finding]:
    """On a GPU, an optimizer torch can fuse that is not fused: the guard then reads every
    step's figures before the update (one blocking sync a step) instead of skipping on the
    device."""
    if (
        not on_gpu(optimizer)
        or not isinstance(optimizer, FUSABLE)
        or optimizer_takes_found_inf(optimizer)
    ):
        return []
    name = type(optimizer).__name__
    return [
        Finding(
            "unfused-optimizer",
            "info",
            f"{name} is not fused: the guard reads each step's figures before the update, one "
            "blocking sync a step, instead of skipping a bad step on the device",
            f"build it with fused=True (torch.optim.{name}(..., fused=True)); the guard's "
            "hot_path 'auto' then judges each step one call later with no sync",
        )
    ]


def _precision(model: nn.Module, scaler: Any, autocast: torch.dtype | None) -> list[Finding]:
    fp16 = autocast == torch.float16 or any(p.dtype == torch.float16 for p in model.parameters())
    scaled = scaler is not None and scaler.is_enabled()
    if fp16 and not scaled:
        return [
            Finding(
                "fp16-no-scaler",
                "critical",
                "fp16 training without a GradScaler: small gradients underflow to zero and "
                "large ones overflow",
                "pass torch.amp.GradScaler() to the Guard, or train in bf16",
            )
        ]
    return []


def _post_ln(model: nn.Module) -> list[Finding]:
    post = [m for m in _blocks(model) if _is_post_ln(m)]
    if len(post) > 24 and not getattr(model, "deepnorm", False):
        return [
            Finding(
                "post-ln-depth",
                "warning",
                f"{len(post)} post-LN transformer layers: beyond 24, post-LN diverges without "
                "DeepNorm's residual scaling",
                "use pre-LN (norm_first=True; x + f(norm(x)) in a hand-written block), or "
                "DeepNorm: trainguard.fixes.DeepNormResidual with deepnorm_init_",
            )
        ]
    return []


def _blocks(model: nn.Module) -> list[nn.Module]:
    """torch's transformer layers, and the repeated blocks (ModuleList or Sequential items of
    one class) with a norm inside; the innermost, where blocks nest (stages of layers)."""
    torch_layers = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    found: dict[int, nn.Module] = {}
    for m in model.modules():
        if isinstance(m, torch_layers):
            found[id(m)] = m
        elif _repeated(m):
            for block in m:
                if not _is_norm(block) and any(_is_norm(s) for s in block.modules()):
                    found.setdefault(id(block), block)
    return [
        block
        for block in found.values()
        if not any(id(s) in found for s in block.modules() if s is not block)
    ]


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(
        ("LayerNorm", "RMSNorm")
    )


class _NormTracer(torch.fx.Tracer):
    """Traces a block down to its norms: a submodule with no norm inside is one opaque call."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return _is_norm(m) or not any(_is_norm(s) for s in m.modules())


def _is_post_ln(block: nn.Module) -> bool:
    """A post-LN block: its output is a norm of a residual sum, `norm(x + f(x))` (by
    `norm_first` for torch's layers, by an fx trace otherwise; a block that does not trace is
    not flagged, nor DeepNorm's `norm(alpha x + f(x))`, alpha > 1)."""
    if isinstance(block, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return not block.norm_first
    graph = _trace(block)
    if graph is None:
        return False
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    while isinstance(out, (tuple, list)) and out:
        out = out[0]  # the hidden states of (hidden, attention weights, ...)
    if not inputs or not isinstance(out, torch.fx.Node) or not _is_norm_node(out, block):
        return False
    summed = out.args[0] if out.args else None
    return isinstance(summed, torch.fx.Node) and _is_residual_sum(summed, inputs[0])


def _trace(block: nn.Module) -> torch.fx.Graph | None:
    """The block's forward as an fx graph, its optional arguments at their defaults; None where
    it does not trace (control flow on tensors, *args wrappers, ...)."""
    try:
        params = list(inspect.signature(block.forward).parameters.values())[1:]
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        defaults = {
            p.name: p.default for p in params if p.kind in keyword and p.default is not p.empty
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _NormTracer().trace(block, concrete_args=defaults)
    except Exception:
        return None


def _is_norm_node(node: torch.fx.Node, block: nn.Module) -> bool:
    if node.op == "call_module" and isinstance(node.target, str):
        return _is_norm(block.get_submodule(node.target))
    return node.op == "call_function" and node.target in NORM_FUNCTIONS


def _is_residual_sum(node: torch.fx.Node, hidden: torch.fx.Node) -> bool:
    """`a + b` with both terms computed from the block's hidden-state input, neither scaled up by
    a constant (DeepNorm's `alpha x`)."""
    is_add = (node.op == "call_function" and node.target in ADD_FUNCTIONS) or (
        node.op == "call_method" and node.target in ("add", "add_", "__add__")
    )
    terms = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
    return (
        is_add
        and len(terms) == 2
        and all(_depends_on(t, hidden) for t in terms)
        and not any(_scaled_up(t) for t in terms)
    )


def _depends_on(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current is source:
            return True
        if current not in seen:
            seen.add(current)
            todo.extend(current.all_input_nodes)
    return False


def _scaled_up(node: torch.fx.Node) -> bool:
    """`x * c` (or `c * x`) with a constant c > 1: DeepNorm's up-weighted residual."""
    is_mul = (node.op == "call_function" and node.target in MUL_FUNCTIONS) or (
        node.op == "call_method" and node.target in ("mul", "__mul__")
    )
    constants = [a for a in node.args if isinstance(a, (int, float))]
    return is_mul and any(abs(c) > 1 for c in constants)


def _depth(model: nn.Module) -> int:
    """The number of repeated blocks: the longest ModuleList or Sequential of one block class."""
    depth = 0
    for m in model.modules():
        if _repeated(m) and not isinstance(m[0], (nn.Linear, nn.ReLU, nn.GELU)):
            depth = max(depth, len(m))
    return depth


def _repeated(module: nn.Module) -> TypeGuard[nn.ModuleList | nn.Sequential]:
    """A ModuleList or Sequential of modules of one class (a stack of blocks, or of layers)."""
    return (
        isinstance(module, (nn.ModuleList, nn.Sequential)) and len({type(c) for c in module}) == 1
    )


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's values on this rank: its shard under FSDP2, which is enough for init stats."""
    return p.to_local() if isinstance(p, DTensor) else p


def _init(model: nn.Module, n_layers: int) -> list[Finding]:
    findings: list[Finding] = []
    named = {
        name: _local(p).detach()
        for name, p in model.named_parameters()
        if _local(p).numel() > 1 or (name.endswith("bias") and _local(p).numel() > 0)
    }
    weights = [
        (name, p)
        for name, p in named.items()
        if p.dim() == 2 and name.endswith("weight") and not RESIDUAL_OUT.search(name)
    ]
    if weights:
        stds = sorted(float(p.detach().float().std()) for _, p in weights)
        typical = stds[len(stds) // 2]
        if not 0.01 <= typical <= 0.04:
            findings.append(
                Finding(
                    "init-std",
                    "info",
                    f"the typical weight std at init is {typical:.3g}, far from 0.02",
                    "initialise weights and embeddings with normal(0, 0.02): "
                    "trainguard.fixes.scaled_init_(model, n_layers)",
                )
            )
    if n_layers:
        expected = 0.02 / math.sqrt(2 * n_layers)
        unscaled = [
            name
            for name, p in named.items()
            if RESIDUAL_OUT.search(name) and float(p.detach().float().std()) > 1.5 * expected
        ]
        if unscaled:
            findings.append(
                Finding(
                    "residual-init",
                    "warning",
                    f"{len(unscaled)} residual output projection(s) not scaled by "
                    f"1/sqrt(2 x {n_layers} layers) (std over {1.5 * expected:.3g}): "
                    + ", ".join(unscaled[:5]),
                    f"initialise them with std 0.02/sqrt(2 x {n_layers}) = {expected:.3g}: "
                    f"trainguard.fixes.scaled_init_(model, n_layers={n_layers})",
                )
            )
    biased = [
        name
        for name, p in named.items()
        if name.endswith("bias") and bool(p.detach().abs().max() > 0)
    ]
    if biased:
        findings.append(
            Finding(
                "nonzero-bias",
                "info",
                f"{len(biased)} bias(es) are not zero at init: " + ", ".join(biased[:5]),
                "initialise biases to zero",
            )
        )
    return findings


def describe(findings: Sequence[Finding]) -> str:
    return "\n".join(f"[{f.severity}] {f.code}: {f.message}; fix: {f.fix}" for f in findings)
