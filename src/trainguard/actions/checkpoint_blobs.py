"""Checkpoints by change: each tensor's bytes stored once, in a blob named by their sha256 in a
`blobs` folder shared by the checkpoints, so that a tensor unchanged since the last checkpoint is
not written again. A DCP storage writer and reader, so plain, sharded and asynchronous saves all
go through DCP's planning as before; the tensor table is JSON, never a pickle."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from bisect import bisect_left
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from trainguard.actions.checkpoint_files import (
    TENSOR_TABLE,
    DamagedCheckpoint,
    open_file,
    read_json,
)
from trainguard.events import TrainguardError
from trainguard.run_files import create_temporary, reason, write_atomically

BLOBS = "blobs"  # the folder of blobs, next to the `step-N` folders it serves
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TMP = ".tmp-"  # a blob being written; renamed to its digest once whole


def blob_path(blobs: Path, digest: str) -> Path:
    """Where the blob of `digest` lives: one flat folder, synced once per save."""
    return blobs / digest


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a flat uint8 tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU tensors hold the very same bytes (-0.0 is not 0.0, and a NaN
    equals itself), compared eight bytes at a time where they allow it."""
    x, y = byte_view(a), byte_view(b)
    if x.numel() != y.numel():
        return False
    for wide in (torch.int64, torch.int32):
        try:
            return bool(torch.equal(x.view(wide), y.view(wide)))
        except RuntimeError:  # a size or an offset that the wider type does not divide
            continue
    return bool(torch.equal(x, y))


def blob_digest(data: torch.Tensor) -> str:
    """The sha256 of a contiguous CPU tensor's bytes."""
    return hashlib.sha256(byte_view(data).numpy().data).hexdigest()


StatKey = tuple[int, int, int, int]  # a blob file's size, mtime_ns, ctime_ns and inode


def stat_key(st: os.stat_result) -> StatKey:
    """What tells that a file changed since it was written or hashed, without reading it."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def hash_open(f: BinaryIO) -> str:
    """The sha256 of an open file's bytes, read a megabyte at a time."""
    hasher = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        hasher.update(block)
    return hasher.hexdigest()


def foreign_blobs(directory: Path) -> Path | None:
    """Where `directory/blobs` really is when it lies outside the run folder (`directory`'s
    parent): the checkpoints or blobs folder a link to elsewhere; None when it is the run's own."""
    try:
        real = (directory / BLOBS).resolve()
        own = directory.parent.resolve() / directory.name / BLOBS
    except (OSError, RuntimeError):  # a loop of links
        return directory / BLOBS
    return None if real == own else real


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DigestMemory:
    """What the stager knows of its buffers: the digest of the bytes each one holds, kept while
    they are unchanged, so that an unchanged tensor is neither hashed nor written again; and the
    file of each blob as this store last wrote or hashed it, so that a reused blob is re-hashed
    only when its file changed."""

    def __init__(self) -> None:
        # (buffer address, bytes) -> digest: a view of no bytes shares its address with the next
        self.digests: dict[tuple[int, int], str] = {}
        self.seen: dict[str, StatKey] = {}  # blob digest -> its file when written or verified

    @staticmethod
    def _key(data: torch.Tensor) -> tuple[int, int]:
        return data.data_ptr(), data.numel() * data.element_size()

    def forget(self, buffer: torch.Tensor) -> None:
        self.digests.pop(self._key(buffer), None)

    def known(self, data: torch.Tensor) -> str | None:
        """The digest of a whole staged buffer whose bytes have not changed since it was hashed."""
        return self.digests.get(self._key(data))

    def remember(self, data: torch.Tensor, digest: str, buffers: set[int]) -> None:
        if data.data_ptr() in buffers:
            self.digests[self._key(data)] = digest

    def clear(self) -> None:
        self.digests.clear()
        self.seen.clear()


