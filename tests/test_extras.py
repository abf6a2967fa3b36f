"""Optional extras: plotly (`report`), prometheus-client (`prometheus`) and httpx (`alerts`) are
imported only where they are used, and a missing one is one line that names the extra."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.cli import main

EXTRAS = ("plotly", "prometheus_client", "httpx")


def guard(config: dict, run_dir: Path | None = None) -> tg.Guard:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = tg.GuardConfig.from_dict({"console": False, **config})
    return tg.Guard(model, opt, config=cfg, run_dir=run_dir)


def test_trainguard_its_cli_and_a_plain_guard_import_none_of_the_extras(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        import torch
        import trainguard as tg
        import trainguard.cli
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = tg.GuardConfig(console=False)
        guard = tg.Guard(model, opt, config=config, run_dir={str(tmp_path)!r})
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            guard.step(loss)
        guard.close()
        print(sorted(m for m in {EXTRAS!r} if m in sys.modules))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_report_command_without_plotly_names_the_report_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "plotly", None)  # `import plotly` raises ImportError
    out, err = io.StringIO(), io.StringIO()
    argv = ["trainguard", "report", str(tmp_path), "-o", str(tmp_path / "report.html")]
    with (
        mock.patch.object(sys, "argv", argv),
        redirect_stdout(out),
        redirect_stderr(err),
        pytest.raises(SystemExit) as exit,
    ):
        main()
    assert exit.value.code == 2
    assert err.getvalue().strip() == (
        "error: the HTML report needs plotly: pip install 'trainguard[report]'"
    )
    assert not (tmp_path / "report.html").exists()


def test_prometheus_without_its_package_is_a_config_error_at_construction(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(tg.ConfigError, match=r"pip install 'trainguard\[prometheus\]'$"):
        guard({"alerts": {"prometheus_port": 0}}, tmp_path)
    guard({}, tmp_path).close()  # the run dir was left free


def test_a_webhook_without_httpx_is_a_config_error_at_construction(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "httpx", None)
    monkeypatch.delenv("TRAINGUARD_WEBHOOK_URL", raising=False)
    config = {"alerts": {"webhook": {"url": "http://127.0.0.1:9/hook"}}}
    with pytest.raises(tg.ConfigError, match=r"need httpx: pip install 'trainguard\[alerts\]'$"):
        guard(config, tmp_path)
    monkeypatch.setenv("TRAINGUARD_WEBHOOK_URL", "http://127.0.0.1:9/hook")
    with pytest.raises(tg.ConfigError, match=r"\$TRAINGUARD_WEBHOOK_URL"):
        guard({}, None)
