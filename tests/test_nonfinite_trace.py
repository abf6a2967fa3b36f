"""trace_nonfinite: planted faults traced to the right module, op and direction."""

from __future__ import annotations

import math

import torch
from torch import nn

import trainguard as tg

from helpers import read_jsonl


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


class MLP(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


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


def test_a_nan_in_the_input_is_the_batch_not_a_transient_fault():
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(32, 4)
    x[3, 1], x[17, 0] = math.nan, math.inf
    report = trace(model, x)
    assert not report.transient and report.origin is not None
    assert report.origin.direction == "input" and report.origin.module == ""
    (bad,) = report.inputs
    assert (bad.name, bad.role, bad.samples, bad.nan, bad.inf) == ("x", "input", [3, 17], 1, 1)
    assert bad.shape == [32, 4] and bad.dtype == "float32"
    message = report.describe()
    assert "the batch holds NaN/Inf in input `x` (samples 3, 17)" in message
    assert "data pipeline" in message and "transient" not in message
    assert any("model(x).sum()" in f for f in report.origin.frames)  # where the batch came in
    assert not model._forward_pre_hooks  # the hooks are gone
    sequential = nn.Sequential(nn.Linear(4, 1))
    assert trace(sequential, x).inputs[0].name == "input"  # Sequential.forward(input)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.linear(x * scale)


def test_a_nan_float_argument_is_named_as_a_scalar_input():
    model = Scaled()
    report = tg.trace_nonfinite(model, lambda: model(torch.randn(3, 4), math.nan).sum())
    assert [(i.name, i.samples, i.shape) for i in report.inputs] == [("scale", [], [])]
    assert "input `scale` (a scalar)" in report.describe()
    clean = tg.trace_nonfinite(model, lambda: model(torch.randn(3, 4), 2.0).sum())
    assert clean.transient and clean.inputs == []


class VisionText(nn.Module):
    """An HF-style model called with keywords: integer ids (never NaN) and float pixels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.pixels = nn.Linear(6, 4)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids).mean(1) + self.pixels(pixel_values)


class BatchDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = VisionText()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.inner(**batch)


def test_inputs_are_named_by_keyword_and_by_place_in_a_dict_and_integers_are_skipped():
    torch.manual_seed(0)
    batch = {"input_ids": torch.randint(10, (8, 5)), "pixel_values": torch.randn(8, 6)}
    batch["pixel_values"][2, 4] = math.nan
    model = VisionText()
    report = tg.trace_nonfinite(model, lambda: model(**batch).sum())
    assert [(i.name, i.samples) for i in report.inputs] == [("pixel_values", [2])]
    wrapped = BatchDict()
    report = tg.trace_nonfinite(wrapped, lambda: wrapped(batch).sum())
    assert [(i.name, i.samples) for i in report.inputs] == [("batch['pixel_values']", [2])]
    assert "input `batch['pixel_values']` (sample 2)" in report.describe()


def test_a_nan_in_the_targets_of_a_loss_outside_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    y[5] = math.nan
    report = tg.trace_nonfinite(model, lambda: nn.functional.mse_loss(model(x), y))
    assert not report.transient and report.origin is not None
    (bad,) = report.inputs
    assert (bad.role, bad.samples, bad.module) == ("external", [5], "")
    assert bad.op is not None and "mse_loss" in bad.op
    assert "outside the model" in report.describe() and "(sample 5)" in report.describe()


def test_a_guarded_run_names_the_nan_input_and_its_samples_and_recovers(tmp_path):
    torch.manual_seed(0)
    model = MLP(16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = tg.Guard(model, opt, config=tg.GuardConfig(console=False), run_dir=tmp_path)
    w = torch.randn(4, 1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(80):
        x = torch.randn(32, 4, generator=g)
        y = x @ w
        if step == 40:  # the loader hands over a corrupt batch
            x[3, 2], x[17, 0] = math.nan, math.nan

        def replay(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return nn.functional.mse_loss(model(x), y)

        loss = replay()
        loss.backward()
        decision = guard.step(loss, replay=replay)
        opt.zero_grad(set_to_none=True)
        if step == 40:
            assert decision.action == "skip"
            (origin,) = [e for e in decision.events if e.kind == "nan_origin"]
        else:
            assert decision.action == "step"
            losses.append(float(loss.detach()))
    guard.close()
    assert origin.severity == "critical" and origin.metrics["transient"] is False
    assert origin.metrics["direction"] == "input"
    assert [(i["name"], i["samples"]) for i in origin.metrics["inputs"]] == [("x", [3, 17])]
    assert "input `x` (samples 3, 17)" in origin.message and "transient" not in origin.message
    logged = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "nan_origin"]
    assert logged[0]["metrics"]["inputs"][0]["samples"] == [3, 17]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.2 * losses[0]


class MaskedScores(nn.Module):
    """Attention-like scores with an additive causal mask (0 or -inf), as a buffer and as an
    input, then log(0) of a module of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("causal", torch.full((3, 3), -math.inf).triu(1))
        self.log = LogFeature()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = (x @ x.T + mask + self.causal).softmax(-1)
        return self.log(scores - 2.0)


def test_an_additive_mask_of_minus_inf_is_not_a_bad_input():
    model = MaskedScores()
    mask = torch.zeros(3, 3)
    mask[0, 2] = -math.inf
    report = tg.trace_nonfinite(model, lambda: model(torch.randn(3, 4), mask).sum())
    assert report.inputs == [] and report.origin is not None
    assert report.origin.module_type == "LogFeature" and report.origin.op == "aten.log.default"
