"""Alerts and metrics sinks against real services on localhost: a webhook server, an SMTP server
with STARTTLS and login (aiosmtpd), a Prometheus scrape, TensorBoard files read back."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torch import nn

import trainguard as tg
from trainguard.sinks.prometheus import PrometheusSink

EXE = str(Path(sys.executable).with_name("trainguard"))
SECRET_PATH = "/hooks/T000-SECRET-abc123"
SECRET_PASSWORD = "PW-SECRET-xyz789"


class Hook:
    """A local webhook server that records JSON bodies and answers as told."""

    def __init__(self, status: int = 200, delay_s: float = 0.0) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                hook.bodies.append(json.loads(self.rfile.read(length)))
                hook.paths.append(self.path)
                time.sleep(delay_s)
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}{SECRET_PATH}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def train(config: dict, run_dir: Path | None, nan_at=(30, 31, 40), steps: int = 60) -> tg.Guard:
    """A tiny guarded regression with NaN losses planted at `nan_at`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = tg.GuardConfig.from_dict({"console": False, **config})
    guard = tg.Guard(model, opt, config=cfg, run_dir=run_dir)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :1])
        if step in nan_at:
            loss = loss * float("nan")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        guard.step(loss)
    guard.close()
    return guard


def test_a_webhook_gets_one_alert_per_kind_and_a_summary_of_the_rest(tmp_path):
    hook = Hook()
    try:
        train({"alerts": {"webhook": {"url": hook.url}}}, tmp_path)
    finally:
        hook.close()
    texts = [b["text"] for b in hook.bodies]
    assert len(texts) == 2, texts
    assert "nonfinite at step 30" in texts[0] and texts[0].startswith("*trainguard critical*")
    assert "2 more nonfinite alert(s) held back" in texts[1]


def test_plain_json_webhooks_and_the_rules_decide_what_goes(tmp_path):
    hook = Hook()
    config = {
        "alerts": {
            "webhook": {"url": hook.url, "format": "json"},
            "interval_s": 0,
            "rules": [{"kinds": ["nonfinite"], "min_severity": "critical"}],
        }
    }
    try:
        train(config, None, nan_at=(30, 40))
    finally:
        hook.close()
    assert [(b["kind"], b["step"]) for b in hook.bodies] == [("nonfinite", 30), ("nonfinite", 40)]
    assert hook.bodies[0]["figures"]["loss"] == "nan"


@pytest.mark.parametrize(
    ("status", "delay", "why"), [(500, 0.0, "HTTP 500"), (200, 3.0, "timed out")]
)
def test_a_failing_or_hanging_webhook_is_reported_once_and_never_stops_training(
    capfd, status, delay, why
):
    hook = Hook(status=status, delay_s=delay)
    config = {
        "alerts": {
            "webhook": {"url": hook.url, "timeout_s": 0.3},
            "interval_s": 0,
            "retries": 1,
            "backoff_s": 0.01,
        }
    }
    start = time.perf_counter()
    try:
        guard = train(config, None, nan_at=(30, 35, 40, 45))
    finally:
        hook.close()
    assert time.perf_counter() - start < 30  # close() waits a bounded time, never for the hook
    assert guard.action_counts["skip"] == 4 and guard.global_step == 60
    err = capfd.readouterr().err
    assert err.count("webhook alerts are failing") == 1 and why in err
    assert SECRET_PATH not in err


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            str(folder / "key.pem"),
            "-out",
            str(folder / "cert.pem"),
        ],
        check=True,
        capture_output=True,
    )
    return folder / "cert.pem", folder / "key.pem"


class Mailbox:
    """aiosmtpd on localhost: STARTTLS required, AUTH LOGIN/PLAIN checked against a password."""

    def __init__(self, cert: Path, key: Path) -> None:
        from aiosmtpd.controller import Controller
        from aiosmtpd.smtp import AuthResult

        self.messages: list[str] = []
        self.logins: list[tuple[str, bool]] = []
        box = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                box.messages.append(envelope.content.decode())
                return "250 OK"

        def authenticator(server, session, envelope, mechanism, auth_data):
            ok = auth_data.password.decode() == SECRET_PASSWORD
            box.logins.append((auth_data.login.decode(), ok))
            return AuthResult(success=ok)

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert), str(key))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.controller = Controller(
            Handler(),
            hostname="127.0.0.1",
            port=self.port,
            tls_context=context,
            require_starttls=True,
            authenticator=authenticator,
            auth_required=True,
        )
        self.controller.start()


