"""`sinks_from_config`: the alert and metrics sinks a config asks for."""

from __future__ import annotations

import os
from collections.abc import Callable

from trainguard.config import AlertsConfig
from trainguard.sinks.alerts import AlertSink, Channel, ConsoleChannel, EmailChannel, WebhookChannel
from trainguard.sinks.base import Sink


def sinks_from_config(config: AlertsConfig, report: Callable[[str], None]) -> list[Sink]:
    """Webhook (when a URL is configured or in its environment variable), email (when a host
    is), console alerts (when a rule names them), Prometheus (when a port is), TensorBoard
    (when a directory is) and Weights & Biases (when a project is)."""
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
        from trainguard.sinks.prometheus import PrometheusSink

        sinks.append(PrometheusSink(config.prometheus_port))
    if config.tensorboard_dir is not None:
        from trainguard.sinks.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(config.tensorboard_dir, report))
    if config.wandb_project is not None:
        from trainguard.sinks.wandb_sink import WandbSink

        sinks.append(WandbSink(config.wandb_project, config.wandb_mode))
    return sinks
