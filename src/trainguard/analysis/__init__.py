"""Offline analysis of an existing training log: the same detectors as a live run."""

from trainguard.analysis.analyzer import Analysis, analyze, spike_score
from trainguard.analysis.logs import LogData, read_log
from trainguard.analysis.run import RunRecord, load_run
from trainguard.analysis.watch import RunWatcher

__all__ = [
    "Analysis",
    "LogData",
    "RunRecord",
    "RunWatcher",
    "analyze",
    "load_run",
    "read_log",
    "spike_score",
]
