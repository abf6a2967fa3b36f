"""What a checkpoint folder may hold: step-bound file digests, a manifest and a plain state of the
right shape, and DCP metadata read through an exact allow-list that can construct nothing else."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import pickletools
import re
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from trainguard._torch_private import DcpStorageInfo
from trainguard.events import TrainguardError
from trainguard.run_files import READ, open_regular, read_bytes, reason

MANIFEST = "manifest.json"
PLAIN_STATE = "trainguard.json"
METADATA = ".metadata"
STEP_KEY = "trainguard.step"  # the step, written among the tensors, so the data names its step
TENSOR_TABLE = "tensors.json"  # a blob checkpoint's tensors: dtype, size, each chunk's blob
BLOB_STORAGE = "blobs"  # the manifest's `storage` of a checkpoint whose tensors are blobs
DIGEST_SCHEME = "sha256-step"  # sha256 over a header naming the step and the file, then the bytes
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_PLAIN_KEYS = {"optimizer", "scheduler", "scaler", "rng", "guard", "data"}


class DamagedCheckpoint(TrainguardError):
    """A checkpoint whose files are missing, malformed or inconsistent: it is passed over."""


_DCP = "torch.distributed.checkpoint.metadata"
_BUILT = frozenset(  # the dataclasses DCP's metadata builds (NEWOBJ, then BUILD their fields)
    {
        (_DCP, "Metadata"),
        (_DCP, "MetadataIndex"),
        (_DCP, "StorageMeta"),
        (_DCP, "TensorProperties"),
        (_DCP, "TensorStorageMetadata"),
        (_DCP, "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }
)
_CALLED = frozenset(  # what it calls (REDUCE) for a value: a size, a layout, an enum, a path
    {("torch", "Size"), ("torch.serialization", "_get_layout"), (_DCP, "_MEM_FORMAT_ENCODING")}
    | {(m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "WindowsPath")}
)
_DATA_OPS = frozenset(  # opcodes that push a plain value
    [
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG1",
        "LONG4",
        "BINFLOAT",
        "EMPTY_TUPLE",
        "SHORT_BINBYTES",
        "BINBYTES",
    ]
)
_STR_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})
_CONTAINER_OPS = {"EMPTY_DICT": "dict", "EMPTY_LIST": "list"}
_FILL_OPS = {"APPEND": ("list", 1), "APPENDS": ("list", None), "SETITEM": ("dict", 2)}
_FILL_OPS["SETITEMS"] = ("dict", None)
_TUPLE_OPS = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}


def check_pickle_program(raw: bytes) -> None:
    """Read DCP metadata's pickle as a program before it runs: only the opcodes DCP writes,
    calls only of `_CALLED`, objects built only of `_BUILT`, and fields set and containers filled
    only on what the pickle itself made, never on a class, a function or a shared object."""
    stack: list[tuple[str, ...]] = []
    marks: list[int] = []
    memo: dict[int, tuple[str, ...]] = {}
    refuse = f"its {METADATA} is not the pickle DCP writes"
    try:
        for op, arg, _ in pickletools.genops(raw):
            name = op.name
            if name in ("PROTO", "FRAME", "STOP"):
                continue
            if name in _DATA_OPS:
                stack.append(("value",))
            elif name in _STR_OPS:
                stack.append(("str", str(arg)))
            elif name in _CONTAINER_OPS:
                stack.append((_CONTAINER_OPS[name],))
            elif name == "MARK":
                marks.append(len(stack))
            elif name == "TUPLE":
                del stack[marks.pop() :]
                stack.append(("value",))
            elif name in _TUPLE_OPS:
                del stack[len(stack) - _TUPLE_OPS[name] :]
                stack.append(("value",))
            elif name in _FILL_OPS:
                kind, count = _FILL_OPS[name]
                del stack[marks.pop() if count is None else len(stack) - count :]
                if stack[-1][0] != kind:
                    raise DamagedCheckpoint(f"{refuse}: {name} on a {stack[-1][0]}")
            elif name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET") and isinstance(arg, int):
                stack.append(memo[arg])
            elif name == "STACK_GLOBAL":
                attr, module = stack.pop(), stack.pop()
                if module[0] != "str" or attr[0] != "str":
                    raise DamagedCheckpoint(f"{refuse}: a global named by no string")
                stack.append(("global", module[1], attr[1]))
            elif name in ("REDUCE", "NEWOBJ"):
                stack.pop()  # the arguments
                target = stack.pop()
                allowed = _CALLED if name == "REDUCE" else _BUILT
                if target[0] != "global" or target[1:] not in allowed:
                    what = ".".join(target[1:]) if target[0] == "global" else f"a {target[0]}"
                    raise DamagedCheckpoint(f"{refuse}: {name} of {what}")
                stack.append(("value",) if name == "REDUCE" else ("object",))
            elif name == "BUILD":
                stack.pop()  # the state
                if stack[-1][0] != "object":
                    raise DamagedCheckpoint(f"{refuse}: BUILD sets fields of a {stack[-1][0]}")
            else:
                raise DamagedCheckpoint(f"{refuse}: it holds the opcode {name}")
    except DamagedCheckpoint:
        raise
    except (ValueError, IndexError, KeyError) as exc:  # a garbled or truncated program
        raise DamagedCheckpoint(f"its {METADATA} is not DCP metadata ({exc!r})") from None


@cache
def _allowed_globals() -> frozenset[tuple[str, str]]:
    """Exactly the (module, name) pairs DCP's metadata pickles refer to: no dotted names, no
    module prefixes, nothing that runs code when it is called with any arguments."""
    pairs = set(_BUILT | _CALLED)  # paths: StorageMeta.checkpoint_id (3.13 moved them)
    pairs |= {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    return frozenset(pairs)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: only the exact globals of `_allowed_globals`, looked up as they
    are named (a dotted name such as `os.system` under an allowed module is refused)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _allowed_globals():
            raise DamagedCheckpoint(
                f"its {METADATA} names {module}.{name}, which a checkpoint never holds; "
                "refusing to unpickle it"
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise DamagedCheckpoint(f"its {METADATA} holds a persistent id; refusing to unpickle it")


def open_file(path: Path) -> BinaryIO:
    """A checkpoint file opened for reading if it is a regular file: never through a link, never
    blocking on a FIFO or opening a device (a `RunFileError`, an `OSError`, otherwise)."""
    return open(open_regular(path, READ), "rb")


def read_metadata(path: Path, files: dict[str, str] | None = None) -> Metadata:
    """The DCP metadata of the checkpoint at `path`, unpickled safely and checked: every entry a
    tensor, every storage file a plain name in the folder (and in `files`, the manifest's list)."""
    try:
        raw = read_bytes(path / METADATA)
    except OSError as exc:
        raise DamagedCheckpoint(f"its {METADATA} cannot be read ({reason(exc)})") from None
    check_pickle_program(raw)
    try:
        metadata = MetadataUnpickler(io.BytesIO(raw)).load()
    except DamagedCheckpoint:
        raise
    except Exception as exc:  # a truncated or garbled pickle raises any of several kinds
        raise DamagedCheckpoint(f"its {METADATA} is not DCP metadata ({exc!r})") from None
    _check_metadata(metadata, files)
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    return metadata  # type: ignore[no-any-return]


def _check_metadata(metadata: Any, files: dict[str, str] | None) -> None:
    bad = f"its {METADATA} is malformed"
    if type(metadata) is not Metadata or not isinstance(metadata.state_dict_metadata, dict):
        raise DamagedCheckpoint(f"{bad}: not a DCP Metadata")
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or type(meta) is not TensorStorageMetadata:
            raise DamagedCheckpoint(f"{bad}: {key!r} is not a tensor; refusing to load it")
        props = meta.properties
        if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype):
            raise DamagedCheckpoint(f"{bad}: {key} has no dtype")
        if type(meta.size) is not torch.Size or not all(
            type(c) is ChunkStorageMetadata for c in meta.chunks
        ):
            raise DamagedCheckpoint(f"{bad}: {key} has no size")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise DamagedCheckpoint(f"{bad}: no storage table")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not DcpStorageInfo:
            raise DamagedCheckpoint(f"{bad}: a storage entry of the wrong kind")
        name = info.relative_path
        if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name.startswith("."):
            raise DamagedCheckpoint(f"{bad}: storage file {name!r} is not a file of the folder")
        if files is not None and name not in files:
            raise DamagedCheckpoint(f"{bad}: storage file {name} is not in the manifest")
        if not (isinstance(info.offset, int) and isinstance(info.length, int)):
            raise DamagedCheckpoint(f"{bad}: storage of {index.fqn} has no offset")
        if info.offset < 0 or info.length < 0 or info.transform_descriptors:
            raise DamagedCheckpoint(f"{bad}: storage of {index.fqn} is not plain bytes")


def tensor_entries(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """The tensors of checked metadata by DCP key (`read_metadata` admits nothing else)."""
    entries = metadata.state_dict_metadata.items()
    return {k: m for k, m in entries if isinstance(m, TensorStorageMetadata)}


class SafeReader(FileSystemReader):
    """A `FileSystemReader` that reads its metadata with `read_metadata`, never a plain unpickle;
    tensor data itself DCP reads with `torch.load(weights_only=True)`."""

    def __init__(self, path: str | Path, files: dict[str, str] | None = None) -> None:
        super().__init__(path)
        self.files = files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked metadata, stamped with this read's `load_id` as `FileSystemReader` does
        (both public: `StorageReader.read_metadata` and `StorageMeta.load_id`)."""
        metadata = read_metadata(Path(self.path), self.files)
        assert metadata.storage_meta is not None  # `read_metadata` gives every metadata one
        metadata.storage_meta.load_id = self.load_id
        return metadata


def file_digest(path: Path, step: int | None) -> str:
    """The sha256 of a checkpoint file bound to its step and name: the same bytes under another
    step or another name have another digest (`step` None: the plain sha256 of the bytes, as
    manifests before `DIGEST_SCHEME` hold)."""
    header = "" if step is None else f"trainguard checkpoint step {step} file {path.name}\n"
    digest = hashlib.sha256(header.encode())
    with open_file(path) as f:  # a planted FIFO is refused, not read
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def passed_over(path: Path, exc: DamagedCheckpoint) -> str:
    """The warning for a damaged checkpoint that resume passes over."""
    return f"{path.name} is unusable: {exc}; using the one before it"


def read_json(path: Path, what: str) -> Any:
    """A JSON file of a checkpoint, or `DamagedCheckpoint` naming the file and the fault."""
    try:
        return json.loads(read_bytes(path).decode("utf-8"))
    except FileNotFoundError:
        raise DamagedCheckpoint(f"its {path.name} is missing") from None
    except OSError as exc:
        raise DamagedCheckpoint(f"its {path.name} cannot be read ({reason(exc)})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DamagedCheckpoint(f"its {path.name} is not {what} ({type(exc).__name__})") from None


def verify_manifest(path: Path, step: int) -> dict[str, Any]:
    """The manifest of the checkpoint `path` of `step`, once its step, its file list and every
    file's digest check out; `DamagedCheckpoint` saying which does not."""
    manifest = read_json(path / MANIFEST, "a JSON manifest")
    if not isinstance(manifest, dict):
        raise DamagedCheckpoint(f"its {MANIFEST} is not a JSON object")
    if manifest.get("step") != step or type(manifest.get("step")) is not int:
        raise DamagedCheckpoint(
            f"its {MANIFEST} is of step {manifest.get('step')!r}, not {step} (moved or copied)"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _HEX64.fullmatch(v) for k, v in files.items()
    ):
        raise DamagedCheckpoint(f"its {MANIFEST} has no valid list of files and digests")
    storage = manifest.get("storage")
    if storage not in (None, BLOB_STORAGE):
        raise DamagedCheckpoint(
            f"its tensors are stored as {storage!r}, which this trainguard cannot read: "
            "upgrade trainguard to resume from it"
        )
    plain = [n for n in files if n == PLAIN_STATE or n.startswith("trainguard-rank")]
    if not plain or (TENSOR_TABLE if storage == BLOB_STORAGE else METADATA) not in files:
        raise DamagedCheckpoint(f"its {MANIFEST} does not list the checkpoint's files")
    bound = manifest.get("checksums") == DIGEST_SCHEME
    for name, digest in files.items():
        file = path / name
        if not _FILE_NAME.fullmatch(name) or not file.is_file():
            raise DamagedCheckpoint(f"its {name} is missing")
        try:
            actual = file_digest(file, step if bound else None)
        except OSError as exc:
            raise DamagedCheckpoint(f"its {name} cannot be read ({reason(exc)})") from None
        if actual != digest:
            raise DamagedCheckpoint(f"its {name} fails its checksum")
    return manifest


def check_plain_state(plain: Any, step: int, name: str = PLAIN_STATE) -> dict[str, Any]:
    """The plain state of a checkpoint, once it has every part in the right shape and names the
    checkpoint's own step."""
    if not isinstance(plain, dict) or not plain.keys() >= _PLAIN_KEYS:
        missing = sorted(_PLAIN_KEYS - plain.keys()) if isinstance(plain, dict) else "all"
        raise DamagedCheckpoint(f"its {name} lacks parts of the run's state ({missing})")
    optimizer = plain["optimizer"]
    if (
        not isinstance(optimizer, dict)
        or not isinstance(optimizer.get("param_groups"), list)
        or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list)
            for g in optimizer["param_groups"]
        )
        or not isinstance(optimizer.get("state"), dict)
    ):
        raise DamagedCheckpoint(f"its {name} has no optimizer state")
    for part in ("scheduler", "scaler", "data"):
        if plain[part] is not None and not isinstance(plain[part], dict):
            raise DamagedCheckpoint(f"its {name} has a malformed {part} state")
    guard = plain["guard"]
    if not isinstance(guard, dict) or guard.get("global_step") != step:
        found = guard.get("global_step") if isinstance(guard, dict) else None
        raise DamagedCheckpoint(f"its {name} is of step {found!r}, not {step} (moved or copied)")
    if not all(isinstance(guard.get(part), dict) for part in ("detectors", "policy")):
        raise DamagedCheckpoint(f"its {name} has a malformed guard state")
    if not isinstance(plain["rng"], dict):
        raise DamagedCheckpoint(f"its {name} has no random state")
    protected = plain.get("protected", [])
    if not isinstance(protected, list) or not all(type(s) is int for s in protected):
        raise DamagedCheckpoint(f"its {name} has a malformed list of protected checkpoints")
    last_good = plain.get("last_good_checkpoint")
    if last_good is not None and type(last_good) is not int:
        raise DamagedCheckpoint(f"its {name} has a malformed last good checkpoint")
    return plain
