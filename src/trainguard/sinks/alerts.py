"""Alerts: rules pick the events worth waking someone for, each channel gets one alert per kind
per interval (with a count of what was held back), and a background worker delivers them with
retries, so a slow or broken service never slows training."""

from __future__ import annotations

import contextlib
import queue
import smtplib
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import EmailMessage
from typing import TYPE_CHECKING, Any

from trainguard.config import AlertsConfig, EmailConfig, WebhookConfig
from trainguard.events import SEVERITY_RANK, ConfigError, Event, TrainguardError
from trainguard.sinks.base import Sink

if TYPE_CHECKING:
    import httpx

Report = Callable[[str], None]


@dataclass
class Alert:
    """What a channel sends: a title, a few lines, and the event's figures."""

    kind: str
    severity: str
    step: int
    title: str
    text: str
    held_back: int = 0
    figures: dict[str, Any] = field(default_factory=dict)

    def body(self) -> str:
        more = f"\n({self.held_back} more {self.kind} alert(s) held back)" if self.held_back else ""
        return f"{self.text}{more}"


class Channel:
    """Where alerts go; `send` raises on failure and is called from the delivery thread."""

    name = "channel"

    def send(self, alert: Alert) -> None:
        raise NotImplementedError


class WebhookChannel(Channel):
    """POSTs a Slack-compatible `{"text": ...}` or a plain JSON alert to a URL kept secret;
    needs httpx (the `alerts` extra), a ConfigError at construction without it."""

    name = "webhook"

    def __init__(self, config: WebhookConfig, url: str) -> None:
        try:
            import httpx
        except ImportError:
            raise ConfigError(
                f"webhook alerts (alerts.webhook.url or ${config.url_env}) need httpx: "
                "pip install 'trainguard[alerts]'"
            ) from None
        self.config = config
        self._url = url
        self._client: httpx.Client = httpx.Client(timeout=config.timeout_s)

    def send(self, alert: Alert) -> None:
        if self.config.format == "slack":
            payload: dict[str, Any] = {
                "text": f"*trainguard {alert.severity}* {alert.title}\n{alert.body()}"
            }
        else:
            payload = {
                "kind": alert.kind,
                "severity": alert.severity,
                "step": alert.step,
                "title": alert.title,
                "text": alert.body(),
                "held_back": alert.held_back,
                "figures": alert.figures,
            }
        response = self._client.post(self._url, json=payload)
        if response.status_code >= 300:
            raise DeliveryError(f"HTTP {response.status_code}")

    def close(self) -> None:
        self._client.close()


class EmailChannel(Channel):
    """Sends an email per alert through SMTP, with STARTTLS and login when configured."""

    name = "email"

    def __init__(self, config: EmailConfig, password: str | None) -> None:
        if not config.host or not config.to:
            raise TrainguardError("email alerts need alerts.email.host and alerts.email.to")
        self.config = config
        self._password = password
        self.tls_context = ssl.create_default_context(cafile=config.cafile)

    def send(self, alert: Alert) -> None:
        cfg = self.config
        message = EmailMessage()
        message["Subject"] = f"[trainguard {alert.severity}] {alert.title}"
        message["From"] = cfg.sender
        message["To"] = ", ".join(cfg.to)
        message.set_content(alert.body())
        assert cfg.host is not None
        with smtplib.SMTP(cfg.host, cfg.port, timeout=cfg.timeout_s) as smtp:
            if cfg.starttls:
                smtp.starttls(context=self.tls_context)
            if cfg.user and self._password is not None:
                smtp.login(cfg.user, self._password)
            smtp.send_message(message)


class ConsoleChannel(Channel):
    """Alerts on the console, through the same rules and deduplication."""

    name = "console"

    def __init__(self, report: Report) -> None:
        self.report = report

    def send(self, alert: Alert) -> None:
        self.report(f"ALERT {alert.title}: {alert.body()}")


class DeliveryError(Exception):
    """A failed send, described without the destination (which may hold a secret)."""


def describe_failure(exc: BaseException) -> str:
    """A failure in words that never include a URL, a host's credentials or a password."""
    if isinstance(exc, DeliveryError):
        return str(exc)
    web = sys.modules.get("httpx")  # only a webhook, which imported it, raises its errors
    if web is not None and isinstance(exc, web.TimeoutException):
        return "timed out"
    if web is not None and isinstance(exc, web.HTTPError):
        return f"HTTP error ({type(exc).__name__})"
    if isinstance(exc, smtplib.SMTPAuthenticationError):
        return f"SMTP login refused ({exc.smtp_code})"
    if isinstance(exc, smtplib.SMTPException):
        return f"SMTP error ({type(exc).__name__})"
    return type(exc).__name__


