"""`Quarantine`: batches and samples blamed for an incident, kept out of training for good."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.events import _json_number, _utc_now
from trainguard.line_file import LineFile, Report, stderr_report


def _key(ids: Sequence[Any]) -> str:
    return json.dumps([str(i) for i in ids])


class Quarantine:
    """`run_dir/quarantine.jsonl`, loaded at start so a restarted run honours it too. A record
    the disk refuses still holds in this run, is kept in memory, said once, and written with
    the next record or at `close`."""

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
        self.records: list[dict[str, Any]] = []
        if self.path is not None and self.path.is_file():
            for number, line in enumerate(self.path.read_text().splitlines(), 1):
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
        self.records.append(record)
        if record.get("batch_ids"):
            self.batches.add(_key(record["batch_ids"]))
        for sample in record.get("sample_ids") or []:
            self.samples.add(str(sample))

    def add(
        self,
        step: int,
        reason: str,
        loss: float,
        batch_ids: Sequence[Any] | None,
        sample_ids: Sequence[Any] | None = None,
    ) -> dict[str, Any] | None:
        """Record a blamed batch; nothing when it carries no ids to recognise it by."""
        if not batch_ids and not sample_ids:
            return None
        record = {
            "step": step,
            "time": _utc_now(),
            "reason": reason,
            "loss": _json_number(float(loss)),
            "batch_ids": list(batch_ids) if batch_ids else None,
            "sample_ids": list(sample_ids) if sample_ids else None,
        }
        self._remember(record)
        if self.file is not None:
            self.file.write((json.dumps(record) + "\n").encode(), sync=True)
            self.file.release()  # records are rare: no file is held open between them
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
