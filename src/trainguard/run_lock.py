"""`RunLock`: one live writer per run folder, an `flock` on `run_dir/.lock`. The kernel drops the
lock when its process dies, so the lock of a killed run is taken over without a word."""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import json
import os
import socket
import sys
import time
import weakref
from pathlib import Path
from typing import Any

from trainguard.events import TrainguardError, _utc_now
from trainguard.line_file import FULL_DISK, Report, describe_os_error, stderr_report
from trainguard.run_files import APPEND, READ, RunFileError, open_regular

if sys.platform != "win32":
    import fcntl

LOCK_NAME = ".lock"
LOCK_TRIES = 5  # a held lock is tried this many times before it is said to be in use...
LOCK_RETRY_S = 0.05  # ...over this long (a watcher's probe holds it for microseconds)
_HELD = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})
_LIVE: weakref.WeakSet[RunLock] = weakref.WeakSet()  # this process's locks, for fork


class RunLock:
    """An exclusive lock on a run folder for the life of one Guard, with the holder's pid, host
    and start time in the file for the error a second writer gets; `release` frees it."""

    def __init__(self, path: Path, file: io.FileIO) -> None:
        self.path = path
        self._file: io.FileIO | None = file
        _LIVE.add(self)

    @property
    def held(self) -> bool:
        """Whether this lock is still held."""
        return self._file is not None

    @classmethod
    def take(cls, run_dir: Path, report: Report = stderr_report) -> RunLock | None:
        """Lock `run_dir` for this process or raise a TrainguardError that names the holder;
        None, after one warning, where the file system cannot lock (and on Windows)."""
        if sys.platform == "win32":
            return None
        path = run_dir / LOCK_NAME
        unlocked = f"the run goes on without a lock: make sure no other run writes to {run_dir}"
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            file = io.FileIO(open_regular(path, APPEND), "a+")  # nothing cut before the lock
        except RunFileError:
            raise  # a link or FIFO planted as the lock: never truncated, never written
        except OSError as exc:
            if exc.errno in FULL_DISK:
                report(f"cannot make {path} ({describe_os_error(exc)}); {unlocked}")
                return None
            raise TrainguardError(
                f"cannot write {run_dir}: {exc.strerror or exc}; choose a writable run_dir"
            ) from None
        failure = _lock(file)
        if failure is not None and failure.errno in _HELD and _is_this_process(_holder(file)):
            gc.collect()  # a Guard that nothing refers to may hold it until it is collected
            failure = _lock(file)
        if failure is None:
            with contextlib.suppress(OSError):  # a full disk: the lock holds, unsigned
                os.ftruncate(file.fileno(), 0)
                holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": _utc_now()}
                holder["started"] = start_time(os.getpid())  # tells a reused pid apart
                file.write(json.dumps(holder).encode() + b"\n")
            return cls(path, file)
        holder = _holder(file)
        file.close()
        if failure.errno in _HELD:
            raise TrainguardError(_in_use(run_dir, holder))
        report(f"cannot lock {path} ({describe_os_error(failure)}); {unlocked}")
        return None

    def release(self) -> None:
        """Unlock and close (the file stays, empty); never raises."""
        file, self._file = self._file, None
        if file is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(file.fileno(), 0)
        with contextlib.suppress(OSError):
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            file.close()

    def _forget_in_child(self) -> None:
        """In a forked child: close the inherited copy without unlocking, so that the lock
        lives and dies with the process that took it."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()


def _lock(file: io.FileIO) -> OSError | None:
    """Take the exclusive lock without waiting; a lock found held is tried again a few times
    over `LOCK_RETRY_S`, as a watcher's probe (`lock_held`) holds it shared for microseconds."""
    failure: OSError | None = None
    for attempt in range(LOCK_TRIES):
        if attempt:
            time.sleep(LOCK_RETRY_S / LOCK_TRIES)
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            failure = exc
            if exc.errno not in _HELD:
                return exc
            continue
        return None
    return failure


def _holder(file: io.FileIO) -> dict[str, Any]:
    """What the holder wrote into the lock file; empty when it is unreadable or not yet
    written."""
    try:
        holder = json.loads(os.pread(file.fileno(), 4096, 0))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _is_this_process(holder: dict[str, Any]) -> bool:
    return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def _in_use(run_dir: Path, holder: dict[str, Any]) -> str:
    since = f"since {holder['since']}" if holder.get("since") else "since an unknown time"
    if _is_this_process(holder):
        return (
            f"{run_dir} is in use by another Guard in this process ({since}): close that one "
            "first (guard.close(), or `with tg.Guard(...) as guard:`), or give each its own "
            "run_dir"
        )
    if not holder.get("pid"):
        who = "another trainguard run"
    else:
        pid, host = holder["pid"], holder.get("host", "an unknown host")
        gone = ""
        if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
            gone = "; it has exited, and a process it forked still holds the lock"
        who = f"another trainguard run (pid {pid} on host {host}, {since}{gone})"
    return f"{run_dir} is in use by {who}: give each run its own run_dir, or stop the other one"


def local_holder(run_dir: Path) -> tuple[int, bool] | None:
    """The pid a Guard on this host wrote into `run_dir`'s lock and has not released, and whether
    that writer still lives (a run killed before `close()` leaves its pid there; `release`
    empties the file); None when there is none, or it ran on another host. It lives while its
    pid does, with the start time it recorded (`start_time`), and its `flock` is still held
    (`lock_held`): the kernel drops the lock when the process dies, so a pid that now belongs to
    another process is not taken for the writer."""
    try:
        fd = open_regular(run_dir / LOCK_NAME, READ)  # read-only: never made, cut or followed
    except OSError:
        return None
    try:
        try:
            holder = json.loads(os.pread(fd, 4096, 0))
        except (OSError, ValueError):
            return None
        if not isinstance(holder, dict) or holder.get("host") != socket.gethostname():
            return None
        pid = holder.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return None
        started = holder.get("started")
        same = started is None or start_time(pid) in (None, started)  # not a reused pid
        return pid, _alive(pid) and same and lock_held(fd) is not False
    finally:
        os.close(fd)


def lock_held(fd: int) -> bool | None:
    """Whether some process holds the `flock` of the lock file open as `fd`: a shared lock is
    tried without waiting, and released at once when it is had (True: held; False: free, its
    writer is gone; None: it cannot be told, as on a file system without locks). A writer's
    `take` that meets this brief lock tries again (`_lock`), so watching never stops a run."""
    if sys.platform == "win32":
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return True if exc.errno in _HELD else None
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat): a
    pid reused by a later process has another; None where there is no /proc (macOS)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read(4096).rsplit(b")", 1)[-1].split()  # the name may hold ") "
        return int(fields[19])  # field 22, counted after the pid and the name
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, and someone else's
        return True
    return True


def _close_inherited_locks() -> None:
    for lock in list(_LIVE):
        lock._forget_in_child()


if sys.platform != "win32":
    os.register_at_fork(after_in_child=_close_inherited_locks)
