"""Prepare DeepSpeed for the CPU tests (`make test` runs this first): clear a stale build lock
of its shared-memory op, then build the op once, so that no test waits on a compile; where it is
built already and no build is under way, it does nothing and says nothing.

A compile that was killed leaves `lock` in the op's build folder under torch's extension root
(`TORCH_EXTENSIONS_DIR`, else `~/.cache/torch_extensions`), and every later start waits on it
forever. A lock is stale when no process works in that folder (ninja and the compiler run there)
and it is older than `STALE_AFTER_S`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

OP = "deepspeed_shm_comm"
STALE_AFTER_S = 60.0


def extension_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "torch_extensions"


def busy(folder: Path) -> bool:
    """Whether a live process has its working directory in `folder` (Linux's /proc)."""
    target = str(folder.resolve())
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            return True
    return False


def clear_stale_locks(root: Path, now: float) -> list[Path]:
    """Remove the op's build locks that no build holds; the ones removed."""
    removed = []
    for lock in root.glob(f"*/{OP}/lock"):
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > STALE_AFTER_S and not busy(lock.parent):
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed


def built(root: Path) -> bool:
    """Whether this Python's CPU build of the op is there, with no build lock beside it."""
    folder = root / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / OP
    return (folder / f"{OP}.so").is_file() and not (folder / "lock").exists()


def main() -> int:
    root = extension_root()
    for lock in clear_stale_locks(root, time.time()):
        print(f"removed the stale build lock {lock} (a killed compile left it)")
    if built(root):
        return 0
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("DeepSpeed is not installed: its tests are skipped")
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        print("this DeepSpeed accelerator has no shared-memory op to build")
        return 0
    print(f"building DeepSpeed's {OP} op for its CPU tests under {root} (once, about a minute)")
    started = time.perf_counter()
    builder.load(verbose=False)
    print(f"DeepSpeed's {OP} op is ready ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
