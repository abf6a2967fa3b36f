"""`LineFile`: an append-only file of whole lines that a full or failing disk never tears, and
`write_small_file`: a small file replaced in one rename, for files written once at start."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainguard.run_files import APPEND, RunFileError, open_regular, write_all, write_atomically

Report = Callable[[str], None]
RETRY_S = 2.0  # a file that failed is tried again at most this often
FULL_DISK = frozenset({errno.ENOSPC, errno.EDQUOT})
_TAIL = 4096  # bytes read at a time when looking for the end of the last whole line


def open_file(fd: int, mode: str) -> io.FileIO:
    """An unbuffered file over a descriptor that `trainguard.run_files` opened without following
    links: the one place this module wraps one (tests fill a disk here)."""
    try:
        return io.FileIO(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def stderr_report(message: str) -> None:
    """Say `message` on stderr, for callers that pass no report of their own."""
    print(f"trainguard: {message}", file=sys.stderr, flush=True)


def describe_os_error(exc: OSError) -> str:
    """An OSError in a few lower-case words: `no space left on device`."""
    text = exc.strerror or str(exc) or type(exc).__name__
    return text[:1].lower() + text[1:]


class LineFile:
    """Appends whole lines to `path`, each call in one `write`. A write the disk refuses is cut
    back off, so the file always ends on a whole line; the line is dropped and counted (or,
    with `keep`, held in memory and written first next time). The first failure and the
    recovery are reported once each, and a failing file is tried again at most every
    `retry_s` seconds."""

    def __init__(
        self,
        path: str | Path,
        report: Report = stderr_report,
        keep: bool = False,
        note: str = "",
        retry_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.report = report
        self.keep = keep
        self.note = note  # said with the first failure: what it means for the run
        self.retry_s = RETRY_S if retry_s is None else retry_s
        self.clock = clock
        self.dropped = 0  # lines dropped over the file's life (never counts kept ones)
        self.unwritten: list[bytes] = []  # with `keep`: lines waiting to be written, in order
        self._dropped_in_failure = 0
        self._file: io.FileIO | None = None
        self._size = 0  # where the file's last whole line ends: writes are undone back to it
        self._failing = False
        self._retry_at = 0.0
        self._closed = False

    @property
    def failing(self) -> bool:
        """Whether the last attempt to write failed."""
        return self._failing

    def open(self) -> None:
        """Open for appending (making the folder), cutting off a torn last line that a killed
        or failed writer left; raises the OSError when the file cannot be opened."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open_file(open_regular(self.path, APPEND), "a+")
        try:
            size = os.fstat(file.fileno()).st_size
            whole = _end_of_last_line(file.fileno(), size)
            if whole < size:
                os.ftruncate(file.fileno(), whole)
                self.report(f"{self.path}: cut off a torn last line ({size - whole} bytes)")
        except OSError:
            file.close()
            raise
        self._file, self._size = file, whole

    def fail(self, exc: OSError) -> None:
        """Start failing because of `exc` (an open that failed): report once, retry later."""
        self._retry_at = self.clock() + self.retry_s
        if not self._failing:
            self._failing = True
            # a link or FIFO planted in its place names the file itself
            why = (
                str(exc)
                if isinstance(exc, RunFileError)
                else f"{self.path}: {describe_os_error(exc)}"
            )
            if self.keep:
                self.report(
                    f"{why}; keeping its lines in memory "
                    f"until it can be written again ({len(self.unwritten)} so far){self.note}"
                )
            else:
                so_far = f" ({self.dropped} so far)" if self.dropped else ""
                self.report(
                    f"{why}; dropping lines until it can be written again{so_far}{self.note}"
                )

    def write(self, data: bytes, sync: bool = False) -> bool:
        """Append `data` (whole lines), fsync'd when `sync`; False when it was not written, and
        no syscall at all while a failed file waits for its next try."""
        if self.keep:
            self.unwritten.append(data)
        if self._closed or (self._failing and self.clock() < self._retry_at):
            if not self.keep:
                self.dropped += 1
                self._dropped_in_failure += 1
            return False
        return self._attempt(data, sync)

    def _attempt(self, data: bytes, sync: bool) -> bool:
        if self.keep:
            data = b"".join(self.unwritten)
        try:
            if self._file is None:
                self.open()
            self._append(data, sync)
        except OSError as exc:
            self._undo()
            if not self.keep:
                self.dropped += 1
                self._dropped_in_failure += 1
            self.fail(exc)
            return False
        if self.keep:
            self.unwritten.clear()
        if self._failing:
            self._failing = False
            if self.keep:
                self.report(f"{self.path}: written again, with the lines kept in memory")
            elif self._dropped_in_failure:
                self.report(
                    f"{self.path}: written again; {self._dropped_in_failure} line(s) were "
                    "dropped while it could not be"
                )
            else:
                self.report(f"{self.path}: written again")
            self._dropped_in_failure = 0
        return True

    def _append(self, data: bytes, sync: bool) -> None:
        assert self._file is not None
        write_all(self._file, data)
        if sync:
            os.fsync(self._file.fileno())
        self._size += len(data)

    def _undo(self) -> None:
        """Cut the file back to its last whole line; close it when even that fails (it is cut
        back when it is opened again)."""
        if self._file is None:
            return
        try:
            os.ftruncate(self._file.fileno(), self._size)
        except OSError:
            self.release()

    def release(self) -> None:
        """Close the file until the next write opens it again; never raises."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()

    def close(self, sync: bool = False) -> None:
        """Write what is kept (one last try), fsync when `sync`, close, and say what could not
        be written; never raises."""
        if self._closed:
            return
        if self.keep and self.unwritten:
            self._attempt(b"", sync)
        elif sync and self._file is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._file.fileno())
        self._closed = True
        self.release()
        if self.keep and self.unwritten:
            self.report(
                f"{self.path}: closed with {len(self.unwritten)} line(s) kept in memory and "
                f"never written{self.note}"
            )
        elif self._failing and self._dropped_in_failure:
            self.report(
                f"{self.path}: closed with {self._dropped_in_failure} line(s) dropped since it "
                f"last failed ({self.dropped} in all)"
            )


def _end_of_last_line(fd: int, size: int) -> int:
    """The offset just after the last newline of the file `fd` of `size` bytes (0 if none)."""
    end = size
    while end > 0:
        start = max(0, end - _TAIL)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def write_small_file(path: Path, text: str, report: Report = stderr_report) -> bool:
    """Replace `path` with `text` in one rename, so that it is whole or untouched; on an
    OSError (a full disk) report it and return False instead of raising. A link or non-regular
    file at `path` is a `RunFileError`, raised."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text.encode(), lambda fd: open_file(fd, "w"))
    except RunFileError:
        raise
    except OSError as exc:
        report(f"cannot write {path} ({describe_os_error(exc)}); the run goes on without it")
        return False
    return True
