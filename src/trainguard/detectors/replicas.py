"""Data-parallel replicas whose weights should be bit-identical and are not."""

from __future__ import annotations

from collections import Counter

from trainguard.detectors.base import Detector, MetricPoint
from trainguard.detectors.series import MetricSeries
from trainguard.events import Event, EventKind


class ReplicaDivergenceDetector(Detector):
    """Reads a replica check's classes (`MetricPoint.replica_classes`): in each layer group where
    the replicas differ, the ranks outside a strict majority's class have diverged. A critical
    `replica_divergence` event names them, their groups, a `source` rank that agrees with the
    majority in every group (None when some group has no majority, or no rank agrees in all) and
    the last check where every replica agreed."""

    name = "replica_divergence"
    needs_ranks = True
    _state = ("last_agreed",)

    def __init__(self) -> None:
        self.last_agreed: int | None = None  # the step of the last check where all agreed

    def advance(self, series: MetricSeries, start: int) -> int:
        return len(series)  # a series holds no replica checks: nothing to see

    def update(self, point: MetricPoint) -> list[Event]:
        classes = point.replica_classes
        if classes is None:
            return []
        if not classes:
            self.last_agreed = point.step
            return []
        world = len(next(iter(classes.values())))
        diverged: dict[int, list[str]] = {}  # rank -> the groups where it left the majority
        disputed: list[str] = []  # groups with no strict majority
        for group, ranks in classes.items():
            majority, count = Counter(ranks).most_common(1)[0]
            if 2 * count <= world:
                disputed.append(group)
                continue
            for rank, c in enumerate(ranks):
                if c != majority:
                    diverged.setdefault(rank, []).append(group)
        agreeing = [r for r in range(world) if r not in diverged]
        source = agreeing[0] if agreeing and not disputed else None
        since = (
            f"the last check where they agreed was step {self.last_agreed}"
            if self.last_agreed is not None
            else "no earlier check found them agreeing"
        )
        named = ", ".join(f"rank {r} in {_groups(g)}" for r, g in sorted(diverged.items()))
        if disputed:
            shown = "; ".join(
                f"{g}: {len(set(classes[g]))} versions, ranks by version {classes[g]}"
                for g in disputed
            )
            message = (
                f"the {world} data-parallel replicas hold different weights in "
                f"{_groups(disputed)} with no majority to tell the right one ({shown})"
                + (f", and {named} left the majority" if named else "")
                + f"; {since}"
            )
            ranks = list(range(world))
        else:
            message = (
                f"the weights of {named} differ from the {len(agreeing)} of {world} replicas "
                f"that agree; {since}"
            )
            if source is None:
                message += "; no rank agrees with the majority in every group"
            ranks = sorted(diverged)
        event = self.event(
            point,
            "critical",
            message,
            {
                "ranks": ranks,
                "groups": {str(r): g for r, g in sorted(diverged.items())},
                "disputed_groups": disputed,
                "classes": classes,
                "source": source,
                "last_agreed_step": self.last_agreed,
                "world": world,
            },
            kind=EventKind.REPLICA_DIVERGENCE,
        )
        event.rank = ranks[0] if ranks else None
        return [event]


def _groups(names: list[str]) -> str:
    return ("layer group " if len(names) == 1 else "layer groups ") + ", ".join(names)
