"""The `trainguard` command: the installed console script where the test is about it (help,
version, the demo), else `main()` in this process (the same code, without an interpreter start)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from trainguard.sinks import load_schema

from helpers import Ran, cli, read_jsonl

EXE = shutil.which("trainguard", path=str(Path(sys.executable).parent))


def run(*args: str, cwd: Path | None = None) -> Ran:
    return cli(*args, cwd=cwd)


def shell(*args: str) -> subprocess.CompletedProcess[str]:
    assert EXE, "the trainguard console script is not installed in this environment"
    env = {**os.environ, "COLUMNS": "200"}  # rich wraps at the terminal width
    return subprocess.run(
        # a guard against a hang, not a speed check: a loaded machine runs the demo for minutes
        [EXE, *args],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
        env=env,
    )


def test_help_and_version():
    out = shell("--help")
    assert out.returncode == 0 and "demo" in out.stdout
    assert shell("version").stdout.strip() == "0.1.0"


def test_config_prints_defaults_and_checks_files(tmp_path):
    out = run("config")
    assert out.returncode == 0 and "z_threshold: 10.0" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss_spike:\n  nope: 1\n")
    out = run("config", str(bad))
    assert out.returncode == 2
    assert out.stderr.startswith("error:") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 2  # one logical line, maybe wrapped


def test_config_reference_prints_the_markdown_reference(tmp_path):
    out = run("config", "--reference")
    assert out.returncode == 0 and out.stdout.startswith("# Configuration reference\n")
    assert "## recovery" in out.stdout and "| `checkpoint_every` | `int` | `500` |" in out.stdout
    with_file = run("config", "--reference", str(tmp_path / "guard.yaml"))
    assert with_file.returncode == 2 and with_file.stderr.startswith("error:")


@pytest.mark.slow(
    "the demo as a user runs it: the console script trains the guarded, unguarded and clean "
    "runs (200 steps each) and writes the report"
)
def test_demo_recovers_from_the_four_planted_incidents(tmp_path):
    out = shell("demo", "--steps", "200", "--run-dir", str(tmp_path / "demo"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    progress = [line for line in text.splitlines() if line.startswith("demo ")]
    assert progress and "guarded step 200/200" in progress[-1]  # plain lines: not a terminal
    for incident in ("toxic batch", "LR blow-up", "NaN in blocks.1.mlp", "divergence"):
        row = next(line for line in text.splitlines() if incident in line and "step" in line)
        assert "not detected" not in row and "not reached" not in row, row
    assert "origin blocks.1.mlp" in text  # the NaN is traced to the module that made it
    assert "revised" in text  # the LR blow-up's first guess, data toxicity, is revised
    assert "guarded run within 2% of the clean run; unguarded run failed." in text
    assert "NaN from step 120 on" in text  # the unguarded run never recovers from the NaN
    events = read_jsonl(tmp_path / "demo" / "events.jsonl")
    for event in events:
        jsonschema.validate(event, load_schema("events"))
    assert (40, "loss_spike", "skip") in [(e["step"], e["kind"], e["action"]) for e in events]
    assert sum(e["kind"] == "rollback" for e in events) >= 2
    assert any(e["kind"] == "nan_origin" for e in events)
    steps = [m["step"] for m in read_jsonl(tmp_path / "demo" / "metrics.jsonl")]
    assert sorted(set(steps)) == list(range(200))  # replayed steps after a rollback repeat
    report = (tmp_path / "demo" / "report.html").read_text()
    assert "trainguard demo" in report and "<script" in report


def test_demo_rejects_too_few_steps(tmp_path):
    out = run("demo", "--steps", "10", "--run-dir", str(tmp_path))
    assert out.returncode == 2 and "at least 200 steps" in out.stderr


def test_lint_a_setup_from_a_file(tmp_path):
    setup = tmp_path / "setup.py"
    setup.write_text(
        "import torch\n"
        "from trainguard.demo import TinyGPT\n"
        "def build():\n"
        "    model = TinyGPT()\n"
        "    return model, torch.optim.Adam(model.parameters(), lr=1e-3)\n"
    )
    out = run("lint", f"{setup}:build", "--json")  # clipped at the guard's 1.0, by default
    assert out.returncode == 1, out.stderr
    codes = {f["code"] for f in json.loads(out.stdout)}
    assert {"no-warmup", "adam-beta2", "residual-init"} <= codes and "no-clipping" not in codes
    unclipped = run("lint", f"{setup}:build", "--max-grad-norm", "0", "--json")
    assert "no-clipping" in {f["code"] for f in json.loads(unclipped.stdout)}
    piped = cli("lint", f"{setup}:build", columns=None)  # no terminal, no COLUMNS: wider than 80
    assert max(len(line) for line in piped.stdout.splitlines()) > 80
    missing = run("lint", f"{tmp_path / 'nope.py'}:build")
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_lint_imports_a_module_from_the_current_folder_and_takes_the_autocast_dtype(tmp_path):
    """`trainguard lint mysetup:build` finds mysetup.py where it runs, as `python -m` would; a
    missing module or function is one line that says what to give."""
    (tmp_path / "mysetup.py").write_text(
        "import torch\n"
        "from trainguard.demo import TinyGPT\n"
        "def build():\n"
        "    model = TinyGPT()\n"
        "    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))\n"
    )
    out = run(
        "lint",
        "mysetup:build",
        "--max-grad-norm",
        "1",
        "--autocast",
        "fp16",
        "--json",
        cwd=tmp_path,
    )
    assert out.returncode == 1, out.stderr
    assert "fp16-no-scaler" in {f["code"] for f in json.loads(out.stdout)}
    bf16 = run("lint", f"{tmp_path / 'mysetup.py'}:build", "--autocast", "bf16", "--json")
    assert bf16.returncode == 1 and "fp16-no-scaler" not in bf16.stdout, bf16.stderr
    for target, says in [
        ("mysetup:nope", "mysetup has no function nope: give mysetup:FUNCTION"),
        ("nosuch:build", "run trainguard from the folder that holds it, or give FILE.py:FUNCTION"),
    ]:
        missing = run("lint", target, cwd=tmp_path)
        assert missing.returncode == 2 and "Traceback" not in missing.stderr
        assert says in " ".join(missing.stderr.split()), missing.stderr
