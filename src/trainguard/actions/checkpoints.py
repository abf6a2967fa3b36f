"""`CheckpointStore`: durable checkpoints through `torch.distributed.checkpoint`, written in the
background, complete or absent, verified before they are loaded."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import pickle
import shutil
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from trainguard.actions.snapshots import rng_from_plain, rng_state, rng_to_plain, set_rng_state
from trainguard.distributed.context import RankContext
from trainguard.events import TrainguardError, _utc_now

MANIFEST = "manifest.json"
PLAIN_STATE = "trainguard.json"
PREFIX = "step-"


class _SafeUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata only: checkpoint metadata classes, torch sizes and dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint."):
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        if (module, name) in {
            ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PurePosixPath"),
            ("collections", "OrderedDict"),
        }:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata names {module}.{name}, which is not allowed"
        )


class SafeReader(FileSystemReader):
    """A `FileSystemReader` whose metadata is read with an allow-list, never a plain unpickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = Path(self.path) / ".metadata"
        with path.open("rb") as f:
            metadata = _SafeUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _no_dist() -> bool:
    """One process: no process group to coordinate the checkpoint with."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


warnings.filterwarnings(  # also in DCP's writer thread, where a catch_warnings does not reach
    "ignore", message="torch.distributed is disabled", module="torch.distributed.checkpoint"
)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that one process is assumed when no process group exists: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


class BufferStager(AsyncStager):
    """Stages a checkpoint into CPU buffers kept from one checkpoint to the next (pinned for GPU
    tensors), with one fused copy: no allocation and no page faults after the first time."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        sources: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        staged = self._walk(state_dict, "", sources, targets)
        if sources:
            torch._foreach_copy_(targets, sources, non_blocking=True)
            if any(t.is_cuda for t in sources):
                torch.cuda.synchronize()
        return staged  # type: ignore[no-any-return]

    def _walk(
        self, value: Any, key: str, sources: list[torch.Tensor], targets: list[torch.Tensor]
    ) -> Any:
        if isinstance(value, dict):
            return {k: self._walk(v, f"{key}.{k}", sources, targets) for k, v in value.items()}
        if not isinstance(value, torch.Tensor):
            return value
        if isinstance(value, DTensor):  # stage this rank's shard, keep its place in the whole
            local = self._walk(value.to_local(), key, sources, targets)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        src = value.detach()
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != src.shape or buffer.dtype != src.dtype:
            buffer = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            self.buffers[key] = buffer
        sources.append(src)
        targets.append(buffer)
        return buffer

    def synchronize_staging(self) -> None:
        """Staging is complete when `stage` returns."""

    def close(self) -> None:
        self.buffers.clear()


