"""`CheckpointStore`: durable checkpoints through `torch.distributed.checkpoint`, written in the
background, complete or absent, verified before they are loaded."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from trainguard._torch_private import foreach_copy_, tensor_version
from trainguard.actions.checkpoint_blobs import (
    BLOBS,
    BlobReader,
    BlobWriter,
    DigestMemory,
    collect_blobs,
    foreign_blobs,
    fsync_dir,
    read_table,
    same_bytes,
    verify_blobs,
)
from trainguard.actions.checkpoint_files import (
    BLOB_STORAGE,
    DIGEST_SCHEME,
    MANIFEST,
    PLAIN_STATE,
    STEP_KEY,
    TENSOR_TABLE,
    DamagedCheckpoint,
    SafeReader,
    check_plain_state,
    file_digest,
    passed_over,
    read_json,
    read_metadata,
    tensor_entries,
    verify_manifest,
)
from trainguard.actions.host_memory import Layout, allocate, carve
from trainguard.actions.snapshots import rng_from_plain, rng_state, rng_to_plain, set_rng_state
from trainguard.distributed.context import RankContext
from trainguard.events import TrainguardError, _utc_now
from trainguard.run_files import (
    check_folder,
    make_folder,
    remove_tree,
    write_atomically,
)

PREFIX = "step-"
Accepted = TypeVar("Accepted")


def _no_dist() -> bool:
    """One process: no process group to coordinate the checkpoint with."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


_SINGLE_PROCESS = "torch.distributed is disabled"  # DCP's warning that one process is assumed
_SINGLE_PROCESS_SAVE = (  # the whole message of that warning from `save`, for an exact filter
    r"torch\.distributed is disabled, unavailable or uninitialized, "
    r"assuming the intent is to save in a single process\.$"
)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that one process is assumed when no process group exists: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        yield


def _quiet_writer_thread() -> None:
    """Before an asynchronous single-process checkpoint: DCP's writer thread gives that warning
    after the caller's `catch_warnings` has ended, so one filter, for that exact message from
    DCP's modules only, goes last in the filters (importing trainguard changes none; a filter
    of the user's comes first; adding it again adds nothing)."""
    warnings.filterwarnings(
        "ignore",
        message=_SINGLE_PROCESS_SAVE,
        category=UserWarning,
        module=r"torch\.distributed\.checkpoint\.",
        append=True,
    )


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def _on_device(tensor: torch.Tensor) -> bool:
    """A tensor off the host: judged unchanged by its version counter, not by its bytes."""
    return tensor.device.type != "cpu"


