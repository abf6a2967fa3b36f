"""`Preemption`: the preemptive actions a policy may take on a precursor of divergence, before the
loss moves: rescaling one attention layer's W_q and W_k so its logits shrink (max-logit
clipping, as MuonClip does), and switching z-loss on the output logits on or off.

Primitives only: they act when called, and say what they did in an event of kind `preemption`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainguard.events import Event, EventKind, TrainguardError
from trainguard.signals.model_structure import AttentionSite, ModelStructure, find_structure

MAX_RESCALES_KEPT = 1000  # rescales the state remembers (the newest)


class ZLossGrad(torch.autograd.Function):
    """Identity on the logits whose backward adds the gradient of weight * mean(logZ^2), the
    mean over every position of the logits: z-loss, without touching the user's loss."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.weight = weight
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (logits,) = ctx.saved_tensors
        x = logits.float()
        log_z = torch.logsumexp(x, dim=-1, keepdim=True)
        n = max(1, log_z.numel())
        extra = torch.softmax(x, dim=-1) * (log_z * (2.0 * ctx.weight / n))
        return grad + extra.to(grad.dtype), None


class Preemption:
    """Rescales attention layers' W_q and W_k, and switches z-loss, on the guard's model; its
    state (z-loss on/off and weight, the rescales done) is checkpointed with the guard's."""

    def __init__(self, model: nn.Module, structure: ModelStructure | None = None) -> None:
        self.model = model
        self._structure = structure
        self.z_loss_weight: float | None = None
        self.rescales: list[dict[str, Any]] = []  # {"step", "layer", "factor"}, oldest first
        self._z_hook: RemovableHandle | None = None

    @property
    def structure(self) -> ModelStructure:
        if self._structure is None:
            self._structure = find_structure(self.model)
        return self._structure

    # -- max-logit clipping ----------------------------------------------------------------------
    @torch.no_grad()
    def rescale_qk(
        self, step: int, layer: str, factor: float, max_logit: float | None = None
    ) -> Event:
        """Scale W_q and W_k (with their biases; the q/k slices of a fused projection; the QK-norm
        weights where the layer normalises q and k) of attention layer `layer` by sqrt(factor)
        each, so its attention logits scale by `factor` (its `max_logit`, where given, to
        max_logit * factor)."""
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise TrainguardError(f"rescale_qk needs a finite factor > 0, got {factor!r}")
        try:
            site = self.structure.site(str(layer))
        except KeyError as exc:
            raise TrainguardError(f"rescale_qk: {exc.args[0]}") from None
        root = math.sqrt(factor)
        _scale_qk(site, root)
        self.rescales.append({"step": int(step), "layer": site.layer, "factor": float(factor)})
        del self.rescales[:-MAX_RESCALES_KEPT]
        return Event(
            step=step,
            kind=EventKind.PREEMPTION,
            severity="warning",
            message=(
                f"rescaled W_q and W_k of attention layer {site.layer} by sqrt({factor:.4g}) "
                f"each: its attention logits scale by {factor:.4g}"
                + (
                    f", its max logit {max_logit:.4g} -> {max_logit * factor:.4g}"
                    if max_logit is not None and math.isfinite(max_logit)
                    else ""
                )
                + " (max-logit clipping)"
            ),
            metrics={"action": "rescale_qk", "layer": site.layer, "factor": float(factor)},
        )

    # -- z-loss -----------------------------------------------------------------------------------
    def enable_z_loss(self, step: int, weight: float = 1e-4) -> Event:
        """Add weight * mean(logZ^2) over the output logits' positions to the training objective
        from the next forward on (its gradient, through a hook on the output head)."""
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise TrainguardError(f"enable_z_loss needs a finite weight > 0, got {weight!r}")
        self._hook_head(float(weight))
        return Event(
            step=step,
            kind=EventKind.PREEMPTION,
            severity="warning",
            message=(
                f"z-loss on: {weight:.3g} * mean(logZ^2) of the output logits joins the training "
                "objective, pulling the log-partition back towards 0"
            ),
            metrics={"action": "enable_z_loss", "weight": float(weight)},
        )

    def disable_z_loss(self, step: int) -> Event:
        """Take z-loss out of the training objective again."""
        was = self.z_loss_weight
        self._unhook_head()
        return Event(
            step=step,
            kind=EventKind.PREEMPTION,
            severity="info",
            message="z-loss off" if was is not None else "z-loss off (it was not on)",
            metrics={"action": "disable_z_loss", "weight": was},
        )

    def _hook_head(self, weight: float) -> None:
        head = self.structure.head
        if head is None:
            raise TrainguardError(
                "z-loss needs the model's output head: none was found (no "
                "get_output_embeddings(), no Linear as wide as the vocabulary)"
            )
        self._unhook_head()
        self.z_loss_weight = weight

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if (
                isinstance(output, torch.Tensor)
                and output.requires_grad
                and module.training
                and torch.is_grad_enabled()
            ):
                return ZLossGrad.apply(output, weight)  # type: ignore[no-untyped-call]
            return None

        self._z_hook = head.register_forward_hook(hook)

    def _unhook_head(self) -> None:
        if self._z_hook is not None:
            self._z_hook.remove()
        self._z_hook = None
        self.z_loss_weight = None

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: z-loss's weight (None: off) and the rescales done."""
        return {"z_loss_weight": self.z_loss_weight, "rescales": [dict(r) for r in self.rescales]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`: z-loss switched as it was (the rescaled weights come back with
        the model's own state)."""
        weight = state.get("z_loss_weight")
        self.rescales = [
            {"step": int(r["step"]), "layer": str(r["layer"]), "factor": float(r["factor"])}
            for r in state.get("rescales", [])
        ]
        if weight is None:
            self._unhook_head()
        else:
            self._hook_head(float(weight))


def _scale_qk(site: AttentionSite, root: float) -> None:
    """Multiply the parameters that make q and k of `site` by `root` each."""
    if site.q_norm is not None and site.k_norm is not None:
        for norm in (site.q_norm, site.k_norm):
            weight = getattr(norm, "weight", None)
            if not isinstance(weight, torch.Tensor):
                raise TrainguardError(
                    f"attention layer {site.layer} normalises q and k without a learned weight: "
                    "its logits cannot be rescaled"
                )
            weight.mul_(root)
            bias = getattr(norm, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.mul_(root)
        return
    if site.kind == "separate":
        assert site.q is not None and site.k is not None
        for proj in (site.q, site.k):
            _scale_param(proj, "weight", root)
            _scale_param(proj, "bias", root)
        return
    if site.kind == "mha":
        mha = site.module
        assert isinstance(mha, nn.MultiheadAttention)
        e = mha.embed_dim
        if mha.in_proj_weight is not None:
            mha.in_proj_weight[: 2 * e].mul_(root)
        else:
            mha.q_proj_weight.mul_(root)
            mha.k_proj_weight.mul_(root)
        if mha.in_proj_bias is not None:
            mha.in_proj_bias[: 2 * e].mul_(root)
        return
    assert site.q is not None
    h, h_kv, d = site.n_heads, site.n_kv_heads, site.head_dim
    weight = site.q.weight
    bias = getattr(site.q, "bias", None)
    assert isinstance(weight, torch.Tensor)
    w = weight.t() if site.transposed else weight  # rows are the output features
    if site.kind == "interleaved":
        per_head = w.view(h, 3, d, -1)
        per_head[:, :2].mul_(root)
        if isinstance(bias, torch.Tensor):
            bias.view(h, 3, d)[:, :2].mul_(root)
        return
    w[: (h + h_kv) * d].mul_(root)
    if isinstance(bias, torch.Tensor):
        bias[: (h + h_kv) * d].mul_(root)


def _scale_param(module: nn.Module, name: str, root: float) -> None:
    value = getattr(module, name, None)
    if isinstance(value, torch.Tensor):
        value.mul_(root)
