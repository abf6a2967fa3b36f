"""Trainguard leaves the process's warning filters alone: importing it adds none, and the one
filter it adds (DCP's single-process warning from its writer thread) is exact and added only
once an asynchronous single-process checkpoint is written."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys
    import warnings

    import torch
    import torch.distributed.checkpoint  # what trainguard imports adds filters of its own (sympy)
    import torch.fx

    before = list(warnings.filters)
    import trainguard
    from trainguard.actions.checkpoints import CheckpointStore

    assert warnings.filters == before, "importing trainguard changed the warning filters"
    with warnings.catch_warnings(record=True) as caught:
        store = CheckpointStore(sys.argv[1], asynchronous=True)
        store.save(1, {"model": {"w": torch.ones(3)}}, {}, {})
        store.wait()
        added = [f for f in warnings.filters if f not in before]
    shown = [str(w.message) for w in caught if "torch.distributed is disabled" in str(w.message)]
    assert not shown, shown
    assert len(added) == 1, added
    action, message, category, module, _ = added[0]
    assert action == "ignore" and category is UserWarning
    assert message.match(
        "torch.distributed is disabled, unavailable or uninitialized, "
        "assuming the intent is to save in a single process."
    )
    assert module.match("torch.distributed.checkpoint.utils")
    assert not module.match("my_project.train") and not message.match("something else")
    print("ok")
    """
)


def test_filters_untouched_on_import_and_one_exact_filter_for_async_saves(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "checkpoints")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
