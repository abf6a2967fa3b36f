"""`EventEnricher`: the one stage between the policy and the sinks that adds what a detector
cannot know: the rank and host an event is about, the step's batch ids, the layer groups'
gradient report."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from trainguard.distributed import RankContext
from trainguard.events import Event, EventKind
from trainguard.recovery import MAX_BATCH_IDS, plain_id

GROUP_REPORT_KINDS = frozenset({EventKind.GRAD_SPIKE, EventKind.GRAD_EXPLOSION})
PER_RANK_KINDS = frozenset(
    {
        EventKind.STRAGGLER,
        EventKind.RANK_OUTLIER,
        EventKind.REPLICA_DIVERGENCE,
        EventKind.REPLICA_RESYNC,
    }
)


class EventEnricher:
    """Returns new events with their context filled in; never edits the events it is given."""

    def __init__(self, ranks: RankContext | None) -> None:
        self.ranks = ranks

    def enrich(
        self,
        events: Sequence[Event],
        batch_ids: Iterable[Any] | None = None,
        group_report: Callable[[], dict[str, Any]] | None = None,
    ) -> list[Event]:
        """`events` with the culprit rank a per-rank check found (this rank otherwise), the host
        of a per-rank event, the batch ids (the first `MAX_BATCH_IDS`) and, on a gradient
        spike, the layer groups' report."""
        ids = list(batch_ids) if batch_ids is not None else None
        shown = [plain_id(i) for i in ids[:MAX_BATCH_IDS]] if ids is not None else None
        culprit = next((e.rank for e in events if e.kind == EventKind.RANK_OUTLIER), None)
        enriched: list[Event] = []
        for event in events:
            rank, metrics = event.rank, dict(event.metrics)
            if self.ranks is not None:
                if rank is None:
                    rank = culprit if culprit is not None else self.ranks.rank
                if event.kind in PER_RANK_KINDS:
                    metrics["host"] = self.ranks.hosts[rank]
            if ids is not None and shown is not None:
                metrics["batch_ids"] = shown
                if len(ids) > MAX_BATCH_IDS:
                    metrics["batch_ids_total"] = len(ids)
            if group_report is not None and event.kind in GROUP_REPORT_KINDS:
                metrics["group_report"] = group_report()
            enriched.append(dataclasses.replace(event, rank=rank, metrics=metrics))
        return enriched
