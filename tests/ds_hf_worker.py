"""A Hugging Face Trainer run with a DeepSpeed config (ZeRO-2, bf16) on the CPU, in one process,
guarded by `TrainguardCallback`; a NaN loss is planted at one step. Writes what it saw to
`result.json` in the run folder."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.update(
    DS_ACCELERATOR="cpu",
    MASTER_ADDR="127.0.0.1",
    RANK="0",
    WORLD_SIZE="1",
    LOCAL_RANK="0",
    LOCAL_WORLD_SIZE="1",
    OMP_NUM_THREADS="1",
)

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

import trainguard as tg
from trainguard.integrations.hf import TrainguardCallback

STEPS, NAN_AT = 24, 12


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = nn.functional.mse_loss(self.net(x).float(), labels)
        if self.training:
            self.calls += 1
            if self.calls == NAN_AT + 1:  # the forward of step NAN_AT
                loss = loss * float("nan")
        return {"loss": loss}


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        w = torch.randn(16, 1, generator=g)
        self.x = torch.randn(STEPS * 8, 16, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(STEPS * 8, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i].to(torch.bfloat16), "labels": self.y[i]}


def main(out: Path, port: str) -> None:
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    os.environ["MASTER_PORT"] = port
    ds_config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": "auto"},
    }
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        max_steps=STEPS,
        learning_rate=0.01,
        deepspeed=ds_config,
        use_cpu=True,
        bf16=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
    )
    callback = TrainguardCallback(tg.GuardConfig.from_dict({"console": False}), out / "guard")
    model = Regression()
    trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=[callback])
    trainer.train()
    engine = trainer.model_wrapped
    result = {
        "guard": type(callback.guard).__name__,
        "trainer_steps": trainer.state.global_step,
        "guard_steps": callback.guard.global_step if callback.guard else None,
        "engine_steps": engine.global_steps,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "step_restored": "step" not in vars(engine),
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
