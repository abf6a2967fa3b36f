"""Checks that need a CUDA device, run on one by hand (never in `make test`, which has none):

    python -m pytest benchmarks/gpu_checks.py

They reuse the CPU tests' helpers (`tests/`), and fail rather than skip without a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import trainguard as tg
from finetune import build, loader
from test_checkpoint_staging import _config, _frozen_bytes, _step


def test_a_cuda_device_is_here() -> None:
    assert torch.cuda.is_available(), "run these checks on a machine with a CUDA device"


def test_on_a_gpu_staging_copies_what_changed_without_a_device_sync(tmp_path, monkeypatch):
    """On a GPU with fused AdamW (whose kernels bump no version counter): no device-wide sync,
    the frozen base neither copied nor hashed at the second save, the head always, and each
    checkpoint holds the weights of its step although training went on during the copy."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.cuda.synchronize on the checkpoint path")

    model, _ = build()
    model.cuda()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=3e-3, fused=True)
    guard = tg.Guard(model, opt, config=_config(every=2), run_dir=tmp_path)
    store = guard.checkpoints
    assert guard.checkpointing is not None and store is not None
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    data = iter(loader())
    live, figures = {}, []
    for _ in range(4):
        (tokens,) = next(data)
        _step(guard, model, tokens.cuda())
        if guard.global_step % 2 == 0:
            live[guard.global_step] = {k: v.cpu() for k, v in model.state_dict().items()}
            guard.checkpoints.wait()  # exact steps for the test: the next save finds it free
            figures.append((store.copied, store.written["hashed"]))
    monkeypatch.undo()
    guard.close()
    assert guard.checkpointing.defers
    frozen = _frozen_bytes(model)
    assert figures[0][0] >= frozen and figures[1][0] < frozen / 4  # the base: once
    assert figures[1][1] <= figures[1][0]  # hashed no more than what was copied
    for step in (2, 4):
        path = tmp_path / "checkpoints" / f"step-{step}"
        tensors, _ = store.load(path, store.verify(path))
        for key, value in live[step].items():
            assert torch.equal(tensors[f"model.{key}"], value), (step, key)