def _leaves(value: Any, key: str, out: list[tuple[str, torch.Tensor]]) -> None:
    """Every tensor of a nested state dict by its dotted key (a DTensor: this rank's shard)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _leaves(v, f"{key}.{k}", out)
    elif isinstance(value, DTensor):
        out.append((key, value.to_local().detach()))
    elif isinstance(value, torch.Tensor):
        out.append((key, value.detach()))


def _rebuild(value: Any, key: str, views: dict[str, torch.Tensor]) -> Any:
    """The state dict with each tensor replaced by its staged view (a DTensor keeps its place)."""
    if isinstance(value, dict):
        return {k: _rebuild(v, f"{key}.{k}", views) for k, v in value.items()}
    if isinstance(value, DTensor):
        return DTensor.from_local(
            views[key],
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, torch.Tensor):
        return views[key]
    return value


class _Staging:
    """One host buffer (pinned for device tensors) carved into a view per tensor of a layout."""

    def __init__(self, layout: Layout, buffer: torch.Tensor) -> None:
        self.layout = layout
        self.buffer = buffer
        self.views = dict(zip((e.key for e in layout.entries), carve(buffer, layout), strict=True))


class BufferStager(AsyncStager):
    """Stages a checkpoint by one copy into host buffers reused from save to save (pinned for
    device tensors, copied on a side stream whose event the writer waits for), skipping what is
    known unchanged: a host tensor whose bytes equal its view's (with `memory`), a frozen device
    parameter whose version counter and address are the same."""

    _synchronize_after_execute = False

    def __init__(self, memory: DigestMemory | None = None) -> None:
        self.memory = memory
        self.addresses: set[int] = set()  # where the views are, for `DigestMemory.remember`
        self.by_version: Callable[[torch.Tensor], bool] = _on_device  # else judged by bytes
        self.frozen: set[int] = set()  # addresses of frozen parameters: the only ones skipped
        self.copied_bytes = 0  # bytes the last `stage` copied
        self._groups: dict[bool, _Staging] = {}  # pinned or not -> its buffer and views
        self._marks: dict[str, tuple[int, int]] = {}  # key -> (version, address) when staged
        self._held: dict[str, Any] = {}  # key -> the storage of that staged tensor
        self._events: list[Any] = []  # the last copy's CUDA events, for the writer to wait on
        self._streams: dict[int, Any] = {}  # a side copy stream per CUDA device
        self._prepared: dict[bool, _Staging] = {}  # allocated in the background, not yet in use
        self._preparing: threading.Thread | None = None
        self.prepare_error: str | None = None  # why the background allocation failed

    # -- buffers ----------------------------------------------------------------------------------
    @staticmethod
    def _layouts(leaves: list[tuple[str, torch.Tensor]]) -> dict[bool, Layout]:
        groups: dict[bool, list[tuple[str, torch.Tensor]]] = {}
        for key, tensor in leaves:
            groups.setdefault(tensor.is_cuda, []).append((key, tensor))
        return {pinned: Layout.of(items) for pinned, items in groups.items()}

    def prepare(self, state_dict: dict[str, Any]) -> None:
        """Allocate (and pin) the device tensors' buffer in a background thread, so that no save
        allocates on the training thread; `preparing` until it is done."""
        if self.preparing:
            return
        leaves: list[tuple[str, torch.Tensor]] = []
        _leaves(state_dict, "", leaves)
        layout = self._layouts(leaves).get(True)
        have = self._groups.get(True) or self._prepared.get(True)
        if layout is None or (have is not None and have.layout == layout):
            return

        def allocate_pinned() -> None:
            try:
                self._prepared[True] = _Staging(layout, allocate(layout.nbytes, pinned=True))
            except (MemoryError, RuntimeError) as exc:
                self.prepare_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__

        self._preparing = threading.Thread(
            target=allocate_pinned, name="trainguard-checkpoint-buffers", daemon=True
        )
        self._preparing.start()

    @property
    def preparing(self) -> bool:
        """Whether the background allocation of `prepare` is still going on."""
        return self._preparing is not None and self._preparing.is_alive()

    def _staging(self, pinned: bool, layout: Layout) -> _Staging:
        """The buffer of a group for `layout`: the one in use, the one prepared, or a new one (on
        the calling thread: the layout changed, or nothing was prepared)."""
        current = self._groups.get(pinned)
        if current is not None and current.layout == layout:
            return current
        if self._preparing is not None:
            self._preparing.join()  # an explicit save while preparing: the only wait for it
            self._preparing = None
        staging = self._prepared.pop(pinned, None)
        if staging is None or staging.layout != layout:
            staging = _Staging(layout, allocate(layout.nbytes, pinned))
        if current is not None:
            self._retire(current)
        for view in staging.views.values():
            self.addresses.add(view.data_ptr())
            if self.memory is not None:
                self.memory.forget(view)
        self._groups[pinned] = staging
        return staging

    def _retire(self, staging: _Staging) -> None:
        for key, view in staging.views.items():
            self.addresses.discard(view.data_ptr())
            self._marks.pop(key, None)
            self._held.pop(key, None)
            if self.memory is not None:
                self.memory.forget(view)

    # -- staging ----------------------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        leaves: list[tuple[str, torch.Tensor]] = []
        _leaves(state_dict, "", leaves)
        views: dict[str, torch.Tensor] = {}
        for pinned, layout in self._layouts(leaves).items():
            views.update(self._staging(pinned, layout).views)
        sources: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        try:
            for key, src in leaves:
                view = views[key]
                if self._unchanged(key, src, view):
                    continue
                if self.memory is not None:
                    self.memory.forget(view)
                sources.append(src)
                targets.append(view)
            self._copy(sources, targets)
        except BaseException:
            self.forget_all()  # a copy cut short: no view is known to hold what it held
            raise
        self.copied_bytes = sum(t.numel() * t.element_size() for t in targets)
        return _rebuild(state_dict, "", views)  # type: ignore[no-any-return]

    def _unchanged(self, key: str, src: torch.Tensor, view: torch.Tensor) -> bool:
        """Whether `view` already holds `src`'s bytes: no copy, no hash. By version counter only a
        frozen parameter (fused optimizers and BatchNorm bump none), its storage held meanwhile."""
        if self.by_version(src):
            mark = (tensor_version(src), src.data_ptr())
            before = self._marks.pop(key, None)
            self._held.pop(key, None)
            if src.data_ptr() not in self.frozen:
                return False
            self._marks[key] = mark
            self._held[key] = src.untyped_storage()
            return before == mark
        return (
            self.memory is not None
            and not src.is_cuda
            and src.is_contiguous()
            and same_bytes(src, view)
        )

    def _copy(self, sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """Host tensors copied here; device tensors on a side stream after the current stream's
        work, which then waits on the device for the copy (`wait_copied` waits on the host)."""
        self._events = []
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for src, dst in zip(sources, targets, strict=True):
            pair = by_device.setdefault(src.device, ([], []))
            pair[0].append(src)
            pair[1].append(dst)
        for device, (srcs, dsts) in by_device.items():
            if device.type != "cuda":
                foreach_copy_(dsts, srcs)
                continue
            with torch.cuda.device(device):
                current = torch.cuda.current_stream()
                stream = self._streams.get(device.index or 0)
                if stream is None:
                    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                    self._streams[device.index or 0] = stream
                stream.wait_stream(current)  # an event on the current stream, waited on the side
                with torch.cuda.stream(stream):
                    foreach_copy_(dsts, srcs, non_blocking=True)
                copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
                copied.record(stream)
                current.wait_event(copied)  # later writes to a source wait for its copy
                for src in srcs:
                    src.record_stream(stream)  # no source's memory is reused before its copy
                self._events.append(copied)

    def wait_copied(self) -> None:
        """Block (in the writer thread) until the last stage's device copies are in the buffers."""
        for event in self._events:
            event.synchronize()

    def forget_all(self) -> None:
        """Forget what each view is known to hold (after a write that bumped no version counter,
        such as one through `.data`): the next save copies and hashes everything again."""
        self._marks.clear()
        self._held.clear()
        if self.memory is not None:
            for staging in self._groups.values():
                for view in staging.views.values():
                    self.memory.forget(view)

    def synchronize_staging(self) -> None:
        """Staging is queued when `stage` returns; the writer waits for it (`wait_copied`)."""

    def close(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        self._groups.clear()
        self._prepared.clear()
        self._marks.clear()
        self._held.clear()
        self._events = []
        self.addresses.clear()
        if self.memory is not None:
            self.memory.clear()


class _StagedFileWriter(FileSystemWriter):
    """DCP's own file writer, which first waits (in the writer thread) for the staging copies."""

    def __init__(self, path: Path, ready: Callable[[], None]) -> None:
        super().__init__(path)
        self._ready = ready

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        self._ready()
        return super().write_data(plan, planner)


def check_checkpoint_folders(directory: Path) -> None:
    """Raise a `RunFileError` when `directory` (`run_dir/checkpoints`) or its `blobs/` is a
    symbolic link or no folder: nothing is written or pruned through a planted link."""
    check_folder(directory)
    check_folder(directory / BLOBS)


class CheckpointStore:
    """`directory/step-N/`: the tensors, `trainguard.json` (plain state) and `manifest.json`
    (step, time, sha256 of each file, version, incident state), renamed in place when complete.
    With `dedup` the tensors are blobs in `directory/blobs/` shared by the checkpoints (a tensor
    unchanged since the last save is not written again) and `tensors.json` names them; without,
    they are DCP's own files in the folder."""

    def __init__(
        self,
        directory: str | Path,
        keep: int = 3,
        asynchronous: bool = True,
        ranks: RankContext | None = None,
        dedup: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.blobs = self.directory / BLOBS
        self._check_folders()  # a link planted as checkpoints/ or blobs/: refused at the start
        self.dedup = dedup
        self._memory = DigestMemory() if dedup else None
        self.written: dict[str, int] = {}  # this rank's last save: blob bytes written, hashed
        self.ranks = ranks
        # DCP's collectives get a group of their own: an asynchronous save runs them in a
        # background thread, which must not interleave with the guard's per-step all-gather
        self.group = dist.new_group(backend="gloo") if ranks is not None else None
        self.keep = keep
        self.asynchronous = asynchronous
        self._pending: threading.Event | None = None  # set once the write is finished
        self.writing_step: int | None = None  # the step of the last write begun
        self._lock = threading.Lock()
        self.errors: list[str] = []  # lines the writer has to say (failures, repairs), each once
        self._foreign_said = False  # the blobs folder lies elsewhere: said once
        self._stager = BufferStager(self._memory)
        self.protected: set[int] = set()  # steps kept as the last known-good before an incident

    # -- writing ----------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        tensors: dict[str, Any],
        plain: dict[str, Any],
        manifest: dict[str, Any],
    ) -> None:
        """Stage the tensors (the only part that blocks training) and write in the background.
        Waits first for a previous write still going on (the guard defers a due checkpoint
        instead, while `writing`). A failure of any kind (a full disk, DCP's own) is kept in
        `errors`, never raised, and leaves no temporary folder and every older checkpoint."""
        self.wait()
        ranks = self.ranks
        token = ranks.token if ranks is not None else uuid.uuid4().hex[:8]
        tmp = self.directory / f".{PREFIX}{step}.tmp-{token}"
        plain_text = json.dumps(plain)
        leader = ranks is None or ranks.is_leader
        tensors = {**tensors, "trainguard": {"step": torch.tensor(step, dtype=torch.int64)}}
        finished = threading.Event()
        self._pending = finished
        self.writing_step = step
        try:
            if ranks is None:
                make_folder(self.directory)
                self._check_folders()
            else:  # each rank's own plain state, on disk before DCP's last barrier
                try:
                    make_folder(self.directory)
                    self._check_folders()
                    tmp.mkdir(exist_ok=True)
                    write_atomically(tmp / plain_name(ranks.rank), plain_text.encode())
                except OSError as exc:  # DCP's collectives must still run on this rank
                    self._fail(step, None, exc)
            future = self._write(tmp, tensors, ranks is None and _no_dist(), step)
        except (Exception, CheckpointException) as exc:
            self._fail(step, tmp if leader else None, exc)
            finished.set()
            return

        def finish(done: concurrent.futures.Future[Any]) -> None:
            try:
                done.result()
                if leader:  # DCP completes on rank 0 once every rank's files are written
                    self._finish(step, tmp, None if ranks else plain_text, manifest)
            except (Exception, CheckpointException) as exc:  # reported, never raised
                self._fail(step, tmp if leader else None, exc)
            finally:
                finished.set()

        future.add_done_callback(finish)
        if not self.asynchronous:
            self.wait()

    def _write(self, tmp: Path, tensors: dict[str, Any], no_dist: bool, step: int) -> Any:
        """Start DCP's write of the tensors into `tmp`: a future that completes once written."""
        if self.asynchronous and no_dist:
            _quiet_writer_thread()
        writer = None
        if self._memory is not None:
            writer = BlobWriter(
                self.blobs,
                self._memory,
                self._stager.addresses,
                step,
                self._say,
                self._stager.wait_copied,
            )
            self.written = {}

            def count(done: concurrent.futures.Future[Any]) -> None:
                self.written = {"written": writer.written, "hashed": writer.hashed}

        with _quiet_single_process():
            if self.asynchronous:
                started = dcp_async_save(
                    tensors,
                    checkpoint_id=tmp,
                    storage_writer=writer or _StagedFileWriter(tmp, self._stager.wait_copied),
                    no_dist=no_dist,
                    async_stager=self._stager,
                    process_group=self.group,
                )
                if writer is not None:
                    started.add_done_callback(count)  # type: ignore[union-attr]
                return started
            if writer is not None:  # staged, so unchanged tensors are found by their buffers
                tensors = self._stager.stage(tensors)
            dcp_save(
                tensors,
                checkpoint_id=tmp,
                storage_writer=writer,
                no_dist=no_dist,
                process_group=self.group,
            )
            if writer is not None:
                self.written = {"written": writer.written, "hashed": writer.hashed}
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            future.set_result(None)
            return future

    def prepare(self, tensors: dict[str, Any]) -> None:
        """Allocate the staging buffers for tensors of this layout in the background."""
        self._stager.prepare(tensors)
        if self._stager.prepare_error is not None:
            error, self._stager.prepare_error = self._stager.prepare_error, None
            self._say(f"the checkpoint buffers could not be allocated in the background ({error})")

    @property
    def preparing(self) -> bool:
        """Whether the staging buffers are still being allocated in the background."""
        return self._stager.preparing

    @property
    def copied(self) -> int:
        """Bytes the last save copied into its staging buffers (unchanged tensors are not)."""
        return self._stager.copied_bytes

    def forget_staged(self) -> None:
        """After a write to the weights that no version counter saw: the next save copies and
        hashes every tensor again."""
        self._stager.forget_all()

    def note_frozen(self, addresses: set[int]) -> None:
        """The addresses of the frozen parameters: the only device tensors that may be found
        unchanged by their version counter (every other one is copied at each save)."""
        self._stager.frozen = addresses

    def _say(self, line: str) -> None:
        """Keep a line for the next step's `checkpoint` warning (from any thread)."""
        with self._lock:
            self.errors.append(line)

    def _blobs_are_ours(self) -> bool:
        """Whether the blobs folder is the run's own; said once when it resolves elsewhere (a
        link planted since the last save's check, to a folder other runs may share): nothing
        there is collected."""
        elsewhere = foreign_blobs(self.directory)
        if elsewhere is None:
            return True
        with self._lock:  # saves and the writer's collection both ask
            first, self._foreign_said = not self._foreign_said, True
        if first:
            self._say(
                f"{self.blobs} resolves to {elsewhere}, outside the run folder: no blob there is "
                "deleted (other runs may use them); make it a plain folder of the run"
            )
        return False

    def _fail(self, step: int, tmp: Path | None, exc: BaseException) -> None:
        """Record a failed checkpoint and remove what it left (the older ones stay): its folder,
        and the blobs it wrote that no kept checkpoint uses (every rank's writes are over once
        DCP's save has failed on rank 0)."""
        if tmp is not None:
            remove_tree(tmp, self._note)
            with contextlib.suppress(OSError):
                self._collect()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else _first_line(exc)
        self._say(
            f"the checkpoint of step {step} could not be written ({reason}); "
            "training goes on, the older checkpoints are kept"
        )

    def _finish(
        self, step: int, tmp: Path, plain_text: str | None, manifest: dict[str, Any]
    ) -> None:
        self._check_folders()  # a link planted since the save began: nothing is pruned through it
        if plain_text is not None:
            write_atomically(tmp / PLAIN_STATE, plain_text.encode())
        files = {p.name: file_digest(p, step) for p in sorted(tmp.iterdir()) if p.is_file()}
        if self.ranks is not None:
            ranks_written = sum(1 for n in files if n.startswith("trainguard-rank"))
            if ranks_written != self.ranks.world_size:
                raise TrainguardError(
                    f"{self.ranks.world_size - ranks_written} rank(s) wrote no plain state"
                )
        record: dict[str, Any] = {
            "step": step,
            "time": _utc_now(),
            "checksums": DIGEST_SCHEME,
            "files": files,
            **manifest,
        }
        if TENSOR_TABLE in files:  # the blobs it uses, each with its size, for verify and prune
            table = json.loads((tmp / TENSOR_TABLE).read_text())["tensors"]
            chunks = [c for entry in table.values() for c in entry["chunks"]]
            record["storage"] = BLOB_STORAGE
            record["blobs"] = {c["blob"]: c["bytes"] for c in chunks}
        write_atomically(tmp / MANIFEST, json.dumps(record, indent=1).encode())
        fsync_dir(tmp)
        final = self.directory / f"{PREFIX}{step}"
        if os.path.lexists(final):  # a replayed step after a rollback: the newer trajectory wins
            self._delete(final)
        os.rename(tmp, final)
        fsync_dir(self.directory)
        self._prune()

    def _delete(self, path: Path) -> None:
        """Remove a checkpoint folder: renamed out of the `step-N` names first, so that a crash
        while deleting leaves no half checkpoint, only a leftover the next prune removes."""
        if path.is_symlink():  # planted: what it points to is not this run's to delete
            remove_tree(path, self._note)
            return
        doomed = path.with_name(f".{path.name}.deleted-{uuid.uuid4().hex[:8]}")
        os.rename(path, doomed)
        remove_tree(doomed, self._note)

    def _note(self, message: str) -> None:
        """Keep a warning for `Checkpointing.report_errors` (the writer may be a thread)."""
        with self._lock:
            self.errors.append(message)

    def _check_folders(self) -> None:
        """Raise a `RunFileError` when `checkpoints/` or its `blobs/` is a link or no folder."""
        check_checkpoint_folders(self.directory)

    def _prune(self) -> None:
        """Keep the newest `keep` complete checkpoints and the protected ones, and the blobs
        they use; never the rest. Folders go first, then the blobs no remaining manifest names:
        a crash anywhere in between leaves every kept checkpoint whole."""
        complete = self.complete()
        keep = {step_of(p) for p in complete[: self.keep]} | self.protected
        for path in complete[self.keep :]:
            if step_of(path) not in keep:
                self._delete(path)
        for leftover in self.directory.glob(f".{PREFIX}*.deleted-*"):
            remove_tree(leftover, self._note)
        self._collect()

    def _collect(self) -> None:
        """Delete the blobs no `step-N` folder's manifest names (between saves only), in the
        run's own blobs folder only: never in one a link leads to."""
        if os.path.lexists(self.blobs) and self._blobs_are_ours():
            seen = self._memory.seen if self._memory is not None else None
            collect_blobs(self.blobs, self._referenced(), seen)

    def _referenced(self) -> set[str]:
        """Every blob a `step-N` folder's manifest names (one whose manifest cannot be read
        cannot be restored, so it keeps none)."""
        used: set[str] = set()
        for path in self._folders():
            try:
                blobs = read_json(path / MANIFEST, "JSON").get("blobs")
            except (DamagedCheckpoint, AttributeError):
                continue
            if isinstance(blobs, dict):
                used.update(k for k in blobs if isinstance(k, str))
        return used

    def wait(self) -> None:
        """Block until the checkpoint being written is renamed into place (or has failed): the
        future completes before its done-callback, which does the renaming, has run."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    @property
    def writing(self) -> bool:
        return self._pending is not None and not self._pending.is_set()

    # -- reading ----------------------------------------------------------------------------------
    def _folders(self) -> list[Path]:
        """Every `step-N` folder, newest first, complete or not."""
        if not self.directory.is_dir():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()
        ]
        return sorted(found, key=step_of, reverse=True)

    def complete(self) -> list[Path]:
        """Directories of checkpoints with a manifest, newest first (not yet verified)."""
        return [p for p in self._folders() if (p / MANIFEST).is_file()]

    def verify(self, path: Path) -> dict[str, Any]:
        """The manifest of a checkpoint whose step, files and step-bound digests check out, its
        metadata safe to read and its plain state whole; `DamagedCheckpoint` otherwise."""
        step = step_of(path)
        manifest = verify_manifest(path, step)
        if manifest.get("storage") == BLOB_STORAGE:
            seen = self._memory.seen if self._memory is not None else None
            verify_blobs(self.blobs_of(path), manifest.get("blobs"), seen)
        self.metadata(path, manifest)
        for name in manifest["files"]:
            if name == PLAIN_STATE or name.startswith("trainguard-rank"):
                check_plain_state(read_json(path / name, "JSON"), step, name)
        return manifest

    @staticmethod
    def blobs_of(path: Path) -> Path:
        """The blobs folder serving the checkpoint folder `path`."""
        return path.parent / BLOBS

    def metadata(self, path: Path, manifest: dict[str, Any]) -> Any:
        """The checked DCP metadata of a checkpoint whose manifest verified: from its
        `tensors.json` for blobs, else from DCP's own `.metadata`."""
        if manifest.get("storage") == BLOB_STORAGE:
            return read_table(path, manifest["blobs"])
        return read_metadata(path, manifest["files"])

    def reader(self, path: Path, manifest: dict[str, Any]) -> Any:
        """The DCP storage reader of a checkpoint whose manifest verified."""
        if manifest.get("storage") == BLOB_STORAGE:
            return BlobReader(path, manifest["blobs"])
        return SafeReader(path, manifest["files"])

    def load(
        self, path: Path, manifest: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The flat tensors (by DCP key) and the plain state of a verified checkpoint, read into
        fresh tensors: nothing live is touched."""
        step = step_of(path)
        metadata = self.metadata(path, manifest)
        template = {
            key: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in tensor_entries(metadata).items()
        }
        if manifest.get("checksums") == DIGEST_SCHEME and STEP_KEY not in template:
            raise DamagedCheckpoint(f"its tensors do not name their step ({STEP_KEY})")
        try:
            with _quiet_single_process():
                dcp_load(template, storage_reader=self.reader(path, manifest), no_dist=_no_dist())
        except DamagedCheckpoint:
            raise
        except (Exception, CheckpointException) as exc:  # DCP raises several kinds
            reason = _first_line(exc)
            raise DamagedCheckpoint(f"its tensor files cannot be read ({reason})") from None
        written = template.pop(STEP_KEY, None)
        if written is not None and (written.numel() != 1 or int(written.item()) != step):
            raise DamagedCheckpoint(
                f"its tensor files are of step {written.tolist()}, not {step} (moved or copied)"
            )
        plain = check_plain_state(read_json(path / PLAIN_STATE, "JSON"), step)
        return template, plain

    def load_newest(
        self,
        warn: Callable[[str], None],
        accept: Callable[[Path, dict[str, torch.Tensor], dict[str, Any]], Accepted],
    ) -> tuple[dict[str, Any], dict[str, Any], Accepted] | None:
        """Manifest, plain state and `accept`'s answer for the newest checkpoint that verifies,
        loads and that `accept` takes (it raises `DamagedCheckpoint` to pass one over); None
        when there is none. Each one passed over, and each leftover of an interrupted write, is
        warned about (the leftovers are removed: they only hold disk)."""
        if self.directory.is_dir():
            for p in sorted(self.directory.iterdir()):
                if p.name.startswith(f".{PREFIX}") and ".deleted-" in p.name:
                    remove_tree(p, warn)  # a deletion a crash cut short
                elif p.name.startswith(f".{PREFIX}") and ".tmp-" in p.name:
                    remove_tree(p, warn)
                    warn(
                        f"{p.name}: an incomplete checkpoint (the run stopped while writing it); "
                        "removed"
                    )
        for path in self._folders():
            if not (path / MANIFEST).is_file():
                warn(f"{path.name} has no {MANIFEST} and is passed over; using the one before it")
                continue
            try:
                manifest = self.verify(path)
                tensors, plain = self.load(path, manifest)
                accepted = accept(path, tensors, plain)
            except DamagedCheckpoint as exc:
                warn(passed_over(path, exc))
                continue
            manifest["path"] = str(path)
            return manifest, plain, accepted
        return None


def _first_line(exc: BaseException) -> str:
    """One line of an exception, DCP's wrapped ones unwrapped."""
    if isinstance(exc, CheckpointException):
        inner = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        text = "; ".join(f"{type(e).__name__}: {e}" for e in inner)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return (text.strip().splitlines() or [type(exc).__name__])[0][:300]


def _split_optimizer_state(
    state: dict[Any, dict[str, Any]],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per-parameter optimizer state in two: its tensors (for DCP) and the rest (for JSON)."""
    tensors: dict[str, dict[str, Any]] = {}
    plain: dict[str, dict[str, Any]] = {}
    for pid, values in state.items():
        for key, value in values.items():
            target = tensors if isinstance(value, torch.Tensor) else plain
            target.setdefault(str(pid), {})[key] = value
    return tensors, plain


def plain_name(rank: int | None) -> str:
    """The file of a rank's plain state in a checkpoint (one file without ranks)."""
    return PLAIN_STATE if rank is None else f"trainguard-rank{rank}.json"


def sharded_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, rank: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`training_state` for a distributed run, through DCP's `get_state_dict` (DDP and FSDP2
    alike: replicated tensors are written once, shards by their owners); random states are
    keyed by rank."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    both: Any = get_state_dict(model, optimizer)
    model_sd, optim_sd = both
    opt_tensors, opt_plain = _split_optimizer_state(optim_sd["state"])
    rng = rng_state()
    own: dict[str, Any] = {"torch": rng["torch"]}
    if "cuda" in rng:
        own["cuda"] = {str(i): t for i, t in enumerate(rng["cuda"])}
    tensors = {
        "model": model_sd,
        "optimizer": {"state": opt_tensors},
        "rng": {f"rank{rank}": own},
    }
    plain = {
        "optimizer": {
            "class": type(optimizer).__name__,
            "param_groups": optim_sd["param_groups"],
            "state": opt_plain,
        },
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": rng_to_plain({k: v for k, v in rng.items() if k != "cuda"}),
    }
    return tensors, plain


def load_sharded(
    store: CheckpointStore,
    path: Path,
    manifest: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    rank: int,
) -> dict[str, Any]:
    """Load this rank's part of a distributed checkpoint (verified by rank 0) into the live
    objects once it fits them; its plain state."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    plain_file = path / plain_name(rank)
    if not plain_file.is_file():
        raise TrainguardError(
            f"{path} has no state for rank {rank}: resume with the world size it was written with"
        )
    step = step_of(path)
    plain = check_plain_state(read_json(plain_file, "JSON"), step, plain_file.name)
    tensors, _ = sharded_training_state(model, optimizer, None, None, rank)
    metadata = store.metadata(path, manifest)
    saved = {
        k[len("model.") :]: m.size
        for k, m in tensor_entries(metadata).items()
        if k.startswith("model.")
    }
    live = {k: v.shape for k, v in tensors["model"].items() if isinstance(v, torch.Tensor)}
    check_fits(path, mismatches(saved, live, plain, optimizer, scheduler, scaler))
    bound = STEP_KEY in metadata.state_dict_metadata
    if bound:
        tensors["trainguard"] = {"step": torch.tensor(-1, dtype=torch.int64)}
    try:
        dcp_load(
            tensors,
            storage_reader=store.reader(path, manifest),
            process_group=store.group,
        )
    except (Exception, CheckpointException) as exc:
        raise TrainguardError(
            f"cannot resume from {path}: its tensor files cannot be read ({_first_line(exc)}); "
            "move that folder aside to resume from the one before it"
        ) from None
    if bound and int(tensors["trainguard"]["step"].item()) != step:
        raise TrainguardError(f"cannot resume from {path}: its tensor files are of another step")
    own = tensors["rng"][f"rank{rank}"]
    rng = check_rng(plain["rng"], own["torch"])
    if "cuda" in own:
        rng["cuda"] = [own["cuda"][k] for k in sorted(own["cuda"], key=int)]
    state = {
        name: {**tensors["optimizer"]["state"].get(name, {}), **values}
        for name, values in plain["optimizer"]["state"].items()
    }
    for name, values in tensors["optimizer"]["state"].items():
        state.setdefault(name, values)
    optim_state: Any = {"state": state, "param_groups": plain["optimizer"]["param_groups"]}
    set_state_dict(
        model, optimizer, model_state_dict=tensors["model"], optim_state_dict=optim_state
    )
    _restore_the_rest(plain, scheduler, scaler, rng)
    return plain


def _restore_the_rest(plain: dict[str, Any], scheduler: Any, scaler: Any, rng: Any) -> None:
    """Put back the scheduler, the scaler and the random states, once weights and optimizer are."""
    if scheduler is not None and plain["scheduler"] is not None:
        scheduler.load_state_dict(plain["scheduler"])
    if scaler is not None and plain["scaler"] is not None:
        scaler.load_state_dict(plain["scaler"])
    set_rng_state(rng)


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's state split in two: tensors for DCP (weights, optimizer moments, torch and CUDA
    random states) and plain JSON-ready data (hyperparameters, scheduler, scaler, Python and
    NumPy random states)."""
    opt = optimizer.state_dict()
    opt_tensors, opt_plain = _split_optimizer_state(opt["state"])
    rng = rng_state()
    tensors: dict[str, Any] = {
        "model": model.state_dict(),
        "optimizer": {"state": opt_tensors},
        "rng": {"torch": rng["torch"]},
    }
    if "cuda" in rng:
        tensors["rng"]["cuda"] = {str(i): t for i, t in enumerate(rng["cuda"])}
    plain_rng = rng_to_plain({k: v for k, v in rng.items() if k != "cuda"})
    plain = {
        "optimizer": {
            "class": type(optimizer).__name__,
            "param_groups": opt["param_groups"],
            "state": opt_plain,
        },
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": plain_rng,
    }
    return tensors, plain


class CheckpointMismatch(TrainguardError):
    """A whole checkpoint that does not fit the model, optimizer, scheduler or scaler it is
    resumed into."""


def mismatches(
    saved_shapes: dict[str, torch.Size],
    live_shapes: dict[str, torch.Size],
    plain: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
) -> list[str]:
    """What differs between a checkpoint (its model tensors' shapes, its plain state) and the
    live objects, one phrase each; empty when it fits."""
    found: list[str] = []
    missing = sorted(live_shapes.keys() - saved_shapes.keys())
    extra = sorted(saved_shapes.keys() - live_shapes.keys())
    reshaped = sorted(
        k for k in live_shapes.keys() & saved_shapes.keys() if live_shapes[k] != saved_shapes[k]
    )
    if missing:
        found.append(f"the model has {len(missing)} tensor(s) it lacks ({_few(missing)})")
    if extra:
        found.append(f"it has {len(extra)} model tensor(s) the model lacks ({_few(extra)})")
    if reshaped:
        k = reshaped[0]
        found.append(
            f"{len(reshaped)} model tensor(s) differ in shape ({k}: "
            f"{list(saved_shapes[k])} saved, {list(live_shapes[k])} now)"
        )
    saved_opt = plain["optimizer"]
    saved_class = saved_opt.get("class")
    if saved_class is not None and saved_class != type(optimizer).__name__:
        found.append(f"its optimizer is {saved_class}, the run's is {type(optimizer).__name__}")
    groups = saved_opt["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        found.append(
            f"its optimizer has {len(groups)} param group(s), the run's "
            f"{len(optimizer.param_groups)}"
        )
    else:
        for i, (saved, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
            if len(saved["params"]) != len(live["params"]):
                found.append(
                    f"param group {i} holds {len(saved['params'])} parameters saved, "
                    f"{len(live['params'])} now"
                )
            keys = saved.keys() ^ live.keys()
            if keys and saved_class is None:
                found.append(
                    f"param group {i} has other hyperparameters ({_few(sorted(keys))}): "
                    "another optimizer"
                )
    if (plain["scheduler"] is None) != (scheduler is None):  # the schedule would restart or go
        found.append(
            f"it has no scheduler state, the run has a {type(scheduler).__name__}"
            if scheduler is not None
            else "it has a scheduler state, the run has no scheduler"
        )
    for name, live_obj in (("scheduler", scheduler), ("scaler", scaler)):
        saved_state = plain[name]
        if live_obj is not None and saved_state is not None:
            live_keys = set(live_obj.state_dict())
            if set(saved_state) != live_keys:
                diff = sorted(set(saved_state) ^ live_keys)
                found.append(f"its {name} state has other fields ({_few(diff)}): another {name}")
    return found


def _few(names: list[str], shown: int = 3) -> str:
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_fits(path: Path, differences: list[str]) -> None:
    """Raise one `CheckpointMismatch` naming every difference, with what to do."""
    if differences:
        raise CheckpointMismatch(
            f"cannot resume from {path}: the checkpoint does not fit this run: "
            + "; ".join(differences)
            + ". Resume with the model and optimizer it was written with, or give a new run_dir"
        )


def check_rng(plain_rng: Any, torch_state: torch.Tensor | None) -> dict[str, Any]:
    """The random states of a checkpoint, once each one loads into a fresh generator."""
    try:
        rng = rng_from_plain({**plain_rng, "torch": []})
        random.Random().setstate(rng["python"])
        np.random.RandomState().set_state(rng["numpy"])
        if torch_state is not None:
            torch.Generator().set_state(torch_state)
            rng["torch"] = torch_state
    except Exception as exc:  # malformed lists raise TypeError, ValueError or KeyError
        raise DamagedCheckpoint(f"its random state is malformed ({_first_line(exc)})") from None
    return rng


def prepare_restore(
    path: Path,
    tensors: dict[str, torch.Tensor],
    plain: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
) -> Callable[[], None]:
    """Check that a loaded checkpoint fits the live objects and is whole, touching none of them;
    the function that then puts back what `training_state` captured."""
    weights = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    live = {k: v.shape for k, v in model.state_dict().items()}
    saved = {k: v.shape for k, v in weights.items()}
    check_fits(path, mismatches(saved, live, plain, optimizer, scheduler, scaler))
    opt_state: dict[int, dict[str, Any]] = {}
    try:
        for key, value in tensors.items():
            if key.startswith("optimizer.state."):
                pid, name = key[len("optimizer.state.") :].split(".", 1)
                opt_state.setdefault(int(pid), {})[name] = value
        for pid, values in plain["optimizer"]["state"].items():
            opt_state.setdefault(int(pid), {}).update(values)
    except (ValueError, TypeError, AttributeError) as exc:
        raise DamagedCheckpoint(f"its optimizer state is malformed ({_first_line(exc)})") from None
    if "rng.torch" not in tensors:
        raise DamagedCheckpoint("it has no torch random state")
    rng = check_rng(plain["rng"], tensors["rng.torch"])
    cuda = sorted(k for k in tensors if k.startswith("rng.cuda."))
    if cuda:
        rng["cuda"] = [tensors[k] for k in cuda]
    groups = plain["optimizer"]["param_groups"]

    def apply() -> None:
        model.load_state_dict(weights)
        optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
        _restore_the_rest(plain, scheduler, scaler, rng)

    return apply
