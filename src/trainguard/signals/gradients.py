"""`GradientStats`: fused per-step gradient, parameter and update statistics for one optimizer.

Everything is computed on the device with fused multi-tensor kernels and packed into one tensor
that crosses to the host once per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainguard._torch_private import (
    foreach_clone,
    foreach_norm,
    foreach_sub_,
    scaler_found_inf,
    scaler_scale,
)
from trainguard.events import TrainguardError
from trainguard.signals.host_reads import read_now
from trainguard.signals.layer_groups import LayerGroups

FIRST_NONFINITE = 10
GATED_KEPT = 8  # steps whose gated update's norms are left out when read
_HEAD = 5  # loss, grad norm, non-finite count, loss scale, scaler found-inf
_LOSS, _TOTAL, _NONFINITE = 0, 1, 2  # their places in the head
NOT_MEASURED = -math.inf  # a precursor the sampled forward did not reach (the MAX's identity)


@dataclass
class StepSignals:
    """Host-side figures of one step, as measured by `GradientStats`."""

    loss: float
    grad_norm: float
    nonfinite_grads: int
    nonfinite_params: list[str]
    group_grad_norms: dict[str, float]
    lrs: list[float]
    loss_scale: float | None = None
    overflow: bool = False
    param_norm: float | None = None
    update_norm: float | None = None
    update_ratio: float | None = None
    update_step: int | None = None
    group_update_ratios: dict[str, float] = field(default_factory=dict)
    group_param_norms: dict[str, float] | None = None  # every step, before the update
    extra: list[float] = field(default_factory=list)  # what the caller appended (per-rank data)
    # on a sampled step (`precursors.every`): signal -> layer -> value, as `MetricPoint` has them
    precursors: dict[str, dict[str, float]] | None = None
    token_accuracy: float | None = None  # the sampled forward's, or the one passed in
    gate_skipped: bool | None = None  # lagged path: whether the device gate skipped the update


@dataclass
class _Layout:
    """Which parameters have gradients this step, their layer groups and device slices."""

    present: tuple[int, ...] | None
    group_index: torch.Tensor
    slices: list[tuple[int, int]]
    sharded: torch.Tensor | None  # which gradients are shards of a larger one (FSDP2, DTensor)


@dataclass
class Measurement:
    """Device tensors of one step, before the single transfer to the host."""

    total_norm: torch.Tensor
    head: torch.Tensor  # loss, grad norm, non-finite count, loss scale, found-inf
    first: torch.Tensor
    group_norms: torch.Tensor
    tail: list[torch.Tensor]
    present: tuple[int, ...] | None
    n_first: int
    lrs: list[Any]
    has_scaler: bool
    pending_step: int | None
    has_weights: bool = False
    # squared norms split into replicated gradients and this rank's shards, for `combine`
    rep_sq: torch.Tensor | None = None
    shard_sq: torch.Tensor | None = None
    group_rep_sq: torch.Tensor | None = None
    group_shard_sq: torch.Tensor | None = None
    extra: torch.Tensor | None = None
    # a sampled step's precursors (one value each of `precursor_names`, (signal, layer)) and
    # token accuracy (one value): packed after `extra`, in this order
    precursors: torch.Tensor | None = None
    precursor_names: list[tuple[str, str]] = field(default_factory=list)
    token_accuracy: torch.Tensor | None = None
    given_token_accuracy: float | None = None  # passed in as a number: replaces the packed one
    gate: torch.Tensor | None = None  # the device gate's skip (1.0) of this step, packed last

    @property
    def packed(self) -> torch.Tensor:
        pieces = [self.head, self.first, self.group_norms, *self.tail]
        for piece in (self.extra, self.precursors, self.token_accuracy, self.gate):
            if piece is not None:
                pieces.append(piece.to(self.head.device, torch.float32).reshape(-1))
        return torch.cat(pieces)

    @property
    def n_after_extra(self) -> int:
        """How many packed values follow `extra`: the precursors, the token accuracy, then the
        gate's skip."""
        n = self.precursors.numel() if self.precursors is not None else 0
        return n + (self.token_accuracy is not None) + (self.gate is not None)

    def gate_flag(self, bounds: dict[str, float]) -> torch.Tensor:
        """The device gate, with no host read: 1.0 where the step is non-finite or its loss or
        grad norm is over the host's bound (compared in float64, as the detectors compare), else
        0.0; `gate` keeps it for the host's lagged read."""
        loss, total = self.head[_LOSS].double(), self.head[_TOTAL].double()
        skip = ~torch.isfinite(loss) | ~torch.isfinite(total) | (self.head[_NONFINITE] > 0)
        if math.isfinite(bounds["loss"]):
            skip = skip | (loss > bounds["loss"])
        if math.isfinite(bounds["grad_norm"]):
            skip = skip | (total > bounds["grad_norm"])
        self.gate = skip.to(torch.float32)
        return self.gate

    def resolve_signals(self, values: list[float], signals: StepSignals) -> None:
        """Read the precursors and token accuracy from the packed `values` (they end them) into
        `signals`; both resolvers call it."""
        pos = len(values) - self.n_after_extra
        if self.precursors is not None:
            n = self.precursors.numel()
            signals.precursors = precursor_dict(self.precursor_names, values[pos : pos + n])
            pos += n
        if self.token_accuracy is not None:
            accuracy = values[pos]
            signals.token_accuracy = accuracy if math.isfinite(accuracy) else None
        if self.given_token_accuracy is not None:
            signals.token_accuracy = self.given_token_accuracy
        if self.gate is not None:
            signals.gate_skipped = values[-1] == 1.0

    def rank_figures(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's loss and non-finite gradient count, for the per-step exchange."""
        return self.head[_LOSS], self.head[_NONFINITE]

    def combine(
        self,
        losses: torch.Tensor,
        nonfinite: torch.Tensor,
        shard_sq: torch.Tensor,
        group_shard_sq: torch.Tensor,
    ) -> None:
        """Make the figures global from every rank's (one entry a rank; `group_shard_sq` one row
        a rank): the mean loss, the worst non-finite count, norms over all shards. Every rank
        computes the same numbers from the same rows, so every rank decides alike."""
        assert self.rep_sq is not None and self.group_rep_sq is not None
        total = (self.rep_sq + shard_sq.sum()).sqrt()
        self.head = torch.cat(
            [
                losses.mean().reshape(1),
                total.reshape(1),
                nonfinite.max().reshape(1),
                self.head[_NONFINITE + 1 :],
            ]
        )
        self.group_norms = (self.group_rep_sq + group_shard_sq.sum(dim=0)).sqrt()
        self.total_norm = total


class GradientStats:
    """Measures loss, gradient norms (global and per layer group), non-finite gradients, loss scale,
    per layer group the weights' norm (with `weight_norms`) and, every `stats_every` steps,
    parameter norms and the update ratio ||dtheta||/||theta||."""

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer,
        group_patterns: Sequence[str],
        stats_every: int = 10,
        weight_norms: bool = True,
    ) -> None:
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        params: list[torch.Tensor] = []
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        if not params:
            raise TrainguardError(
                "the optimizer has no parameters; build it from model.parameters()"
            )
        order = sorted(range(len(params)), key=lambda i: str(params[i].device))
        self.params = [params[i] for i in order]
        self.names = [
            names.get(id(p), f"param.{i}") for i, p in zip(order, self.params, strict=True)
        ]
        self.device = self.params[0].device
        self.groups = LayerGroups(self.names, group_patterns)
        self.stats_every = stats_every
        self._group_index_all = torch.tensor(self.groups.index, device=self.device)
        self._sharded = [_is_shard(p) for p in self.params]
        # per-step weight norms read whole parameters; FSDP2 shards would need a local view
        # per parameter per step, so they are left to the sampled `stats_every` norms
        self.weight_norms = weight_norms and not any(self._sharded)
        self._layouts: dict[tuple[int, ...] | None, _Layout] = {}
        self._full = self._make_layout(None)
        self._prev_params: list[torch.Tensor] | None = None
        self._last: tuple[torch.Tensor, _Layout] | None = None
        self._pending: tuple[int, torch.Tensor] | None = None
        self._gated_updates: set[int] = set()  # steps the device gate skipped (lagged path)

    # -- layout ---------------------------------------------------------------------------
    def _make_layout(self, present: tuple[int, ...] | None) -> _Layout:
        indices = list(range(len(self.params))) if present is None else list(present)
        devices = [self.params[i].device for i in indices]
        slices: list[tuple[int, int]] = []
        start = 0
        for k in range(1, len(indices) + 1):
            if k == len(indices) or devices[k] != devices[start]:
                slices.append((start, k))
                start = k
        group_index = self._group_index_all[torch.tensor(indices, device=self.device)]
        sharded = None
        if any(self._sharded[i] for i in indices):
            sharded = torch.tensor([self._sharded[i] for i in indices], device=self.device)
        layout = _Layout(present=present, group_index=group_index, slices=slices, sharded=sharded)
        self._layouts[present] = layout
        return layout

    def _norms(self, tensors: list[torch.Tensor], layout: _Layout) -> torch.Tensor:
        parts = [
            torch.stack(foreach_norm(tensors[a:b], torch.float32)).to(self.device)
            for a, b in layout.slices
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _group_norms(self, sq: torch.Tensor, layout: _Layout) -> torch.Tensor:
        return self._group_sq(sq, layout).sqrt_()

    def _group_sq(self, sq: torch.Tensor, layout: _Layout) -> torch.Tensor:
        out = torch.zeros(len(self.groups), device=self.device, dtype=torch.float32)
        return out.index_add_(0, layout.group_index, sq)

    # -- per step -------------------------------------------------------------------------
    @torch.no_grad()
    def measure(
        self,
        loss: torch.Tensor | float,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None = None,
    ) -> Measurement:
        """Launch the step's statistics on the device; nothing crosses to the host yet."""
        all_grads = [p.grad for p in self.params]
        grads = [_local(g) for g in all_grads if g is not None]
        if len(grads) == len(all_grads):
            layout = self._full
        else:
            if not grads:
                raise TrainguardError(
                    "no parameter has a gradient: call loss.backward() before guard.step()"
                )
            present = tuple(i for i, g in enumerate(all_grads) if g is not None)
            layout = self._layouts.get(present) or self._make_layout(present)
        norms = self._norms(grads, layout)
        self._last = (norms, layout)  # kept on the device for a report on an incident step
        sq = norms.square()
        if layout.sharded is None:
            rep_sq, shard_sq = sq, torch.zeros_like(sq)
        else:
            rep_sq = torch.where(layout.sharded, torch.zeros_like(sq), sq)
            shard_sq = sq - rep_sq
        total = sq.sum().sqrt()
        nonfinite = (~torch.isfinite(norms)).to(torch.float32)
        n_first = min(FIRST_NONFINITE, nonfinite.numel())
        first = torch.sort(nonfinite, descending=True, stable=True).indices[:n_first]

        head = [_loss_tensor(loss, self.device), total, nonfinite.sum()]
        has_scaler = scaler is not None and scaler.is_enabled()
        scale, found_inf = (
            _scaler_state(scaler, optimizer) if scaler is not None and has_scaler else (None, None)
        )
        head.append(scale if scale is not None else torch.zeros((), device=self.device))
        head.append(found_inf if found_inf is not None else torch.zeros((), device=self.device))
        tail: list[torch.Tensor] = []
        if self.weight_norms:  # the weights this step's forward used, one norm a layer group
            tail.append(
                self._group_norms(
                    self._norms(self._local_params(), self._full).square(), self._full
                )
            )
        pending_step = None
        if self._pending is not None:
            pending_step, pending = self._pending
            tail.append(pending)
            self._pending = None
        lrs: list[Any] = [g["lr"] for g in optimizer.param_groups]
        lr_tensors = [lr for lr in lrs if isinstance(lr, torch.Tensor)]
        if lr_tensors:
            tail.append(torch.stack([t.to(self.device, torch.float32) for t in lr_tensors]))
        group_rep = self._group_sq(rep_sq, layout)
        group_shard = self._group_sq(shard_sq, layout)
        return Measurement(
            total_norm=total,
            head=torch.stack([h.to(self.device, torch.float32).reshape(()) for h in head]),
            first=first.to(torch.float32),
            group_norms=(group_rep + group_shard).sqrt(),
            tail=tail,
            present=layout.present,
            n_first=n_first,
            lrs=lrs,
            has_scaler=has_scaler,
            pending_step=pending_step,
            has_weights=self.weight_norms,
            rep_sq=rep_sq.sum(),
            shard_sq=shard_sq.sum(),
            group_rep_sq=group_rep,
            group_shard_sq=group_shard,
        )

    def resolve(self, m: Measurement, values: list[float] | None = None) -> StepSignals:
        """Bring the packed statistics to the host (the step's one device-to-host transfer), or
        read them from `values` the lagged path copied."""
        if values is None:
            values = read_now(m.packed)
        loss, total, count, scale, found_inf = values[:_HEAD]
        pos = _HEAD
        first = [int(i) for i in values[pos : pos + m.n_first]]
        pos += m.n_first
        n_groups = len(self.groups)
        group_norms = values[pos : pos + n_groups]
        pos += n_groups
        names: list[str] = []
        n_bad = int(count)
        for i in first[:n_bad]:
            index = m.present[i] if m.present is not None else i
            names.append(self.names[index])
        signals = StepSignals(
            loss=loss,
            grad_norm=total,
            nonfinite_grads=n_bad,
            nonfinite_params=names,
            group_grad_norms=dict(zip(self.groups.group_names, group_norms, strict=True)),
            lrs=[],
            loss_scale=scale if m.has_scaler else None,
            overflow=bool(found_inf > 0) if m.has_scaler else False,
        )
        if m.has_weights:
            weights = values[pos : pos + n_groups]
            pos += n_groups
            signals.group_param_norms = dict(zip(self.groups.group_names, weights, strict=True))
        if m.pending_step is not None:
            p_norm, u_norm = values[pos], values[pos + 1]
            gp = values[pos + 2 : pos + 2 + n_groups]
            gu = values[pos + 2 + n_groups : pos + 2 + 2 * n_groups]
            pos += 2 + 2 * n_groups
        if m.pending_step is not None and m.pending_step not in self._gated_updates:
            signals.param_norm = p_norm
            signals.update_norm = u_norm
            signals.update_ratio = u_norm / p_norm if p_norm > 0 else math.inf
            signals.update_step = m.pending_step
            signals.group_update_ratios = {
                name: (u / p if p > 0 else 0.0)
                for name, p, u in zip(self.groups.group_names, gp, gu, strict=True)
            }
        n_extra = m.extra.numel() if m.extra is not None else 0
        end = len(values) - m.n_after_extra
        lr_values = iter(values[pos : end - n_extra])
        signals.lrs = [
            next(lr_values) if isinstance(lr, torch.Tensor) else float(lr) for lr in m.lrs
        ]
        if n_extra:
            signals.extra = values[end - n_extra : end]
        m.resolve_signals(values, signals)
        return signals

    @property
    def last_norms(self) -> tuple[torch.Tensor, _Layout] | None:
        """The last measured step's per-parameter norms (on the device) and layout."""
        return self._last

    def group_report(
        self, last: tuple[torch.Tensor, _Layout] | None = None
    ) -> dict[str, dict[str, float]]:
        """Per layer group: count, mean, std, max and p99 of the parameters' gradient norms at
        the last measured step (or of `last_norms` kept from an earlier one). A second host
        transfer: for incident steps only."""
        last = last if last is not None else self._last
        if last is None:
            return {}
        norms_t, layout = last
        norms = np.asarray(read_now(norms_t.double()))
        index = np.asarray(read_now(layout.group_index))
        report: dict[str, dict[str, float]] = {}
        for g, name in enumerate(self.groups.group_names):
            values = norms[index == g]
            if len(values):
                report[name] = {
                    "n": float(len(values)),
                    "mean": float(values.mean()),
                    "std": float(values.std()),
                    "max": float(values.max()),
                    "p99": float(np.percentile(values, 99)),
                }
        return report

    # -- around the optimizer step ---------------------------------------------------------
    @torch.no_grad()
    def before_optimizer_step(self, step: int) -> None:
        """On sampling steps, keep a copy of the parameters to measure the update against."""
        if self.stats_every and step % self.stats_every == 0:
            self._prev_params = foreach_clone(self._local_params())

    @torch.no_grad()
    def after_optimizer_step(self, step: int) -> None:
        """Measure parameter and update norms on the device; they reach the host next step."""
        prev = self._prev_params
        if prev is None:
            return
        self._prev_params = None
        params = self._local_params()
        foreach_sub_(prev, params)
        upd = self._norms(prev, self._full)
        par = self._norms(params, self._full)
        del prev
        usq, psq = upd.square(), par.square()
        self._pending = (
            step,
            torch.cat(
                [
                    psq.sum().sqrt().reshape(1),
                    usq.sum().sqrt().reshape(1),
                    self._group_norms(psq, self._full),
                    self._group_norms(usq, self._full),
                ]
            ),
        )

    def _local_params(self) -> list[torch.Tensor]:
        """The parameters as this rank holds them (its shards under FSDP2); under FSDP2 the
        update ratio is measured on this rank's shards."""
        if not any(self._sharded):
            return self.params
        return [_local(p.detach()) for p in self.params]

    def discard_update(self) -> None:
        """Forget the parameter copy of a step that was skipped."""
        self._prev_params = None

    def discard_gated_update(self, step: int) -> None:
        """Lagged path: `step`'s update was measured before the host knew the gate skipped it;
        its norms, read with a later step, are left out."""
        self._gated_updates.add(step)
        if len(self._gated_updates) > GATED_KEPT:
            self._gated_updates.discard(min(self._gated_updates))


def precursor_dict(
    names: list[tuple[str, str]], values: list[float]
) -> dict[str, dict[str, float]]:
    """signal -> layer -> value from the (signal, layer) names and their values; a value the
    sampled forward did not reach (-inf, `NOT_MEASURED`, on every rank) is left out, a NaN
    measured (a layer gone non-finite) is kept."""
    out: dict[str, dict[str, float]] = {}
    for (signal, layer), value in zip(names, values, strict=True):
        if value != NOT_MEASURED:
            out.setdefault(signal, {})[layer] = value
    return out


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient's local shard (FSDP2); a plain tensor as it is."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _is_shard(param: torch.Tensor) -> bool:
    """Whether this rank holds only a part of the parameter (and so of its gradient)."""
    if not isinstance(param, DTensor):
        return False
    return any(p.is_shard() or p.is_partial() for p in param.placements)


def _loss_tensor(loss: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise TrainguardError(
                f"guard.step needs the scalar loss, got a tensor of shape {tuple(loss.shape)}; "
                "reduce it (e.g. loss.mean()) first"
            )
        return loss.detach().reshape(())
    return torch.full((), float(loss), device=device)  # filled there: no host copy


def _scaler_state(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The scaler's current scale and whether its last unscale found inf/NaN, as device tensors."""
    scale = scaler_scale(scaler)
    found: torch.Tensor | None = None
    per_device = scaler_found_inf(scaler, optimizer)
    for t in per_device.values():
        t = t.reshape(()).to(torch.float32)
        found = t if found is None else found + t.to(found.device)
    return scale, found
