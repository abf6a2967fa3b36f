"""Faults from outside the model: SIGKILL at random moments (some inside a checkpoint write),
damaged and mismatched checkpoints, pickle payloads in DCP's metadata, a full disk under the
whole run folder, and links planted in a run folder; trials and failures of each, written into
RESULTS.md.

python benchmarks/faults.py [--kills 24] [--seed 0] [--disk-mib 8]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

import trainguard as tg  # noqa: E402
from _common import write_section  # noqa: E402
from checkpoint_damage import (  # noqa: E402
    BAD,
    DAMAGES,
    GOOD,
    folder,
    make_run,
    payloads,
    rehash,
    tiny_config,
    tiny_setup,
)
from trainguard.actions.checkpoint_files import METADATA  # noqa: E402
from trainguard.actions.checkpoints import CheckpointMismatch, CheckpointStore  # noqa: E402

from helpers import TmpfsDisk, worker_losses  # noqa: E402

WORKER = TESTS / "resume_worker.py"
STEPS = 120  # the worker checkpoints every 40 steps


def _worker(run_dir: Path, *args: str) -> subprocess.Popen[bytes]:
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(run_dir), str(STEPS), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_for_training(proc: subprocess.Popen[bytes], run_dir: Path) -> float:
    """The time (`time.time`, as file times are) the worker logged its first step; it imports
    torch for a few seconds first."""
    log = run_dir / "losses.txt"
    while proc.poll() is None and not (log.exists() and log.stat().st_size):
        time.sleep(0.01)
    return time.time()


def _events(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kill_trials(n: int, rng: random.Random, work: Path) -> tuple[str, dict[str, int]]:
    """SIGKILL `n` runs, at random wall-clock moments and inside checkpoint writes, resume each."""
    reference = work / "reference"
    proc = _worker(reference)
    first = _wait_for_training(proc, reference)
    _, err = proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]
    training = (reference / "losses.txt").stat().st_mtime - first  # the first step to the last
    expected = worker_losses(reference)
    counts = {"trials": 0, "during a write": 0, "corrupt loads": 0, "bit-equal": 0, "failed": 0}
    rows = []
    for i in range(n):
        run_dir = work / f"kill-{i}"
        if i % 3 == 2:  # inside DCP's writer, the files half written
            how = f"inside the write of step {40 * (1 + i % 2)}"
            proc = _worker(run_dir, "--kill-writing", str(40 * (1 + i % 2)))
            proc.wait()
        else:
            share = rng.uniform(0.0, 0.98)
            how = f"{100 * share:.0f}% into training"
            proc = _worker(run_dir)
            started = _wait_for_training(proc, run_dir)
            time.sleep(max(0.0, started + share * training - time.time()))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if proc.returncode != -signal.SIGKILL:
            rows.append(f"| {i} | {how} | finished before the kill | - | - |")
            continue
        counts["trials"] += 1
        checkpoints = run_dir / "checkpoints"
        writing = checkpoints.is_dir() and any(".tmp-" in p.name for p in checkpoints.iterdir())
        counts["during a write"] += writing
        done = subprocess.run(
            [sys.executable, str(WORKER), str(run_dir), str(STEPS), "--resume"],
            capture_output=True,
            check=False,
        )
        events = _events(run_dir)
        unusable = [e for e in events if "unusable" in str(e.get("message", ""))]
        resumed = [e["metrics"] for e in events if e["kind"] == "resume"]
        same = done.returncode == 0 and worker_losses(run_dir) == expected
        counts["corrupt loads"] += bool(unusable)
        counts["bit-equal"] += same
        counts["failed"] += not same
        step = resumed[0]["step"] if resumed else 0  # type: ignore[index]
        rows.append(
            f"| {i} | {how} | {'yes' if writing else 'no'} | {step} | {'yes' if same else 'NO'} |"
        )
    table = "\n".join(
        [
            "| trial | killed | a checkpoint half written | resumed from step | "
            "trajectory bit-equal |",
            "|---:|---|---|---:|---|",
            *rows,
        ]
    )
    return table, counts


def damage_trials(work: Path) -> tuple[str, dict[str, int]]:
    """Each damage of the catalogue on the newest checkpoint; resume must fall back to the
    one before it, with its weights, and one warning naming the fault."""
    pristine = work / "pristine"
    weights = make_run(pristine)
    counts = {"cases": 0, "passed over": 0, "failed": 0}
    failures = []
    for name, (damage, word) in DAMAGES.items():
        run_dir = work / "damage"
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.copytree(pristine, run_dir)
        damage(folder(run_dir, BAD))
        counts["cases"] += 1
        try:
            model, opt = tiny_setup()
            guard = tg.Guard.resume(run_dir, model, opt, config=tiny_config())
            guard.close()
            warned = [
                str(e["message"])
                for e in _events(run_dir)
                if e["kind"] == "checkpoint" and f"step-{BAD}" in str(e["message"])
            ]
            fits = all(torch.equal(v, weights[GOOD][k]) for k, v in model.state_dict().items())
            ok = guard.global_step == GOOD and fits and len(warned) == 1 and word in warned[0]
        except Exception as exc:
            ok, warned = False, [f"{type(exc).__name__}: {exc}"]
        counts["passed over" if ok else "failed"] += 1
        if not ok:
            failures.append(f"- {name}: {warned}")
    for optimizer, expect in (("sgd", "its optimizer is AdamW"),):
        counts["cases"] += 1
        try:
            model, opt = tiny_setup(optimizer)
            tg.Guard.resume(pristine, model, opt, config=tiny_config()).close()
            failures.append(f"- {optimizer}: resumed without an error")
            counts["failed"] += 1
        except CheckpointMismatch as exc:
            ok = expect in str(exc)
            counts["passed over" if ok else "failed"] += 1
    return "\n".join(failures) or "none", counts


def payload_trials(work: Path) -> dict[str, int]:
    """Every payload as `.metadata`, its digest updated: nothing may run, each is passed over."""
    pristine = work / "pristine"
    marker = work / "pwned"
    real = (folder(pristine, BAD) / METADATA).read_bytes()
    counts = {"payloads": 0, "ran code": 0, "passed over": 0}
    for data in payloads(marker, real).values():
        run_dir = work / "payload"
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.copytree(pristine, run_dir)
        (folder(run_dir, BAD) / METADATA).write_bytes(data)
        rehash(folder(run_dir, BAD))
        model, opt = tiny_setup()
        guard = tg.Guard.resume(run_dir, model, opt, config=tiny_config())
        guard.close()
        counts["payloads"] += 1
        counts["ran code"] += marker.exists()
        counts["passed over"] += guard.global_step == GOOD
        marker.unlink(missing_ok=True)
    return counts


def disk_full_trial(work: Path, mib: int) -> dict[str, object]:
    """Train through a full disk with the whole run folder on a small tmpfs (root), then resume
    on the still-full disk."""
    run_dir = work / "tmpfs"
    disk = TmpfsDisk.mount(run_dir, f"{mib}m")
    if disk is None:
        return {"run": "not run: mounting a tmpfs needs root"}
    try:
        from trainguard.demo import TinyGPT

        torch.manual_seed(0)
        model = TinyGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = tg.GuardConfig(
            console=False,
            log_every=1,
            recovery={"checkpoint_every": 10, "keep_checkpoints": 3},
        )
        guard = tg.Guard(model, opt, config=config, run_dir=run_dir)
        x = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(0))
        steps, error = 300, None
        try:
            while guard.global_step < steps:
                if guard.global_step == steps // 3:  # something else fills the disk
                    disk.fill()
                loss = model.loss(model(x[:, :32]), x[:, 1:])
                loss.backward()
                guard.step(loss)
                opt.zero_grad(set_to_none=True)
            guard.close()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            try:
                guard.close()
            except Exception as again:
                error += f"; then close: {type(again).__name__}: {again}"
        lines = (run_dir / "metrics.jsonl").read_bytes().split(b"\n")
        partial = sum(1 for line in lines[:-1] if not _is_json(line)) + (lines[-1] != b"")
        logged = sum(
            1 for e in _events(run_dir) if "could not be written" in str(e.get("message", ""))
        )
        checkpoints = run_dir / "checkpoints"
        left = [p.name for p in checkpoints.glob(".step-*.tmp-*")]
        complete = [p.name for p in CheckpointStore(checkpoints).complete()]
        resumed_at: object = None
        try:
            model2 = TinyGPT()
            opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
            again = tg.Guard.resume(run_dir, model2, opt2, config=config)
            resumed_at = again.global_step
            again.close()
        except Exception as exc:
            resumed_at = f"{type(exc).__name__}: {exc}"
        return {
            "run": f"{steps} steps of TinyGPT, the run folder on a {mib} MiB tmpfs, "
            f"filled at step {steps // 3}",
            "steps trained": guard.global_step,
            "error": error,
            "checkpoint failures warned about": guard.event_counts.get("checkpoint", 0),
            "of them in events.jsonl (the disk drops the rest)": logged,
            "temporary folders left": len(left),
            "complete checkpoints kept": complete,
            "partial lines in metrics.jsonl": partial,
            "resume on the full disk": resumed_at,
        }
    finally:
        disk.unmount()


def blob_repair_trial(work: Path) -> dict[str, object]:
    """A frozen weight's blob damaged on disk (one byte flipped) after the step-10 save of a
    dedup run; training goes on to step 25 (a checkpoint every 5), then `Guard.resume`."""
    run_dir = work / "blob-repair"
    model, opt = tiny_setup()
    model[0].weight.requires_grad_(False)  # type: ignore[index]
    config = tiny_config(dedup=True)
    config.recovery.checkpoint_every = 5
    guard = tg.Guard(model, opt, config=config, run_dir=run_dir)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    while guard.global_step < 25:
        loss = model(x).pow(2).mean()
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
        if guard.global_step == 10:
            table = json.loads((run_dir / "checkpoints/step-10/tensors.json").read_text())
            blob = table["tensors"]["model.0.weight"]["chunks"][0]["blob"]
            path = run_dir / "checkpoints/blobs" / blob
            data = bytearray(path.read_bytes())
            data[5] ^= 0x10
            path.write_bytes(bytes(data))
    guard.close()
    live = {k: v.clone() for k, v in model.state_dict().items()}
    warned = [
        str(e["message"]).splitlines()[0]
        for e in _events(run_dir)
        if e["kind"] == "checkpoint" and "damaged" in str(e.get("message", ""))
    ]
    model2, opt2 = tiny_setup()
    again = tg.Guard.resume(run_dir, model2, opt2, config=config)
    again.close()
    same = all(torch.equal(v, live[k]) for k, v in model2.state_dict().items())
    return {
        "warned during training": len(warned),
        "first warning": warned[0] if warned else "none",
        "resumed from step": again.global_step,
        "weights bit-equal to the live run": same,
    }


LINKED = (  # the names a guard writes in its run folder, each planted as a link to elsewhere
    ".lock",
    "config.json",
    "metrics.jsonl",
    "events.jsonl",
    "evals.jsonl",
    "checkpoints",
    "checkpoints/blobs",
    "checkpoints/step-5",
)


def link_trials(work: Path) -> tuple[str, dict[str, int]]:
    """Each name the guard writes, planted in a new run folder as a symlink to a file or folder
    outside it with known bytes (a torn last line, to tempt the log repair); a short dedup run
    with a lost resume, then `Guard.resume`. Nothing outside may change."""
    counts = {"links": 0, "outside changed": 0, "told": 0}
    rows = []
    for name in LINKED:
        run_dir = work / "links" / name.replace("/", "_")
        outside = work / "outside" / name.replace("/", "_")
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(outside, ignore_errors=True)
        outside.mkdir(parents=True)
        target = outside / "target"
        if name in ("checkpoints", "checkpoints/blobs", "checkpoints/step-5"):
            target.mkdir()
            for i in range(3):  # another run's files, which nothing here may delete
                (target / f"{i:064x}").write_bytes(bytes([i]) * 4000)
        else:
            target.write_bytes(b'{"step": 1}\n' * 300 + b'{"torn')
        before = _tree(outside)
        link = run_dir / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target, target_is_directory=target.is_dir())
        told: list[str] = []
        for resume in (False, True):
            stderr = io.StringIO()
            try:
                model, opt = tiny_setup()
                config = tiny_config(dedup=True)
                config.recovery.checkpoint_every = 5
                with contextlib.redirect_stderr(stderr):
                    if resume:
                        guard = tg.Guard.resume(run_dir, model, opt, config=config)
                    else:
                        guard = tg.Guard(model, opt, config=config, run_dir=run_dir)
                    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
                    for _ in range(12):
                        loss = model(x).pow(2).mean()
                        loss.backward()
                        guard.step(loss)
                        opt.zero_grad()
                        if guard.global_step % 5 == 0:
                            guard.evaluate(guard.global_step, {"eval_loss": float(loss)})
                    guard.close()
                lines = [str(e.get("message", "")) for e in _events(run_dir)]
                lines += stderr.getvalue().splitlines()
                told += [line.splitlines()[0] for line in lines if "link" in line][:1]
            except tg.TrainguardError as exc:
                told.append(str(exc).splitlines()[0])
            except Exception as exc:
                told.append(f"TRACEBACK {type(exc).__name__}: {exc}")
        changed = _tree(outside) != before
        counts["links"] += 1
        counts["outside changed"] += changed
        counts["told"] += bool(told) and not any(t.startswith("TRACEBACK") for t in told)
        said = told[0] if told else "nothing"
        rows.append(
            f"| `{name}` | {'**CHANGED**' if changed else 'unchanged'} | {said.replace('|', '/')} |"
        )
    table = "\n".join(
        ["| planted link | files outside | what the user was told |", "|---|---|---|", *rows]
    )
    return table, counts


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (not following links) and its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kills", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disk-mib", type=int, default=8)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        damage_failures, damage = damage_trials(work)
        print("damage", damage, file=sys.stderr)
        payload = payload_trials(work)
        print("payloads", payload, file=sys.stderr)
        disk = disk_full_trial(work, args.disk_mib)
        print("disk", disk, file=sys.stderr)
        repair = blob_repair_trial(work)
        print("blob repair", repair, file=sys.stderr)
        link_table, links = link_trials(work)
        print("links", links, file=sys.stderr)
        kill_table, kills = kill_trials(args.kills, rng, work)
        print("kills", kills, file=sys.stderr)
    body = "\n".join(
        [
            f"**SIGKILL** ({args.kills} runs of the resume worker, 120 TinyGPT steps, a "
            "checkpoint every 40, asynchronous; killed at a random moment of its training "
            "(uniform from the first step to the last), or inside DCP's "
            f"writer, then resumed): {kills['trials']} killed, {kills['during a write']} "
            f"of them with a checkpoint half written, {kills['corrupt loads']} corrupt loads, "
            f"{kills['bit-equal']} resumed onto the uninterrupted trajectory bit for bit, "
            f"{kills['failed']} failed.",
            "",
            kill_table,
            "",
            f"**Damaged checkpoints** ({damage['cases']} cases: the catalogue of "
            "`tests/checkpoint_damage.py` on the newest checkpoint, most with their digests "
            "updated, plus a checkpoint of AdamW resumed into SGD): "
            f"{damage['passed over']} handled as they must be (passed over for the one before "
            "it with its weights and one warning naming the fault; the mismatch a clear "
            f"error), {damage['failed']} failed. Failures: {damage_failures}",
            "",
            f"**Pickle payloads** ({payload['payloads']} `.metadata` payloads, digests "
            f"updated): {payload['ran code']} ran code, {payload['passed over']} passed over.",
            "",
            "**Full disk**: " + "; ".join(f"{k}: {v}" for k, v in disk.items()) + ".",
            "",
            "**A damaged blob** (one byte flipped in a frozen weight's blob after the step-10 "
            "save of a dedup run, training on to step 25, a checkpoint every 5, then resume): "
            + "; ".join(f"{k}: {v}" for k, v in repair.items())
            + ".",
            "",
            f"**Links planted in a run folder** ({links['links']} names the guard writes, each "
            "a symlink to a file or folder outside the run folder with known bytes; a new "
            "dedup run of 12 steps, a checkpoint every 5, then `Guard.resume`): "
            f"{links['outside changed']} changed anything outside, {links['told']} told the "
            "user in one line.",
            "",
            link_table,
        ]
    )
    write_section(
        "faults",
        "Faults from outside: kills, damaged checkpoints, payloads, a full disk",
        body,
        f"python benchmarks/faults.py --kills {args.kills} --seed {args.seed}",
    )


if __name__ == "__main__":
    main()
