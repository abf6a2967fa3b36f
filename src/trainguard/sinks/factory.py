"""`sinks_from_config`: the alert and metrics sinks a config asks for."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainguard.config import AlertsConfig
from trainguard.line_file import describe_os_error
from trainguard.sinks.alerts import AlertSink, Channel, ConsoleChannel, EmailChannel, WebhookChannel
from trainguard.sinks.base import Sink

if TYPE_CHECKING:
    from trainguard.sinks.prometheus import PrometheusSink


def sinks_from_config(config: AlertsConfig, report: Callable[[str], None]) -> list[Sink]:
    """Webhook (when a URL is configured or in its environment variable), email (when a host
    is), console alerts (when a rule names them), Prometheus (when a port is), TensorBoard
    (when a directory is) and Weights & Biases (when a project is). A side service that cannot
    start (a busy Prometheus port) is reported and left out: the run goes on without it."""
    channels: list[Channel] = []
    url = config.webhook.url.get_secret_value() if config.webhook.url else None
    url = url or os.environ.get(config.webhook.url_env) or None
    if url:
        channels.append(WebhookChannel(config.webhook, url))
    if config.email.host:
        password = (
            config.email.password.get_secret_value()
            if config.email.password
            else os.environ.get(config.email.password_env)
        )
        channels.append(EmailChannel(config.email, password))
    if any("console" in rule.sinks for rule in config.rules):
        channels.append(ConsoleChannel(report))
    sinks: list[Sink] = []
    if channels:
        sinks.append(AlertSink(config, channels, report))
    if config.prometheus_port is not None:
        prometheus = _prometheus(config.prometheus_port, config.prometheus_addr, report)
        if prometheus is not None:
            sinks.append(prometheus)
    if config.tensorboard_dir is not None:
        from trainguard.sinks.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(config.tensorboard_dir, report))
    if config.wandb_project is not None:
        from trainguard.sinks.wandb_sink import WandbSink

        sinks.append(WandbSink(config.wandb_project, config.wandb_mode))
    return sinks


def _prometheus(port: int, addr: str, report: Callable[[str], None]) -> PrometheusSink | None:
    """The Prometheus sink on `addr`:`port`, or None after one line saying why it cannot bind
    and what to change."""
    from trainguard.sinks.prometheus import PrometheusSink

    try:
        sink = PrometheusSink(port, addr)
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            fix = "set alerts.prometheus_port to another port, or 0 for a free one"
        else:
            fix = "set alerts.prometheus_addr to an address of this host (0.0.0.0 for all)"
        report(
            f"cannot serve Prometheus /metrics on {addr}:{port} ({describe_os_error(exc)}); "
            f"the run goes on without it: {fix}"
        )
        return None
    if port == 0:
        report(f"serving Prometheus /metrics at http://{_host(addr)}:{sink.port}/metrics")
    return sink


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr
