"""tg.scan and `trainguard scan`: toxic samples found offline, and never trained on."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import trainguard as tg
from trainguard.demo import Batch, TinyGPT

from helpers import corpus, read_jsonl

PLANTED = {5, 77, 300}


def trained_model() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in corpus().batches(16, 32, 150, seed=1):
        model.loss(model(batch.x), batch.y).backward()
        opt.step()
        opt.zero_grad()
    return model


def dataset() -> list[Batch]:
    """16 batches of 32 samples (ids 0..511); three samples are random tokens."""
    g = torch.Generator().manual_seed(7)
    batches = []
    for k, b in enumerate(corpus().batches(32, 32, 16, seed=5)):
        ids = list(range(32 * k, 32 * k + 32))
        x, y = b.x.clone(), b.y.clone()
        for i, sample in enumerate(ids):
            if sample in PLANTED:
                noise = torch.randint(64, (33,), generator=g)
                x[i], y[i] = noise[:-1], noise[1:]
        batches.append(Batch(x=x, y=y, ids=ids))
    return batches


def per_sample_loss(model, batch: Batch) -> torch.Tensor:
    logits = model(batch.x)
    return F.cross_entropy(logits.transpose(1, 2), batch.y, reduction="none").mean(1)


def test_scan_finds_the_planted_samples_and_the_guard_honours_them(tmp_path):
    model = trained_model()
    result = tg.scan(
        model, dataset(), per_sample_loss, quarantine_path=tmp_path / "quarantine.jsonl"
    )
    assert {s.id for s in result.flagged} == PLANTED and result.scanned == 512
    assert model.training  # put back as it was
    records = read_jsonl(tmp_path / "quarantine.jsonl")
    assert {r["sample_ids"][0] for r in records} == PLANTED
    guard = tg.Guard(config=tg.GuardConfig(console=False), run_dir=tmp_path)
    seen = [b.ids for b in guard.batches(dataset())]
    assert len(seen) == 16 - 3  # the three batches holding a planted sample never come back


def test_scan_command(tmp_path):
    setup = tmp_path / "scan_setup.py"
    setup.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_scan import trained_model, dataset, per_sample_loss\n"
        "def build():\n"
        "    return trained_model(), dataset(), per_sample_loss\n"
    )
    exe = shutil.which("trainguard", path=str(Path(sys.executable).parent))
    assert exe
    out = subprocess.run(
        [exe, "scan", f"{setup}:build", "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "scanned 512 samples" in out.stdout and "3 flagged" in out.stdout
    assert len(read_jsonl(tmp_path / "run" / "quarantine.jsonl")) == 3


def fitted_classifier() -> tuple[
    torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor, list[int]]]
]:
    """An MLP fitted to 2,000 samples of ten separable classes (training loss ~1e-5), and the
    same samples in batches of 64 with three of them spoiled: two labels flipped, one input
    replaced by large noise."""
    torch.manual_seed(0)
    centres = torch.randn(10, 20) * 4
    y = torch.randint(10, (2000,))
    x = centres[y] + torch.randn(2000, 20)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    x, y = x.clone(), y.clone()
    y[10], y[500] = (y[10] + 1) % 10, (y[500] + 3) % 10
    x[1500] = torch.randn(20) * 30
    return model, [
        (x[i : i + 64], y[i : i + 64], list(range(i, min(i + 64, 2000))))
        for i in range(0, 2000, 64)
    ]


def test_scan_of_a_fitted_classifier_flags_only_the_spoiled_samples(tmp_path):
    model, batches = fitted_classifier()
    result = tg.scan(
        model,
        batches,
        lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"),
        ids=lambda b: b[2],
        quarantine_path=tmp_path / "quarantine.jsonl",
    )
    assert result.scanned == 2000 and result.median_loss < 1e-3  # fitted: the MAD is ~0
    assert {s.id for s in result.flagged} == {10, 500, 1500}
    assert len(read_jsonl(tmp_path / "quarantine.jsonl")) == 3
