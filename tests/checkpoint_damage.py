"""A catalogue of damaged checkpoints and of pickle payloads, shared by the tests and
benchmarks/faults.py: each damage turns a good `step-20` into a bad one, most with their digests
updated (as a bug or a bad copy would leave them) so that the deeper checks are reached."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import trainguard as tg
from trainguard.actions.checkpoint_files import MANIFEST, METADATA, PLAIN_STATE, file_digest

TENSORS = "__0_0.distcp"
GOOD, BAD = 10, 20  # the checkpoints a run leaves: resume must fall back from BAD to GOOD
MARKER = "pwned"  # the file every payload tries to create


def tiny_setup(optimizer: str = "adamw") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if optimizer == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def tiny_config(dedup: bool = False) -> tg.GuardConfig:
    """DCP's own files by default: the damages below are to them (blobs: `dedup`)."""
    return tg.GuardConfig(
        console=False,
        diagnosis={"lint": False},
        recovery={
            "checkpoint_every": GOOD,
            "keep_checkpoints": 5,
            "async_checkpoints": False,
            "dedup_checkpoints": dedup,
        },
    )


def train(guard: tg.Guard, model: torch.nn.Module, until: int) -> dict[int, dict[str, Any]]:
    """Train to `until` steps; the weights after each checkpointed step."""
    weights: dict[int, dict[str, Any]] = {}
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    while guard.global_step < until:
        loss = model(x).pow(2).mean()
        loss.backward()
        guard.step(loss)
        assert guard.optimizer is not None
        guard.optimizer.zero_grad()
        if guard.global_step % GOOD == 0:
            weights[guard.global_step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def make_run(run_dir: Path) -> dict[int, dict[str, Any]]:
    """A run folder with good checkpoints at steps 10 and 20; the weights of each."""
    model, opt = tiny_setup()
    guard = tg.Guard(model, opt, config=tiny_config(), run_dir=run_dir)
    weights = train(guard, model, BAD)
    guard.close()
    return weights


def folder(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step}"


def rehash(path: Path, step: int = BAD) -> None:
    """Update the manifest's digests to the files as they now are."""
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"] = {
        n: file_digest(path / n, step) for n in manifest["files"] if (path / n).is_file()
    }
    (path / MANIFEST).write_text(json.dumps(manifest))


def _write(name: str, data: bytes, update: bool = True) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        (path / name).write_bytes(data)
        if update and name != MANIFEST:
            rehash(path)

    return damage


def _edit_json(name: str, edit: Callable[[Any], Any]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        value = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps(edit(value)))
        if name != MANIFEST:
            rehash(path)

    return damage


def _set(keys: tuple[str, ...], value: Any) -> Callable[[Any], Any]:
    def edit(d: Any) -> Any:
        target = d
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value
        return d

    return edit


def _truncate(name: str, update: bool = True) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: len(data) // 2])
        if update:
            rehash(path)

    return damage


def _flip_byte(path: Path) -> None:
    data = bytearray((path / TENSORS).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / TENSORS).write_bytes(bytes(data))


def _copy_from_good(*names: str, update: bool = True) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        good = path.parent / f"step-{GOOD}"
        for name in names:
            shutil.copyfile(good / name, path / name)
        if update:
            rehash(path)
        else:  # the digests copied along with the files
            manifest = json.loads((path / MANIFEST).read_text())
            source = json.loads((good / MANIFEST).read_text())
            for name in names:
                manifest["files"][name] = source["files"][name]
            (path / MANIFEST).write_text(json.dumps(manifest))

    return damage


def _whole_folder_from_good(path: Path) -> None:
    good = path.parent / f"step-{GOOD}"
    shutil.rmtree(path)
    shutil.copytree(good, path)