def test_email_alerts_go_through_starttls_and_login(tmp_path, certificate):
    cert, key = certificate
    box = Mailbox(cert, key)
    email = {
        "host": "localhost",
        "port": box.port,
        "user": "ops",
        "password": SECRET_PASSWORD,
        "to": ["oncall@example.com"],
        "cafile": str(cert),
    }
    try:
        train({"alerts": {"email": email}}, tmp_path, nan_at=(30,))
    finally:
        box.controller.stop()
    assert box.logins == [("ops", True)]
    assert len(box.messages) == 1 and "nonfinite at step 30" in box.messages[0]
    assert "Subject: [trainguard critical]" in box.messages[0]


def test_a_refused_login_is_reported_without_the_password(certificate):
    from trainguard.config import AlertsConfig, EmailConfig
    from trainguard.sinks.alerts import AlertSink, EmailChannel

    cert, key = certificate
    box = Mailbox(cert, key)
    email = EmailConfig(
        host="localhost", port=box.port, user="ops", to=["oncall@example.com"], cafile=str(cert)
    )
    reports: list[str] = []
    sink = AlertSink(
        AlertsConfig(retries=0, email=email),
        [EmailChannel(email, "wrong-" + SECRET_PASSWORD)],
        reports.append,
    )
    try:
        sink.on_event(tg.Event(step=3, kind="nonfinite", severity="critical", message="nan"))
        delivery = sink.deliveries["email"]
        deadline = time.monotonic() + 60
        while delivery.failed == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        sink.close()
    finally:
        box.controller.stop()
    assert box.logins == [("ops", False)]
    assert len(reports) == 1 and reports[0].startswith("email alerts are failing (SMTP")
    assert SECRET_PASSWORD not in reports[0]


def test_secrets_never_reach_a_file_or_the_console(tmp_path, monkeypatch, capfd):
    hook = Hook(status=500)
    monkeypatch.setenv("TRAINGUARD_WEBHOOK_URL", hook.url)
    config = {
        "alerts": {
            "retries": 0,
            "email": {
                "host": "127.0.0.1",
                "port": 9,
                "user": "ops",
                "password": SECRET_PASSWORD,
                "to": ["x@example.com"],
                "timeout_s": 0.5,
            },
        }
    }
    try:
        train(config, tmp_path / "run")
    finally:
        hook.close()
    assert hook.paths and hook.paths[0] == SECRET_PATH  # the URL came from the environment
    report = subprocess.run(
        [EXE, "report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert report.returncode == 0, report.stderr
    config_back = tg.GuardConfig.load(tmp_path / "run" / "config.json")
    assert config_back.alerts.email.password is None  # the mask is not taken for a password
    outputs = [p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file()]
    captured = capfd.readouterr()
    outputs += [captured.out, captured.err, report.stdout, report.stderr]
    for secret in (SECRET_PATH, "abc123", SECRET_PASSWORD):
        assert not any(secret in text for text in outputs), secret


def test_prometheus_endpoint_is_scraped_with_the_runs_figures(tmp_path):
    torch.manual_seed(0)
    guard = train({"alerts": {"prometheus_port": 0}}, None, nan_at=(30, 40))
    sink = next(s for s in guard.sinks if isinstance(s, PrometheusSink))
    # closed with the run: scrape a fresh one fed the same way
    live = PrometheusSink(0, addr="127.0.0.1")
    try:
        live.on_metrics(
            {
                "step": 10,
                "elapsed_s": 1.0,
                "loss": 2.5,
                "grad_norm": 0.7,
                "lr": 3e-4,
                "action": "step",
            }
        )
        live.on_metrics(
            {
                "step": 20,
                "elapsed_s": 2.0,
                "loss": 2.4,
                "grad_norm": 0.6,
                "lr": 3e-4,
                "action": "skip",
            }
        )
        live.on_event(tg.Event(step=20, kind="nonfinite", severity="critical", message="nan"))
        text = httpx.get(f"http://127.0.0.1:{live.port}/metrics", timeout=5).text
    finally:
        live.close()
    assert "trainguard_loss 2.4" in text and "trainguard_steps_per_second 10.0" in text
    assert 'trainguard_incidents_total{kind="nonfinite"} 1.0' in text
    assert "trainguard_skips_total 1.0" in text
    assert sink.skips._value.get() == 2.0  # the run's own sink counted its two skips


def test_tensorboard_scalars_histograms_and_incidents_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train({"alerts": {"tensorboard_dir": str(tmp_path / "tb")}}, None, nan_at=(30,))
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert len(acc.Scalars("train/loss")) == 59  # the NaN step is not drawn as a point
    assert "grad_norm/groups" in tags["histograms"]
    assert any(t.startswith("grad_norm_group/") for t in tags["scalars"])
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("incidents/text_summary")]
    assert any("nonfinite" in t for t in texts)


def test_the_console_keeps_a_live_status_line_with_health_and_eta():
    import io

    from rich.console import Console

    from trainguard.sinks import ConsoleSink

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140, color_system="standard")
    sink = ConsoleSink(console, status=True, total_steps=200)
    sink.on_metrics({"step": 10, "loss": 2.5, "grad_norm": 0.75, "lr": 3e-4, "action": "step"})
    assert "step 10" in sink.status({"step": 10, "loss": 2.5, "grad_norm": 0.75})
    assert "[green]" in sink.status({"step": 10, "loss": 2.5})
    sink.on_event(
        tg.Event(step=11, kind="nonfinite", severity="critical", message="the loss is nan")
    )
    line = sink.status({"step": 12, "loss": float("nan"), "action": "skip"})
    assert "[red]" in line and "skip" in line
    assert "[green]" in sink.status({"step": 11 + 100, "loss": 2.0})  # health returns
    sink.on_metrics({"step": 12, "loss": 2.4, "grad_norm": 0.7, "action": "skip"})
    sink.close()
    text = out.getvalue()
    assert "trainguard step 11 CRITICAL nonfinite" in text and "13/200" in text


