"""Sinks: where events and metrics go (files, console); they observe and never decide."""

from trainguard.sinks.base import Sink
from trainguard.sinks.console import ConsoleSink
from trainguard.sinks.jsonl import EvalLog, EventLog, MetricsLog, load_schema

__all__ = ["ConsoleSink", "EvalLog", "EventLog", "MetricsLog", "Sink", "load_schema"]