def _delete(name: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        (path / name).unlink()

    return damage


def _list_extra(name: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        manifest = json.loads((path / MANIFEST).read_text())
        manifest["files"][name] = "0" * 64
        (path / MANIFEST).write_text(json.dumps(manifest))

    return damage


def _deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# damage name -> (what it does to step-20, a word the warning must hold)
DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "manifest null": (_write(MANIFEST, b"null"), "not a JSON object"),
    "manifest a list": (_write(MANIFEST, b"[1, 2]"), "not a JSON object"),
    "manifest empty object": (_write(MANIFEST, b"{}"), "of step None"),
    "manifest empty file": (_write(MANIFEST, b""), "not a JSON manifest"),
    "manifest not UTF-8": (_write(MANIFEST, b"\xff\xfe\x00garbage"), "not a JSON manifest"),
    "manifest nested 100000 deep": (_write(MANIFEST, _deep_json(100_000)), "manifest"),
    "manifest of another step": (_edit_json(MANIFEST, _set(("step",), GOOD)), "not 20"),
    "manifest step as text": (_edit_json(MANIFEST, _set(("step",), "20")), "not 20"),
    "manifest files not a dict": (_edit_json(MANIFEST, _set(("files",), [1])), "digests"),
    "manifest digest not hex": (
        _edit_json(MANIFEST, _set(("files", TENSORS), "zz")),
        "digests",
    ),
    "manifest lists a missing file": (_list_extra("__9_9.distcp"), "missing"),
    "manifest lists a path outside": (_list_extra("../../etc/passwd"), "missing"),
    "manifest deleted": (_delete(MANIFEST), "has no manifest.json"),
    "metadata deleted": (_delete(METADATA), ".metadata is missing"),
    "metadata empty": (_write(METADATA, b""), "not DCP metadata"),
    "metadata truncated": (_truncate(METADATA), ".metadata"),
    "metadata random bytes": (_write(METADATA, bytes(range(256)) * 4), ".metadata"),
    "metadata a pickled dict": (_write(METADATA, pickle.dumps({"a": 1})), "not a DCP Metadata"),
    "plain state {}": (_write(PLAIN_STATE, b"{}"), "lacks parts"),
    "plain state null": (_write(PLAIN_STATE, b"null"), "lacks parts"),
    "plain state not JSON": (_write(PLAIN_STATE, b"\x00\x01not json"), "not JSON"),
    "plain state nested 100000 deep": (_write(PLAIN_STATE, _deep_json(100_000)), "not JSON"),
    "plain state of another step": (
        _edit_json(PLAIN_STATE, _set(("guard", "global_step"), GOOD)),
        "not 20",
    ),
    "plain state optimizer groups not a list": (
        _edit_json(PLAIN_STATE, _set(("optimizer", "param_groups"), "x")),
        "optimizer",
    ),
    "plain state random state garbage": (
        _edit_json(PLAIN_STATE, _set(("rng", "python"), [1, 2])),
        "random state",
    ),
    "plain state detectors garbage": (
        _edit_json(PLAIN_STATE, _set(("guard", "detectors"), "x")),
        "guard state",
    ),
    "plain state data position garbage": (
        _edit_json(PLAIN_STATE, _set(("data",), {"position": "x"})),
        "guard state",
    ),
    "plain state optimizer state keys garbage": (
        _edit_json(PLAIN_STATE, _set(("optimizer", "state"), {"x": {}})),
        "optimizer state",
    ),
    "tensors truncated": (_truncate(TENSORS), "tensor files"),
    "tensors one byte flipped, digest kept": (_flip_byte, "fails its checksum"),
    "tensors empty": (_write(TENSORS, b""), "tensor files"),
    "tensors deleted": (_delete(TENSORS), "is missing"),
    "tensors of step 10, digest updated": (_copy_from_good(TENSORS), "of step 10"),
    "tensors of step 10, digest copied": (
        _copy_from_good(TENSORS, update=False),
        "fails its checksum",
    ),
    "tensors and metadata of step 10": (_copy_from_good(TENSORS, METADATA), "of step 10"),
    "whole folder of step 10": (_whole_folder_from_good, "not 20"),
}


# -- pickle payloads -----------------------------------------------------------------------------
def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _text(s: str) -> bytes:
    data = s.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _call(module: str, name: str, *args: str) -> bytes:
    """Opcodes that call module.name(*args) (a dotted name resolved as pickle protocol 4 does)."""
    return _global(module, name) + b"(" + b"".join(_text(a) for a in args) + b"tR"


def payloads(marker: Path, real_metadata: bytes) -> dict[str, bytes]:
    """Name -> a .metadata that runs `touch marker` when unpickled (or tries to)."""
    shell = f"touch {marker}"
    allowed_modules = [
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.serialization",
        "torch",
        "pathlib",
        "collections",
    ]
    proto = b"\x80\x04"
    out: dict[str, bytes] = {}
    for module in allowed_modules:
        for dotted in ("os.system", "pickle.loads", "subprocess.getoutput", "builtins.exec"):
            if dotted == "pickle.loads":
                inner = pickle.dumps(_Touch(marker))
                out[f"{module} . {dotted}"] = (
                    proto + _global(module, dotted) + b"(C" + bytes([len(inner)]) + inner + b"tR."
                    if len(inner) < 256
                    else proto + b"N."
                )
                continue
            arg = f"__import__('os').system({shell!r})" if dotted == "builtins.exec" else shell
            out[f"{module} . {dotted}"] = proto + _call(module, dotted, arg) + b"."
    out["builtins.eval"] = proto + _call("builtins", "eval", f"__import__('os').system({shell!r})")
    out["builtins.exec"] = proto + _call("builtins", "exec", f"__import__('os').system({shell!r})")
    out["builtins.getattr chain"] = (
        proto
        + _global("builtins", "getattr")
        + b"("
        + _call("builtins", "__import__", "os")
        + _text("system")
        + b"tR("
        + _text(shell)
        + b"tR."
    )
    out["os.system"] = proto + _call("os", "system", shell) + b"."
    out["posix.system"] = proto + _call("posix", "system", shell) + b"."
    out["subprocess.Popen"] = proto + _call("subprocess", "getoutput", shell) + b"."
    out["pathlib.Path.touch (__reduce__)"] = pickle.dumps(_Touch(marker))
    out["nested __reduce__ in a real class"] = pickle.dumps({"meta": _Touch(marker)})
    # runs the payload, throws its result away, then returns the real metadata
    out["stealth: payload then the real metadata"] = (
        proto + _call("posix", "system", shell) + b"0" + real_metadata[2:]
    )
    out["stealth through an allowed module"] = (
        proto
        + _call("torch.distributed.checkpoint.filesystem", "os.system", shell)
        + b"0"
        + real_metadata[2:]
    )
    # no code runs, but fields of shared objects would change for the whole process
    attribute = (
        b"N}" + _text("__repr__") + _global("torch.serialization", "_get_layout") + b"s\x86b0"
    )
    out["BUILD on an allowed class, then the real metadata"] = (
        proto + _global("pathlib", "PosixPath") + attribute + real_metadata[2:]
    )
    out["BUILD on an allowed function"] = (
        proto + _global("torch.serialization", "_get_layout") + attribute + real_metadata[2:]
    )
    out["BUILD on a shared enum member"] = (
        proto
        + _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
        + b"(K\x01tR"  # the member of value 1
        + attribute
        + real_metadata[2:]
    )
    out["SETITEMS into a class's dict"] = (
        proto + _global("pathlib", "PosixPath") + b"(" + _text("x") + b"Nu0" + real_metadata[2:]
    )
    return out


class _Touch:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))
