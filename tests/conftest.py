"""Session-wide settings: one intra-op thread for torch here and in every process a test spawns,
and the guard against a slower suite: a test over `SLOW_TEST_S` must say why (`slow` marker).

Tiny models gain nothing from several threads, and on a 2-core machine the threads of concurrent
processes (distributed ranks, DeepSpeed workers, pytest's workers) contend and slow every test.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
torch.set_num_threads(1)

SLOW_TEST_S = 20.0  # benchmarks/README.md: the suite's budget and this limit
_seconds: dict[str, float] = defaultdict(float)
_marked_slow: set[str] = set()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"slow(reason): a test that takes over {SLOW_TEST_S:g} s on 2 cores, and why it must",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("slow")
        if marker is not None and not (marker.args and str(marker.args[0]).strip()):
            raise pytest.UsageError(f"{item.nodeid}: give @pytest.mark.slow a reason string")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] += report.duration
    if "slow" in report.keywords:
        _marked_slow.add(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    unexplained = sorted(
        (s, nodeid)
        for nodeid, s in _seconds.items()
        if s > SLOW_TEST_S and nodeid not in _marked_slow
    )
    if unexplained:
        terminalreporter.section(f"tests over {SLOW_TEST_S:g} s without a slow(reason) marker")
        for seconds, nodeid in reversed(unexplained):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
        terminalreporter.write_line(
            'say why each must take this long (@pytest.mark.slow("...")) or make it faster'
        )