class Delivery:
    """A channel's background sender: a bounded queue, retries with doubling backoff, and one
    report when it keeps failing (and one when it works again)."""

    def __init__(self, channel: Channel, config: AlertsConfig, report: Report) -> None:
        self.channel = channel
        self.config = config
        self.report = report
        self.queue: queue.Queue[Alert | None] = queue.Queue(maxsize=config.queue_size)
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"trainguard-{channel.name}", daemon=True
        )
        self._thread.start()

    def submit(self, alert: Alert) -> None:
        """Queue an alert without ever blocking; a full queue drops it (counted)."""
        try:
            self.queue.put_nowait(alert)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            alert = self.queue.get()
            if alert is None:
                return
            self._deliver(alert)

    def _deliver(self, alert: Alert) -> None:
        last = ""
        for attempt in range(self.config.retries + 1):
            try:
                self.channel.send(alert)
            except Exception as exc:  # any failure of a remote service: retried, then reported
                last = describe_failure(exc)
                if self._stop.wait(self.config.backoff_s * 2**attempt):
                    break
                continue
            self.sent += 1
            if self._failing:
                self._failing = False
                self.report(f"{self.channel.name} alerts are delivered again")
            return
        self.failed += 1
        if not self._failing:
            self._failing = True
            self.report(
                f"{self.channel.name} alerts are failing ({last}); training goes on, "
                "later failures are not reported"
            )

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued within `timeout_s`, then stop (never hangs the end of a run)."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):
            self.queue.put(None, timeout=max(0.0, timeout_s))
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        close = getattr(self.channel, "close", None)
        if callable(close):
            close()


class AlertSink(Sink):
    """Routes events by the rules to each channel, at most one per kind per `interval_s` per
    channel, with a count of those held back; says so when a rollback resolves an alerted
    incident. It detects nothing: the original loss-over-EMA check is `LossEmaDetector`."""

    def __init__(
        self,
        config: AlertsConfig,
        channels: list[Channel],
        report: Report,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.deliveries = {c.name: Delivery(c, config, report) for c in channels}
        self.clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}
        self._open: dict[str, int] = {}  # channel -> step of the last alerted incident

    def on_event(self, event: Event) -> None:
        if event.kind == "rollback":
            self._resolved(event)
        for name in self.deliveries:
            if self._matches(event, name):
                self._offer(name, event)

    def _matches(self, event: Event, channel: str) -> bool:
        rank = SEVERITY_RANK[event.severity]
        return any(
            channel in rule.sinks
            and rank >= SEVERITY_RANK[rule.min_severity]
            and (not rule.kinds or event.kind in rule.kinds)
            for rule in self.config.rules
        )

    def _offer(self, channel: str, event: Event) -> None:
        key = (channel, event.kind)
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.config.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return
        self._last[key] = now
        kind = event.kind.replace("_", " ") + (f" ({event.type})" if event.type else "")
        rank = f" on rank {event.rank}" if event.rank is not None else ""
        alert = Alert(
            kind=event.kind,
            severity=event.severity,
            step=event.step,
            title=f"{kind} at step {event.step}{rank}",
            text=event.message + (f" (action: {event.action})" if event.action else ""),
            held_back=self._held.pop(key, 0),
            figures={k: v for k, v in event.to_dict()["metrics"].items() if _plain(v)},
        )
        self._open[channel] = event.step
        self.deliveries[channel].submit(alert)

    def _resolved(self, event: Event) -> None:
        for channel, step in list(self._open.items()):
            del self._open[channel]
            self.deliveries[channel].submit(
                Alert(
                    kind="resolved",
                    severity="info",
                    step=event.step,
                    title=f"resolved after rollback at step {event.step}",
                    text=f"the incident alerted at step {step}: {event.message}",
                )
            )

    def close(self) -> None:
        """Send one summary of what is still held back, then stop the workers."""
        for (channel, kind), count in sorted(self._held.items()):
            self.deliveries[channel].submit(
                Alert(
                    kind=kind,
                    severity="info",
                    step=-1,
                    title=f"{count} more {kind.replace('_', ' ')} alert(s) held back",
                    text=f"within {self.config.interval_s:g} s of the last one",
                )
            )
        self._held.clear()
        for delivery in self.deliveries.values():
            delivery.close()


def _plain(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None
