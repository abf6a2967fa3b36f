"""trace_nonfinite: planted faults traced to the right module, op and direction."""

from __future__ import annotations

import math

import torch
from torch import nn

import trainguard as tg


class LogFeature(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.relu())  # log(0) where x <= 0


class NoEpsNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(-1, keepdim=True)) / x.var(-1, keepdim=True)  # no epsilon


class HalfAttentionScores(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.half()
        return (q @ q.transpose(-1, -2)).float().softmax(-1)


class SqrtOfSquare(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * 0)  # finite forward; the gradient of sqrt at 0 is infinite


def trace(model: nn.Module, x: torch.Tensor) -> tg.NonFiniteReport:
    return tg.trace_nonfinite(model, lambda: model(x).sum())


def test_log_zero_in_a_custom_module_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogFeature(), nn.Linear(4, 1))
    origin = trace(model, torch.randn(3, 4)).origin
    assert origin is not None
    assert (origin.module, origin.module_type, origin.direction) == ("1", "LogFeature", "forward")
    assert origin.op == "aten.log.default" and "log of zero" in origin.hint
    assert "torch.log(x.relu())" in origin.frames[-1]  # the user's line, not torch's


def test_division_by_a_zero_variance():
    model = nn.Sequential(nn.Linear(4, 4), NoEpsNorm())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)  # constant features: variance 0
    origin = trace(model, torch.randn(3, 4)).origin
    assert origin is not None and origin.module_type == "NoEpsNorm"
    assert origin.direction == "forward" and origin.op.startswith("aten.div")
    assert "division by zero" in origin.hint


def test_fp16_overflow_in_attention_scores_with_the_headroom_hint():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), HalfAttentionScores())
    with torch.no_grad():
        model[0].weight.mul_(300)
    report = trace(model, torch.randn(2, 8, 64))
    origin = report.origin
    assert origin is not None and origin.module_type == "HalfAttentionScores"
    assert origin.direction == "forward" and "bmm" in origin.op
    assert "float16 overflow" in origin.hint and "65504" in origin.hint
    linear = next(r for r in report.records if r.module == "0" and r.direction == "forward")
    assert linear.absmax > 100 and linear.nonfinite == 0 and linear.headroom < 1
    assert linear.parameters is not None and linear.parameters.absmax > 10  # weights x300
    assert linear.inputs is not None and linear.inputs.nonfinite == 0
    scores = next(r for r in report.records if r.module == "1" and r.direction == "forward")
    assert scores.outputs.dtype == "float32" and scores.inputs.dtype == "float32"
    grads = [r for r in report.records if r.direction == "backward"]
    assert grads and all(r.parameters is None for r in grads)


def test_sqrt_at_zero_is_nan_only_in_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfSquare(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    assert torch.isfinite(model(x)).all()  # the forward is clean
    origin = trace(model, x).origin
    assert origin is not None and origin.direction == "backward"
    assert origin.module_type == "SqrtOfSquare" and "SqrtBackward0" in origin.op
    assert "gradient of sqrt" in origin.hint


def test_a_nan_weight_after_a_bad_update():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        model[2].weight[0, 1] = math.nan
    origin = trace(model, torch.randn(3, 4)).origin
    assert origin is not None and origin.direction == "parameter"
    assert origin.module == "2" and "2.weight" in origin.hint


def test_a_step_that_stays_finite_on_replay_is_transient():
    model = nn.Linear(4, 1)
    report = trace(model, torch.randn(3, 4))
    assert report.transient and "transient" in report.describe()
    assert [r.module for r in report.records] == ["", ""]  # forward and backward of the root
    assert not model._forward_hooks and not model._forward_pre_hooks  # the hooks are gone
    assert not model._backward_hooks and not model._backward_pre_hooks
    assert trace(model, torch.randn(3, 4)).transient