class CheckpointStore:
    """`directory/step-N/`: DCP tensor files, `trainguard.json` (plain state) and `manifest.json`
    (step, time, sha256 of each file, version, incident state), renamed in place when complete."""

    def __init__(
        self,
        directory: str | Path,
        keep: int = 3,
        asynchronous: bool = True,
        ranks: RankContext | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.ranks = ranks
        # DCP's collectives get a group of their own: an asynchronous save runs them in a
        # background thread, which must not interleave with the guard's per-step all-gather
        self.group = dist.new_group(backend="gloo") if ranks is not None else None
        self.keep = keep
        self.asynchronous = asynchronous
        self._pending: threading.Event | None = None  # set once the write is finished
        self._lock = threading.Lock()
        self.errors: list[str] = []
        self._stager = BufferStager()
        self.protected: set[int] = set()  # steps kept as the last known-good before an incident

    # -- writing ----------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        tensors: dict[str, Any],
        plain: dict[str, Any],
        manifest: dict[str, Any],
    ) -> None:
        """Stage the tensors (the only part that blocks training) and write in the background."""
        self.wait()
        self.directory.mkdir(parents=True, exist_ok=True)
        ranks = self.ranks
        token = ranks.token if ranks is not None else uuid.uuid4().hex[:8]
        tmp = self.directory / f".{PREFIX}{step}.tmp-{token}"
        plain_text = json.dumps(plain)
        leader = ranks is None or ranks.is_leader
        if ranks is not None:  # each rank's own plain state, on disk before DCP's last barrier
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / plain_name(ranks.rank)).write_text(plain_text)
        no_dist = ranks is None and _no_dist()
        with _quiet_single_process():
            if self.asynchronous:
                future: Any = dcp_async_save(
                    tensors,
                    checkpoint_id=tmp,
                    no_dist=no_dist,
                    async_stager=self._stager,
                    process_group=self.group,
                )
            else:
                dcp_save(tensors, checkpoint_id=tmp, no_dist=no_dist, process_group=self.group)
                future = concurrent.futures.Future()
                future.set_result(None)

        finished = threading.Event()

        def finish(done: concurrent.futures.Future[Any]) -> None:
            try:
                done.result()
                if leader:  # DCP completes on rank 0 once every rank's files are written
                    self._finish(step, tmp, None if ranks else plain_text, manifest)
            except Exception as exc:  # reported, never raised into training
                with self._lock:
                    self.errors.append(f"checkpoint at step {step} failed: {exc}")
            finally:
                finished.set()

        self._pending = finished
        future.add_done_callback(finish)
        if not self.asynchronous:
            self.wait()

    def _finish(
        self, step: int, tmp: Path, plain_text: str | None, manifest: dict[str, Any]
    ) -> None:
        if plain_text is not None:
            (tmp / PLAIN_STATE).write_text(plain_text)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        record = {"step": step, "time": _utc_now(), "files": files, **manifest}
        with (tmp / MANIFEST).open("w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        final = self.directory / f"{PREFIX}{step}"
        if final.exists():  # a replayed step after a rollback: the newer trajectory wins
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest `keep` complete checkpoints and the protected ones; never the rest."""
        complete = self.complete()
        keep = {step_of(p) for p in complete[: self.keep]} | self.protected
        for path in complete[self.keep :]:
            if step_of(path) not in keep:
                shutil.rmtree(path, ignore_errors=True)

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
    def complete(self) -> list[Path]:
        """Directories of checkpoints with a manifest, newest first (not yet verified)."""
        if not self.directory.is_dir():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()
        ]
        return sorted((p for p in found if (p / MANIFEST).is_file()), key=step_of, reverse=True)

    def verify(self, path: Path) -> dict[str, Any]:
        """The manifest of a checkpoint whose files are all present with their recorded sha256."""
        try:
            manifest: dict[str, Any] = json.loads((path / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TrainguardError(f"{path}: unreadable manifest ({exc})") from None
        for name, digest in manifest.get("files", {}).items():
            file = path / name
            if not file.is_file():
                raise TrainguardError(f"{path}: {name} is missing")
            if _sha256(file) != digest:
                raise TrainguardError(f"{path}: {name} fails its checksum")
        files = manifest.get("files", {})
        plain = [n for n in files if n == PLAIN_STATE or n.startswith("trainguard-rank")]
        if not plain or ".metadata" not in files:
            raise TrainguardError(f"{path}: the manifest does not list the checkpoint's files")
        return manifest

    def load(self, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The flat tensors (by DCP key) and the plain state of a verified checkpoint."""
        reader = SafeReader(path)
        metadata = reader.read_metadata()
        template: dict[str, torch.Tensor] = {}
        for key, meta in metadata.state_dict_metadata.items():
            if not hasattr(meta, "size"):
                raise TrainguardError(f"{path}: {key} is not a tensor; refusing to unpickle it")
            template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        with _quiet_single_process():
            dcp_load(template, storage_reader=SafeReader(path), no_dist=_no_dist())
        plain = json.loads((path / PLAIN_STATE).read_text())
        return template, plain

    def load_newest(
        self, warn: Callable[[str], None]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]] | None:
        """Manifest, tensors and plain state of the newest checkpoint that verifies and loads,
        warning about each one passed over; None when there is none."""
        if self.directory.is_dir():
            for p in sorted(self.directory.iterdir()):
                if p.name.startswith(f".{PREFIX}") and ".tmp-" in p.name:
                    warn(f"{p.name}: an incomplete checkpoint (the run stopped while writing it)")
        for path in self.complete():
            try:
                manifest = self.verify(path)
                tensors, plain = self.load(path)
            except (TrainguardError, pickle.UnpicklingError, OSError, ValueError) as exc:
                warn(f"{path.name} is unusable ({exc}); using the one before it")
                continue
            manifest["path"] = str(path)
            return manifest, tensors, plain
        return None


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
        "optimizer": {"param_groups": optim_sd["param_groups"], "state": opt_plain},
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": rng_to_plain({k: v for k, v in rng.items() if k != "cuda"}),
    }
    return tensors, plain


def load_sharded(
    store: CheckpointStore,
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    rank: int,
) -> dict[str, Any]:
    """Load this rank's part of a distributed checkpoint into the live objects; its plain state."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    plain_file = path / plain_name(rank)
    if not plain_file.is_file():
        raise TrainguardError(
            f"{path} has no state for rank {rank}: resume with the world size it was written with"
        )
    plain = json.loads(plain_file.read_text())
    tensors, _ = sharded_training_state(model, optimizer, None, None, rank)
    dcp_load(tensors, storage_reader=SafeReader(path), process_group=store.group)
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
    if scheduler is not None and plain["scheduler"] is not None:
        scheduler.load_state_dict(plain["scheduler"])
    if scaler is not None and plain["scaler"] is not None:
        scaler.load_state_dict(plain["scaler"])
    own = tensors["rng"][f"rank{rank}"]
    rng = rng_from_plain({**plain["rng"], "torch": []})
    rng["torch"] = own["torch"]
    if "cuda" in own:
        rng["cuda"] = [own["cuda"][k] for k in sorted(own["cuda"], key=int)]
    set_rng_state(rng)
    loaded: dict[str, Any] = plain
    return loaded


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
        "optimizer": {"param_groups": opt["param_groups"], "state": opt_plain},
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": plain_rng,
    }
    return tensors, plain


def restore_training_state(
    tensors: dict[str, torch.Tensor],
    plain: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
) -> None:
    """Put back what `training_state` captured, from a loaded checkpoint's flat tensors."""
    model.load_state_dict(
        {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    )
    opt_state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer.state."):
            pid, name = key[len("optimizer.state.") :].split(".", 1)
            opt_state.setdefault(int(pid), {})[name] = value
    for pid, values in plain["optimizer"]["state"].items():
        opt_state.setdefault(int(pid), {}).update(values)
    optimizer.load_state_dict(
        {"state": opt_state, "param_groups": plain["optimizer"]["param_groups"]}
    )
    if scheduler is not None and plain["scheduler"] is not None:
        scheduler.load_state_dict(plain["scheduler"])
    if scaler is not None and plain["scaler"] is not None:
        scaler.load_state_dict(plain["scaler"])
    rng = rng_from_plain({**plain["rng"], "torch": []})
    rng["torch"] = tensors["rng.torch"]
    cuda = sorted(k for k in tensors if k.startswith("rng.cuda."))
    if cuda:
        rng["cuda"] = [tensors[k] for k in cuda]
    set_rng_state(rng)