class BlobWriter(StorageWriter):
    """Writes each tensor chunk of a DCP save as a blob (skipped when that blob is already there
    and whole, rewritten with a warning when it is damaged or gone), and the checkpoint folder's
    `tensors.json` naming them; counts the bytes written and hashed."""

    def __init__(
        self,
        blobs: Path,
        memory: DigestMemory,
        buffers: set[int],
        step: int | None = None,
        warn: Callable[[str], None] | None = None,
        ready: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self.ready = ready  # blocks until the staged buffers hold their copies (writer thread)
        self.blobs = blobs
        self.memory = memory
        self.buffers = buffers  # addresses of the stager's buffers, whose digests may be kept
        self.step = step
        self.warn = warn
        self.path = Path()
        self.written = 0  # blob bytes this rank wrote in this save
        self.hashed = 0  # blob bytes this rank hashed in this save (tensors and reused files)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.written = 0
        self.hashed = 0

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: every rank writes into the shared blobs folder."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        self.blobs.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        if self.ready is not None:
            self.ready()
        results: list[WriteResult] = []
        touched = False
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise TrainguardError(
                    f"{item.index.fqn} is not a tensor; a checkpoint holds tensors only"
                )
            resolved = planner.resolve_data(item)
            assert isinstance(resolved, torch.Tensor)  # TENSOR and SHARD items resolve to one
            data = resolved.detach().cpu().contiguous()
            digest = self.memory.known(data)
            if digest is None:
                digest = blob_digest(data)
                self.hashed += data.numel() * data.element_size()
                self.memory.remember(data, digest, self.buffers)
            size = data.numel() * data.element_size()
            target = blob_path(self.blobs, digest)
            fault = self._check(target, digest, size)
            if fault is not None:
                self._write_blob(target, data)
                self.memory.seen[digest] = stat_key(os.lstat(target))
                touched = True
                self.written += size
                if fault and self.warn is not None:
                    at = f" at step {self.step}" if self.step is not None else ""
                    self.warn(
                        f"blob {digest[:12]} of {item.index.fqn} {fault}; "
                        f"rewritten from the live tensor{at}"
                    )
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=digest))
        if touched:
            fsync_dir(self.blobs)
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results)
        return done

    def _check(self, target: Path, digest: str, size: int) -> str | None:
        """None when the blob of `digest` is on disk and whole; otherwise what is wrong with it
        ("" for a blob never there): its size by `lstat`, its bytes re-hashed only when its file
        changed since this store wrote or hashed it."""
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            return f"had vanished from {BLOBS}/ (deleted)" if digest in self.memory.seen else ""
        if not stat.S_ISREG(st.st_mode):
            return "was not a regular file"
        if st.st_size != size:
            return f"was damaged on disk ({st.st_size} bytes, not {size})"
        if self.memory.seen.get(digest) == stat_key(st):
            return None
        try:
            with open_file(target) as f:
                actual, opened = hash_open(f), os.fstat(f.fileno())
        except OSError as exc:
            return f"could not be read ({exc.strerror})"
        self.hashed += size
        if actual != digest or opened.st_size != size:
            return "was damaged on disk (its bytes fail their checksum)"
        self.memory.seen[digest] = stat_key(opened)
        return None

    @staticmethod
    def _write_blob(target: Path, data: torch.Tensor) -> None:
        """Write a blob whole or not at all: into a temporary name, synced, then renamed."""
        fd, tmp = create_temporary(target.parent, f"{_TMP}{target.name}-")  # O_EXCL, no link
        try:
            with open(fd, "wb") as f:
                f.write(byte_view(data).numpy().data)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write `tensors.json`: each tensor's dtype and size, each chunk's place and blob."""
        blobs = {r.index: (r.storage_data, r.size_in_bytes) for rs in results for r in rs}
        table: dict[str, Any] = {}
        for key, meta in metadata.state_dict_metadata.items():
            if not isinstance(meta, TensorStorageMetadata):
                raise TrainguardError(f"{key} is not a tensor; a checkpoint holds tensors only")
            chunks = []
            for chunk in meta.chunks:
                digest, size = blobs[MetadataIndex(key, chunk.offsets)]
                chunks.append(
                    {
                        "offsets": list(chunk.offsets),
                        "sizes": list(chunk.sizes),
                        "blob": digest,
                        "bytes": size,
                    }
                )
            table[key] = {
                "dtype": str(meta.properties.dtype).removeprefix("torch."),
                "size": list(meta.size),
                "chunks": chunks,
            }
        write_atomically(self.path / TENSOR_TABLE, json.dumps({"tensors": table}).encode())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path))


class StoredChunk(NamedTuple):
    """Where a tensor chunk's bytes are: its blob, their length, the chunk's shape and dtype."""

    digest: str
    nbytes: int
    sizes: torch.Size
    dtype: torch.dtype


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def read_table(path: Path, blobs: dict[str, int]) -> Metadata:
    """DCP metadata built from a checkpoint's `tensors.json`, once every entry is a tensor of a
    known dtype whose chunks lie inside it, each in a blob of the manifest (`blobs`) holding
    exactly its bytes; `DamagedCheckpoint` otherwise."""
    raw = read_json(path / TENSOR_TABLE, "JSON")
    bad = f"its {TENSOR_TABLE} is malformed"
    table = raw.get("tensors") if isinstance(raw, dict) else None
    if not isinstance(table, dict):
        raise DamagedCheckpoint(f"{bad}: no table of tensors")
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, StoredChunk] = {}
    for key, entry in table.items():
        dtype = getattr(torch, str(entry.get("dtype")), None) if isinstance(entry, dict) else None
        if not isinstance(dtype, torch.dtype) or not _ints(entry.get("size")):
            raise DamagedCheckpoint(f"{bad}: {key} has no dtype or size")
        size = torch.Size(entry["size"])
        chunks = []
        for chunk in entry.get("chunks") if isinstance(entry.get("chunks"), list) else [None]:
            if not (
                isinstance(chunk, dict)
                and _ints(chunk.get("offsets"))
                and _ints(chunk.get("sizes"))
                and len(chunk["offsets"]) == len(chunk["sizes"]) == len(size)
                and all(
                    o + s <= n
                    for o, s, n in zip(chunk["offsets"], chunk["sizes"], size, strict=True)
                )
            ):
                raise DamagedCheckpoint(f"{bad}: a chunk of {key} lies outside it")
            digest, nbytes = chunk.get("blob"), chunk.get("bytes")
            expected = math.prod(chunk["sizes"]) * dtype.itemsize
            if not isinstance(digest, str) or blobs.get(digest) != nbytes or nbytes != expected:
                raise DamagedCheckpoint(
                    f"{bad}: a chunk of {key} names a blob its manifest does not list"
                )
            offsets = torch.Size(chunk["offsets"])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk["sizes"])))
            sizes = torch.Size(chunk["sizes"])
            storage[MetadataIndex(key, offsets)] = StoredChunk(digest, nbytes, sizes, dtype)
        if not covers(size, chunks):
            raise DamagedCheckpoint(
                f"{bad}: the chunks of {key} do not cover it exactly (a gap or an overlap)"
            )
        entries[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), size, chunks)
    return Metadata(state_dict_metadata=entries, storage_data=storage, storage_meta=StorageMeta())


_MAX_CELLS = 1 << 22  # the finest grid of chunks `covers` checks (16 MB of counts)


def covers(size: torch.Size, chunks: list[ChunkStorageMetadata]) -> bool:
    """Whether chunks lying inside a tensor of `size` cover each of its elements exactly once:
    their volumes add up to its own, and on the grid their edges cut it into, each cell is in
    exactly one chunk."""
    total = math.prod(size)
    if sum(math.prod(c.sizes) for c in chunks) != total:
        return False
    solid = [c for c in chunks if math.prod(c.sizes) > 0]
    if len(solid) <= 1:  # one chunk inside, as large as the tensor: the tensor itself
        return True
    edges = [
        sorted({0, n, *(c.offsets[d] for c in solid), *(c.offsets[d] + c.sizes[d] for c in solid)})
        for d, n in enumerate(size)
    ]
    if math.prod(len(e) - 1 for e in edges) > _MAX_CELLS:
        return False  # finer than any real sharding
    grid = torch.zeros([len(e) - 1 for e in edges], dtype=torch.int32)
    for c in solid:
        cells = tuple(
            slice(bisect_left(e, o), bisect_left(e, o + n))
            for e, o, n in zip(edges, c.offsets, c.sizes, strict=True)
        )
        grid[cells] += 1
    return bool((grid == 1).all())


def verify_blobs(
    blobs_dir: Path, blobs: Any, seen: dict[str, StatKey] | None = None
) -> dict[str, int]:
    """The manifest's blobs ({digest: bytes}) once each one is a regular file with its size and
    its bytes hash to its name (each noted in `seen`); `DamagedCheckpoint` naming the first that
    does not."""
    if not isinstance(blobs, dict) or not all(
        isinstance(k, str) and _HEX64.fullmatch(k) and type(v) is int and v >= 0
        for k, v in blobs.items()
    ):
        raise DamagedCheckpoint("its manifest has no valid list of blobs")
    for digest, size in blobs.items():
        file = blob_path(blobs_dir, digest)
        try:
            with open_file(file) as f:
                opened = os.fstat(f.fileno())
                actual_size = opened.st_size
                actual = hash_open(f) if actual_size == size else ""
        except FileNotFoundError:
            raise DamagedCheckpoint(f"its blob {digest[:12]} is missing from {BLOBS}/") from None
        except OSError as exc:
            raise DamagedCheckpoint(
                f"its blob {digest[:12]} cannot be read ({reason(exc)})"
            ) from None
        if actual_size != size or actual != digest:
            raise DamagedCheckpoint(f"its blob {digest[:12]} fails its checksum (damaged)")
        if seen is not None:
            seen[digest] = stat_key(opened)
    return blobs


class BlobReader(StorageReader):
    """Reads a blob checkpoint for DCP: metadata from its `tensors.json`, each chunk from its
    blob's raw bytes (nothing is unpickled)."""

    def __init__(self, path: Path, blobs: dict[str, int]) -> None:
        super().__init__()
        self.path = path
        self.blobs = blobs
        self.storage: dict[MetadataIndex, StoredChunk] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_table(self.path, self.blobs)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        blobs_dir = self.path.parent / BLOBS
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise DamagedCheckpoint(f"{item.storage_index.fqn} is not a tensor")
            chunk = self.storage[item.storage_index]
            target = planner.resolve_tensor(item).detach()
            try:
                with open_file(blob_path(blobs_dir, chunk.digest)) as f:
                    raw = bytearray(f.read(chunk.nbytes + 1))
            except OSError as exc:
                raise DamagedCheckpoint(
                    f"its blob {chunk.digest[:12]} cannot be read ({reason(exc)})"
                ) from None
            if len(raw) != chunk.nbytes:
                raise DamagedCheckpoint(f"its blob {chunk.digest[:12]} has the wrong size")
            stored = (
                torch.frombuffer(raw, dtype=chunk.dtype).reshape(chunk.sizes)
                if raw
                else torch.empty(chunk.sizes, dtype=chunk.dtype)
            )
            for dim, (offset, length) in enumerate(
                zip(item.storage_offsets, item.lengths, strict=True)
            ):
                stored = stored.narrow(dim, offset, length)
            target.copy_(stored)
            planner.commit_tensor(item, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


def collect_blobs(
    blobs_dir: Path, referenced: set[str], seen: dict[str, StatKey] | None = None
) -> int:
    """Delete every blob no kept checkpoint uses (and leftovers of blob writes a crash cut
    short), each a regular file in a real folder (a link, to the folder or in it, is never
    followed or deleted through), forgetting it in `seen`; the number of bytes freed. Only
    called between saves, when no blob is in flight, on a folder `foreign_blobs` calls the run's."""
    try:
        folder = os.open(blobs_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # absent, or a link: nothing of this run's to collect there
        return 0
    freed = 0
    try:
        for name in os.listdir(folder):
            if name in referenced or not (name.startswith(_TMP) or _HEX64.fullmatch(name)):
                continue
            try:
                st = os.lstat(name, dir_fd=folder)
                if not stat.S_ISREG(st.st_mode):
                    continue
                os.unlink(name, dir_fd=folder)
            except OSError:  # gone already, or not ours to delete: the next pass retries
                continue
            freed += st.st_size
            if seen is not None:
                seen.pop(name, None)
    finally:
        os.close(folder)
    return freed
