"""`Quarantine`: batches and samples whose data toxicity was confirmed, kept out of training for
good; suspects held (skipped, not written) until their spike's follow-up; releases."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.events import _json_number, _utc_now
from trainguard.line_file import LineFile, Report, stderr_report
from trainguard.run_files import read_bytes

MAX_SUSPECTS = 256  # suspects held at once; a follow-up comes a few steps after its spike


def _key(ids: Sequence[Any]) -> str:
    return json.dumps([str(i) for i in ids])


class Quarantine:
    """`run_dir/quarantine.jsonl`, loaded at start so a restarted run honours it too. A record
    the disk refuses still holds in this run, is kept in memory, said once, and written with
    the next record or at `close`.

    The file is append-only: a record with `"action": "release"` (written when a spike's type is
    revised after its batch was quarantined) lets those ids back in; a record without `action`
    (every record of earlier releases) quarantines. Suspects, batches skipped for a spike whose
    follow-up is still to come, live in memory (and in the guard's state) only."""

    def __init__(self, path: str | Path | None, report: Report = stderr_report) -> None:
        self.path = Path(path) if path is not None else None
        self.file = (
            LineFile(
                self.path,
                report,
                keep=True,
                note="; this run still skips them, a restarted one would not",
            )
            if self.path is not None
            else None
        )
        self.batches: set[str] = set()
        self.samples: set[str] = set()
        self.records: list[dict[str, Any]] = []  # the quarantine records (releases not counted)
        self.releases: list[dict[str, Any]] = []
        self.suspects: dict[int, dict[str, Any]] = {}  # step -> ids, held until the follow-up
        if self.path is not None and os.path.lexists(self.path):  # a planted link: an error
            text = read_bytes(self.path).decode("utf-8", errors="replace")
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a killed run; the rest still holds
                if isinstance(record, dict):
                    self._remember(record)
                else:  # pragma: no cover - a hand-edited file
                    raise ValueError(f"{self.path}:{number}: not a JSON object")

    def _remember(self, record: dict[str, Any]) -> None:
        if record.get("action") == "release":
            self.releases.append(record)
            if record.get("batch_ids"):
                self.batches.discard(_key(record["batch_ids"]))
            for sample in record.get("sample_ids") or []:
                self.samples.discard(str(sample))
            return
        self.records.append(record)
        if record.get("batch_ids"):
            self.batches.add(_key(record["batch_ids"]))
        for sample in record.get("sample_ids") or []:
            self.samples.add(str(sample))

    def _write(self, record: dict[str, Any]) -> None:
        self._remember(record)
        if self.file is not None:
            self.file.write((json.dumps(record) + "\n").encode(), sync=True)
            self.file.release()  # records are rare: no file is held open between them

    # -- suspects: skipped, held until the spike's follow-up ------------------------------------
    def suspect(
        self,
        step: int,
        reason: str,
        loss: float,
        batch_ids: Sequence[Any] | None,
        sample_ids: Sequence[Any] | None = None,
    ) -> None:
        """Hold the batch of `step` as a suspect; nothing is written until it is confirmed."""
        if not batch_ids and not sample_ids:
            return
        self.suspects[step] = {
            "reason": reason,
            "loss": _json_number(float(loss)),
            "batch_ids": list(batch_ids) if batch_ids else None,
            "sample_ids": list(sample_ids) if sample_ids else None,
        }
        while len(self.suspects) > MAX_SUSPECTS:
            del self.suspects[next(iter(self.suspects))]

    def confirm(self, step: int, confirmed_at: int, why: str) -> dict[str, Any] | None:
        """Quarantine the suspect batch of `step` for good; None when none was held."""
        held = self.suspects.pop(step, None)
        if held is None:
            return None
        return self.add(
            step,
            f"{held['reason']}; {why}",
            float(held["loss"]) if isinstance(held["loss"], (int, float)) else math.nan,
            held["batch_ids"],
            held["sample_ids"],
            confirmed_at=confirmed_at,
        )

    def release(self, step: int, released_at: int, why: str) -> dict[str, Any] | None:
        """Let the batch of `step` back in: drop its suspect, or append a release record when it
        was quarantined; None when it was only a suspect or is unknown."""
        if self.suspects.pop(step, None) is not None:
            return None
        for record in reversed(self.records):
            if record.get("step") == step and self.holds(record):
                release = {
                    "step": step,
                    "time": _utc_now(),
                    "action": "release",
                    "reason": why,
                    "released_at": released_at,
                    "batch_ids": record.get("batch_ids"),
                    "sample_ids": record.get("sample_ids"),
                }
                self._write(release)
                return release
        return None

    def forget_after(self, step: int) -> None:
        """Drop suspects at or after `step`: a rollback undid their steps and their follow-ups."""
        for held in [s for s in self.suspects if s >= step]:
            del self.suspects[held]

    def state_dict(self) -> list[list[Any]]:
        """The suspects held, as plain data for the guard's state."""
        return [[step, dict(held)] for step, held in self.suspects.items()]

    def load_state_dict(self, state: list[list[Any]]) -> None:
        self.suspects = {int(step): dict(held) for step, held in state}

    def holds(self, record: dict[str, Any]) -> bool:
        """Whether the ids of a quarantine record are still quarantined."""
        batch = record.get("batch_ids")
        samples = record.get("sample_ids") or []
        return bool(batch and _key(batch) in self.batches) or any(
            str(s) in self.samples for s in samples
        )

    def add(
        self,
        step: int,
        reason: str,
        loss: float,
        batch_ids: Sequence[Any] | None,
        sample_ids: Sequence[Any] | None = None,
        confirmed_at: int | None = None,
    ) -> dict[str, Any] | None:
        """Record a blamed batch; nothing when it carries no ids to recognise it by, or when
        these ids are quarantined already (a step replayed after a resume)."""
        if not batch_ids and not sample_ids:
            return None
        record: dict[str, Any] = {
            "step": step,
            "time": _utc_now(),
            "reason": reason,
            "loss": _json_number(float(loss)),
            "batch_ids": list(batch_ids) if batch_ids else None,
            "sample_ids": list(sample_ids) if sample_ids else None,
        }
        if confirmed_at is not None:
            record["confirmed_at"] = confirmed_at
        known_batch = not batch_ids or _key(batch_ids) in self.batches
        known_samples = all(str(i) in self.samples for i in sample_ids or [])
        if known_batch and known_samples:
            return None
        self._write(record)
        return record

    @property
    def unwritten(self) -> int:
        """Records kept in memory only, because the disk refused them."""
        return len(self.file.unwritten) if self.file is not None else 0

    def close(self) -> None:
        """One last try to write the records kept in memory; never raises."""
        if self.file is not None:
            self.file.close(sync=True)

    def contains(self, ids: Sequence[Any]) -> bool:
        """Whether a batch with these ids was quarantined, or holds a quarantined sample."""
        if not self.batches and not self.samples:
            return False
        return _key(ids) in self.batches or any(str(i) in self.samples for i in ids)
