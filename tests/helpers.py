"""Shared helpers: the demo corpus, reading run files, synthetic loss curves, a real full disk,
and the `trainguard` command run in this process."""

from __future__ import annotations

import errno
import gc
import io
import json
import math
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from trainguard.demo import MarkovCorpus, scenarios
from trainguard.line_writer import flush_writers


@dataclass
class Ran:
    """What one `trainguard` command printed and how it exited."""

    code: int
    out: str
    err: str

    @property
    def returncode(self) -> int:
        return self.code

    @property
    def stdout(self) -> str:
        return self.out

    @property
    def stderr(self) -> str:
        return self.err

    @property
    def error(self) -> str:
        lines = [line for line in self.err.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, self.err
        return lines[0]


def cli(*args: str | Path, cwd: Path | None = None, columns: int | None = 200) -> Ran:
    """`trainguard ARGS` run in this process through `main()`, as the console script runs it (no
    interpreter start); `cwd` the folder it runs in, `columns` the COLUMNS it sees (None: unset).
    The modules a command imported from a user's folder (lint's set-up) are forgotten after it."""
    from trainguard.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_path, saved_modules, saved_cwd = list(sys.path), set(sys.modules), os.getcwd()
    environ = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        environ["COLUMNS"] = str(columns)
    code = 0
    argv = ["trainguard", *map(str, args)]
    with (
        mock.patch.object(sys, "argv", argv),
        mock.patch.dict(os.environ, environ, clear=True),
        redirect_stdout(out),
        redirect_stderr(err),
    ):
        try:
            if cwd is not None:
                os.chdir(cwd)
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        finally:
            os.chdir(saved_cwd)
            sys.path[:] = saved_path
            for name in set(sys.modules) - saved_modules:
                origin = getattr(sys.modules[name], "__file__", None) or ""
                if origin and not origin.startswith((sys.prefix, sys.base_prefix, _SOURCE)):
                    del sys.modules[name]
    return Ran(code, out.getvalue(), err.getvalue())


_SOURCE = str(Path(__file__).resolve().parents[1] / "src")


def corpus() -> MarkovCorpus:
    return scenarios.corpus()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    flush_writers()  # a live guard's lines are written on a thread
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_losses(run_dir: Path) -> dict[int, str]:
    """Step -> exact loss as resume_worker.py logs it; a resumed run's lines replace those of the
    steps it replays."""
    out: dict[int, str] = {}
    for line in (run_dir / "losses.txt").read_text().splitlines():
        step, value = line.split()
        out[int(step)] = value
    return out


class TmpfsDisk:
    """A real tmpfs (mounting one needs root), filled to the last byte by a filler file."""

    kind = "tmpfs"

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.filler = directory / "filler"

    @classmethod
    def mount(cls, directory: Path, size: str = "8m") -> TmpfsDisk | None:
        """The tmpfs mounted on `directory` (made if missing); None where it cannot be."""
        directory.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            return None
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
            capture_output=True,
            check=False,
        )
        return cls(directory) if done.returncode == 0 else None

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for size in (1 << 16, 4096, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * size)
                except OSError as full:
                    assert full.errno == errno.ENOSPC, full
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink()

    def unmount(self) -> None:
        gc.collect()  # files of Guards a failed run left open
        if subprocess.run(["umount", str(self.dir)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(self.dir)], check=True)


def lm_curve(
    steps: int,
    *,
    seed: int = 0,
    start: float = 10.0,
    floor: float = 2.0,
    noise: float = 0.02,
    dof: float = 4.0,
    restarts: tuple[int, ...] = (),
    restart_rise: float = 0.15,
    restart_len: int = 200,
) -> np.ndarray:
    """A realistic LM loss curve: power-law decay, multiplicative Student-t batch noise (heavy
    tails), and optional LR warm restarts that lift the loss smoothly before it falls again."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=np.float64)
    level = floor + (start - floor) * (1.0 + t / 50.0) ** -0.7
    for r in restarts:
        after = np.clip(t - r, 0.0, None)
        bump = (
            restart_rise * (1 - np.exp(-after / (restart_len / 4))) * np.exp(-after / restart_len)
        )
        level = level * (1 + bump)
    scale = noise / math.sqrt(dof / (dof - 2))
    return level * (1.0 + scale * rng.standard_t(dof, size=steps))