def test_weights_and_biases_in_offline_mode(tmp_path, monkeypatch):
    from trainguard.sinks.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(project="tg-test", mode="offline", directory=str(tmp_path))
    for step in range(20):
        sink.on_metrics(
            {
                "step": step,
                "loss": 3.0 - step * 0.01,
                "grad_norm": 0.5,
                "group_grad_norms": {"blocks.0": 0.3},
            }
        )
    sink.on_event(tg.Event(step=12, kind="nonfinite", severity="critical", message="nan"))
    sink.on_event(tg.Event(step=13, kind="stall", severity="info", message="flat"))
    summary = sink.run.summary
    assert summary["incidents/nonfinite"] == 1 and sink.counts == {"nonfinite": 1}
    # W&B commits a step's row when the next step is logged: the summary holds step 18 or 19
    assert summary["train/loss"] == pytest.approx(2.81, abs=0.011)
    assert summary["grad_norm_group/blocks.0"] == pytest.approx(0.3)
    sink.close()
    (run,) = list((tmp_path / "wandb").glob("offline-run-*"))
    (log,) = list(run.glob("*.wandb"))  # the run's log, for a later `wandb sync`
    # W&B's service process writes it on its own: on a loaded machine after `finish` returns
    deadline = time.monotonic() + 120
    while log.stat().st_size <= 1000 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert log.stat().st_size > 1000


class Recorder:
    """A channel that keeps what it was sent."""

    name = "webhook"

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, alert) -> None:
        self.sent.append(alert)


