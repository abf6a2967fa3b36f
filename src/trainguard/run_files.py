"""The files of a run folder, opened without following links: a symbolic link, FIFO or device
planted where a guard file belongs is refused with one `RunFileError`, never written through."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from trainguard.events import TrainguardError

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
APPEND = os.O_RDWR | os.O_CREAT | os.O_APPEND  # an append-only file, made when missing
UPDATE = os.O_RDWR | os.O_CREAT  # read and rewritten in place (the lock), made when missing
READ = os.O_RDONLY
FIX = "remove it or choose another run_dir"


class RunFileError(TrainguardError, OSError):
    """A link or non-regular file where a run file belongs; an OSError too, so that a writer
    that survives a failing disk mid-run says it and goes on."""

    def __init__(self, path: Path, what: str, fix: str = FIX) -> None:
        message = f"{path} is {what}; trainguard never writes or reads through it: {fix}"
        code = errno.ELOOP if what == "a symbolic link" else errno.EINVAL
        super().__init__(code, message)
        self.what = what

    def __str__(self) -> str:
        return str(self.strerror)


def reason(exc: OSError) -> str:
    """Why a file could not be opened, in a few words: what a `RunFileError` found there, else
    the system's word."""
    return exc.what if isinstance(exc, RunFileError) else str(exc.strerror or exc)


def _kind(mode: int) -> str:
    """What a file of `mode` is, in words, for the error."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO, not a regular file"
    if stat.S_ISDIR(mode):
        return "a folder, not a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device, not a regular file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a regular file"
    return "not a regular file"


def _refusal(path: Path, fix: str = FIX) -> RunFileError | None:
    """The error for what stands at `path` when it is not a regular file; None otherwise."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else RunFileError(path, _kind(mode), fix)


def open_regular(path: Path, flags: int, mode: int = 0o666) -> int:
    """A descriptor of the regular file `path` opened with `flags`, never through a symbolic link,
    never blocking on a FIFO, and for writing never one with other hard links; a `RunFileError`
    for anything else there. Nothing is truncated before the check (pass no `O_TRUNC`)."""
    try:
        fd = os.open(path, flags | NOFOLLOW | CLOEXEC | NONBLOCK, mode)
    except OSError as exc:
        # ELOOP: a link (O_NOFOLLOW); ENXIO: a FIFO with no reader; EISDIR: a folder
        refused = _refusal(path) if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR) else None
        if refused is not None:
            raise refused from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunFileError(path, _kind(st.st_mode))
        if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:  # writes would reach the other
            raise RunFileError(path, f"a file with {st.st_nlink} hard links (another file's too)")
        if NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(path: Path, limit: int | None = None) -> bytes:
    """The bytes of the regular file `path` (the first `limit` of them), refusing a link, a
    FIFO or a device with a `RunFileError` instead of hanging on it."""
    fd = open_regular(path, READ)
    with open(fd, "rb", closefd=True) as f:
        return f.read() if limit is None else f.read(limit)


def create_temporary(folder: Path, prefix: str) -> tuple[int, Path]:
    """A new file in `folder` with an unpredictable name (`prefix` + 16 random hex digits),
    made with `O_EXCL | O_NOFOLLOW`, so that nothing planted there is opened; its descriptor
    (write-only) and path."""
    for _ in range(100):
        path = folder / f"{prefix}{secrets.token_hex(8)}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o666)
        except FileExistsError:
            continue
        return fd, path
    raise FileExistsError(errno.EEXIST, f"no free temporary name in {folder}")


def check_replaceable(path: Path, fix: str = FIX) -> None:
    """Raise a `RunFileError` when something other than a regular file (a link, a FIFO, a
    folder) stands at `path`, which a writer is about to replace."""
    refused = _refusal(path, fix)
    if refused is not None:
        raise refused


def write_atomically(
    path: Path,
    data: bytes,
    opener: Callable[[int], io.FileIO] | None = None,
    fix: str = FIX,
) -> None:
    """Replace `path` with `data` whole or not at all: a fresh temporary beside it (an
    unpredictable name), written, fsync'd and renamed over `path`; a link or non-regular file
    at `path` is refused (its error says `fix`), not replaced. `opener` wraps the temporary's
    descriptor."""
    check_replaceable(path, fix)
    fd, tmp = create_temporary(path.parent, f".{path.name}.tmp-")
    try:
        with (opener or _file_io)(fd) as f:
            write_all(f, data)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_all(file: io.FileIO, data: bytes) -> None:
    """Write all of `data`, one `write` unless the disk takes only part of it."""
    view = memoryview(data)
    while view:
        written = file.write(view)
        if not written:
            raise OSError(errno.EIO, "a write made no progress")
        view = view[written:]


def _file_io(fd: int) -> io.FileIO:
    return io.FileIO(fd, "w")


def check_folder(path: Path) -> None:
    """Raise a `RunFileError` when `path` (a folder inside the run folder) is a symbolic link or
    not a folder; a missing one passes."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise RunFileError(path, _kind(mode) if stat.S_ISLNK(mode) else "not a folder")


def make_folder(path: Path) -> None:
    """Make the folder `path` inside the run folder (and the folders above it, which the user
    chose); a `RunFileError` when `path` itself is a link or not a folder."""
    check_folder(path)
    path.mkdir(parents=True, exist_ok=True)
    check_folder(path)


def remove_tree(path: Path, warn: Callable[[str], None]) -> None:
    """Delete the folder `path` and what it holds, never what a link points to: `shutil.rmtree`
    removes links inside it as links (Python 3.10+: `avoids_symlink_attacks`), and a `path` that
    is itself a link is removed as a link, with a warning. Never raises."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISLNK(mode):
        with contextlib.suppress(OSError):
            path.unlink()
        warn(f"{path} was a symbolic link: removed the link only, not what it points to")
        return
    if not stat.S_ISDIR(mode):
        with contextlib.suppress(OSError):
            path.unlink()
        return
    shutil.rmtree(path, ignore_errors=True)
