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
from pathlib import Path
from typing import Any, NamedTuple

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
    read_json,
)
from trainguard.events import TrainguardError
from trainguard.run_files import create_temporary, write_atomically

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


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DigestMemory:
    """What the stager knows of its buffers: the digest of the bytes each one holds, kept while
    they are unchanged, so that an unchanged tensor is neither hashed nor written again."""

    def __init__(self) -> None:
        self.digests: dict[int, tuple[str, int]] = {}  # buffer address -> (digest, bytes)

    def forget(self, buffer: torch.Tensor) -> None:
        self.digests.pop(buffer.data_ptr(), None)

    def known(self, data: torch.Tensor) -> str | None:
        """The digest of a whole staged buffer whose bytes have not changed since it was hashed."""
        entry = self.digests.get(data.data_ptr())
        if entry is None or entry[1] != data.numel() * data.element_size():
            return None
        return entry[0]

    def remember(self, data: torch.Tensor, digest: str, buffers: set[int]) -> None:
        if data.data_ptr() in buffers:
            self.digests[data.data_ptr()] = (digest, data.numel() * data.element_size())

    def clear(self) -> None:
        self.digests.clear()


class BlobWriter(StorageWriter):
    """Writes each tensor chunk of a DCP save as a blob (skipped when that blob is already
    there), and the checkpoint folder's `tensors.json` naming them; counts the bytes written."""

    def __init__(self, blobs: Path, memory: DigestMemory, buffers: set[int]) -> None:
        super().__init__()
        self.blobs = blobs
        self.memory = memory
        self.buffers = buffers  # addresses of the stager's buffers, whose digests may be kept
        self.path = Path()
        self.written = 0  # blob bytes this rank wrote in this save
        self.hashed = 0  # blob bytes this rank hashed in this save

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
            if not target.is_file():
                self._write_blob(target, data)
                touched = True
                self.written += size
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=digest))
        if touched:
            fsync_dir(self.blobs)
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results)
        return done

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
        entries[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), size, chunks)
    return Metadata(state_dict_metadata=entries, storage_data=storage, storage_meta=StorageMeta())


def verify_blobs(blobs_dir: Path, blobs: Any) -> dict[str, int]:
    """The manifest's blobs ({digest: bytes}) once each one is there with its size and its
    bytes hash to its name; `DamagedCheckpoint` naming the first that does not."""
    if not isinstance(blobs, dict) or not all(
        isinstance(k, str) and _HEX64.fullmatch(k) and type(v) is int and v >= 0
        for k, v in blobs.items()
    ):
        raise DamagedCheckpoint("its manifest has no valid list of blobs")
    for digest, size in blobs.items():
        file = blob_path(blobs_dir, digest)
        try:
            actual_size = file.stat().st_size
            if actual_size == size:
                hasher = hashlib.sha256()
                with file.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        hasher.update(block)
        except FileNotFoundError:
            raise DamagedCheckpoint(f"its blob {digest[:12]} is missing from {BLOBS}/") from None
        except OSError as exc:
            raise DamagedCheckpoint(
                f"its blob {digest[:12]} cannot be read ({exc.strerror})"
            ) from None
        if actual_size != size or hasher.hexdigest() != digest:
            raise DamagedCheckpoint(f"its blob {digest[:12]} fails its checksum (damaged)")
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
                raw = bytearray(blob_path(blobs_dir, chunk.digest).read_bytes())
            except OSError as exc:
                raise DamagedCheckpoint(
                    f"its blob {chunk.digest[:12]} cannot be read ({exc.strerror})"
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


def collect_blobs(blobs_dir: Path, referenced: set[str]) -> int:
    """Delete every blob no kept checkpoint uses (and leftovers of blob writes a crash cut
    short); the number of bytes freed. Only called between saves, when no blob is in flight."""
    if not blobs_dir.is_dir():
        return 0
    freed = 0
    for file in blobs_dir.iterdir():
        if file.name in referenced:
            continue
        if file.name.startswith(_TMP) or _HEX64.fullmatch(file.name):
            try:
                freed += file.stat().st_size
                file.unlink()
            except OSError:  # gone already, or not ours to delete: the next pass retries
                continue
    return freed