def test_deduplication_by_kind_and_interval_and_a_note_when_a_rollback_resolves_it():
    from trainguard.config import AlertsConfig
    from trainguard.detectors import MetricPoint
    from trainguard.detectors.loss_ema import LossEmaDetector
    from trainguard.sinks.alerts import AlertSink

    now = [0.0]
    channel = Recorder()
    sink = AlertSink(AlertsConfig(interval_s=60), [channel], print, clock=lambda: now[0])

    def event(step: int, kind: str = "nonfinite", severity: str = "critical") -> tg.Event:
        return tg.Event(step=step, kind=kind, severity=severity, message=f"{kind} {step}")

    sink.on_event(event(10))
    now[0] = 30.0
    sink.on_event(event(11))  # held back: the same kind within the interval
    sink.on_event(event(12, "grad_explosion", "warning"))  # another kind goes
    sink.on_event(event(13, "stall", "info"))  # no rule matches it
    now[0] = 75.0
    sink.on_event(event(14))  # the interval is over: sent, with the count held back
    sink.on_event(tg.Event(step=15, kind="rollback", severity="warning", message="back to 0"))
    ema = LossEmaDetector(AlertsConfig())  # the seed's check: loss over 3 x its EMA
    for step in [20, 21, 22, 5, *range(30, 60)]:
        assert ema.update(MetricPoint(step, 1.0)) == []
    for e in ema.update(MetricPoint(60, 5.0)):
        sink.on_event(e)  # an info event, routed by the default rule that names it
    sink.close()
    got = [(a.kind, a.step, a.held_back) for a in channel.sent]
    assert got[:5] == [
        ("nonfinite", 10, 0),
        ("grad_explosion", 12, 0),
        ("nonfinite", 14, 1),
        ("resolved", 15, 0),
        ("loss_above_ema", 60, 0),
    ]
    assert "resolved after rollback at step 15" in channel.sent[3].title


def spiked_run(config: dict, run_dir: Path | None, spike_at: int = 45) -> list[tg.Decision]:
    """A tiny guarded regression whose loss is 500 times its value at `spike_at`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = tg.Guard(
        model, opt, config=tg.GuardConfig.from_dict({"console": False, **config}), run_dir=run_dir
    )
    g = torch.Generator().manual_seed(1)
    decisions = []
    for step in range(60):
        x = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :1]) * (500.0 if step == spike_at else 1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        decisions.append(guard.step(loss))
    guard.close()
    return decisions


def test_a_loss_over_its_ema_is_an_info_event_alerted_that_changes_no_decision(tmp_path):
    hook = Hook()
    try:
        alerted = spiked_run(
            {"alerts": {"webhook": {"url": hook.url, "format": "json"}, "interval_s": 0}},
            tmp_path,
        )
    finally:
        hook.close()
    ema = [b for b in hook.bodies if b["kind"] == "loss_above_ema"]
    assert [(b["severity"], b["step"]) for b in ema] == [("info", 45)]
    assert "is over 3 x its EMA" in ema[0]["text"]
    logged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["severity"], e["step"]) for e in logged if e["kind"] == "loss_above_ema"] == [
        ("info", 45)
    ]
    # without a rule that routes it the detector is off: the guard decides exactly the same
    quiet = spiked_run({"alerts": {"rules": [{"kinds": ["nonfinite"]}]}}, tmp_path / "quiet")
    assert not any(e.kind == "loss_above_ema" for d in quiet for e in d.events)

    def seen(decisions: list[tg.Decision]) -> list[tuple]:
        return [
            (d.action, d.lr_factor, [e.kind for e in d.events if e.kind != "loss_above_ema"])
            for d in decisions
        ]

    assert seen(alerted) == seen(quiet)


def test_the_loss_ema_check_in_bulk_matches_it_step_by_step():
    from trainguard.config import AlertsConfig
    from trainguard.detectors.loss_ema import LossEmaDetector
    from trainguard.detectors.series import MetricSeries

    rng = np.random.default_rng(0)
    loss = 2 + rng.random(5000)
    loss[[3, 700, 701, 2500, 4000]] *= 10  # the first too early to count
    loss[[10, 702, 3000]] = np.nan
    series = MetricSeries(np.arange(5000, dtype=np.int64), loss)
    one, bulk = LossEmaDetector(AlertsConfig()), LossEmaDetector(AlertsConfig())
    expected = [e for i in range(len(series)) for e in one.update(series.point(i))]
    got, i = [], 0
    while i < len(series):
        i = bulk.advance(series, i)
        if i < len(series):
            got += bulk.update(series.point(i))
            i += 1
    assert [e.step for e in expected] == [700, 701, 2500, 4000]
    assert [(e.step, e.message) for e in got] == [(e.step, e.message) for e in expected]
    assert bulk.seen == one.seen and bulk.ema == pytest.approx(one.ema, rel=1e-12)
