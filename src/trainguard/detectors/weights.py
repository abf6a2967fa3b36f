"""`WeightJumpDetector`: a layer group's weights moving in one step far past their own steps."""

from __future__ import annotations

import math
from collections import deque

from trainguard.config import WeightJumpConfig
from trainguard.detectors.base import Detector, MetricPoint
from trainguard.detectors.series import MetricSeries
from trainguard.detectors.stats import lr_increased, median
from trainguard.events import Event

QUIET_STEPS = 5  # steps without a jump that end an incident
RECENT = 50  # moves a group's median move is read from
LEARN_CAP = math.log(2.0)  # moves are learned up to x2: a run's own recurring moves stop
# warning after the first, while after a x1000 write a later one still warns
NORM_FLOOR = 0.5  # a candidate jump is judged on norms floored at this share of the group's
# median norm over its last RECENT steps: a small group (a lone scalar bias) crossing zero
# moves x100 in ratio but not against its own size


class WeightJumpDetector(Detector):
    """Per layer group, the one-step move |log(norm_t / norm_t-1)| of the weights' norm; a jump
    passes `min_ratio`, `reach_factor` x the group's largest move in the last `window` steps and
    `median_factor` x its median move. One warning per incident (it ends after `QUIET_STEPS`
    steps without a jump), naming the group that moved most; none where the LR the run gives
    jumped (`stats.lr_increased`) within `QUIET_STEPS` steps, as a warm restart does: the run
    moved them. A candidate is judged on norms floored at half the group's median norm, so a
    small group passing near zero (a lone scalar bias changing sign) is not a jump; weights the
    guard rewrote itself (`MetricPoint.weights_rewritten`) are taken as they are."""

    name = "weight_jump"
    _state = ("last", "groups", "recent", "sizes", "quiet", "lrs")

    def __init__(self, config: WeightJumpConfig | None = None) -> None:
        self.config = config or WeightJumpConfig()
        self.last: dict[str, float] = {}  # each group's norm at the previous step
        # each group's [steps seen, largest move in this half-window, in the one before]
        self.groups: dict[str, list[float]] = {}
        self.recent: dict[str, list[float]] = {}  # each group's last RECENT moves
        self.sizes: dict[str, list[float]] = {}  # each group's last RECENT norms
        self.quiet = QUIET_STEPS  # steps since the last jump
        self.lrs: deque[float] = deque(maxlen=QUIET_STEPS + 1)  # the LRs of the latest steps

    def advance(self, series: MetricSeries, start: int) -> int:
        """A series without weight norms (every log but a guarded run's own) raises nothing."""
        return len(series) if not series.has_weight_norms else start

    def update(self, point: MetricPoint) -> list[Event]:
        norms = point.group_param_norms
        if not norms:
            return []
        if point.weights_rewritten:  # the guard's own rescale: the new norms are the reference
            self.last.update({k: v for k, v in norms.items() if math.isfinite(v) and v > 0})
            return []
        if point.lr is not None and math.isfinite(point.lr):
            self.lrs.append(point.lr)
        cfg = self.config
        floor = math.log(cfg.min_ratio)
        half = max(cfg.window // 2, 1)
        jumps: list[tuple[float, str, float, float]] = []  # move, group, ratio, limit
        for name, norm in norms.items():
            prev = self.last.get(name)
            if not math.isfinite(norm) or norm <= 0:
                self.last.pop(name, None)  # a zero or non-finite norm gives no ratio
                continue
            self.last[name] = norm
            if prev is None:
                continue
            move = abs(math.log(norm / prev))
            h = self.groups.setdefault(name, [0.0, 0.0, 0.0])
            recent = self.recent.setdefault(name, [])
            sizes = self.sizes.setdefault(name, [])
            limit = max(floor, cfg.reach_factor * max(h[1], h[2]))
            if h[0] >= cfg.warmup and move > limit:  # medians are read only past the rest
                if recent:
                    limit = max(limit, cfg.median_factor * median(recent))
                if sizes:
                    least = NORM_FLOOR * median(sizes)
                    move = min(move, abs(math.log(max(norm, least) / max(prev, least))))
                if move > limit:
                    jumps.append((move, name, norm / prev, limit))
            h[0] += 1
            h[1] = max(h[1], min(move, LEARN_CAP))
            if h[0] % half == 0:  # the largest move of the last one to two half-windows
                h[2], h[1] = h[1], 0.0
            recent.append(move)
            sizes.append(norm)
            if len(recent) > RECENT:
                del recent[0]
            if len(sizes) > RECENT:
                del sizes[0]
        if not jumps:
            self.quiet += 1
            return []
        was_quiet, self.quiet = self.quiet >= QUIET_STEPS, 0
        if not was_quiet or lr_increased(self.lrs):  # a repeat, or the run's own LR moved them
            return []
        move, name, ratio, limit = max(jumps)
        others = [g for _, g, _, _ in sorted(jumps, reverse=True)[1:]]
        change = f"x{ratio:.3g}" if ratio >= 1 else f"x{ratio:.3g} (shrank {1 / ratio:.3g}-fold)"
        return [
            self.event(
                point,
                "warning",
                f"the weights of layer group {name} moved {change} in one step, past the "
                f"x{math.exp(limit):.3g} its own steps reach"
                + (f"; {len(others)} more group(s) too ({', '.join(others[:3])})" if others else "")
                + ": an LR far above its schedule, a write to the weights outside the optimizer, "
                "or corrupted memory; check the LR the last optimizer step applied and any code "
                "that touches the weights",
                {
                    "group": name,
                    "ratio": ratio,
                    "limit_ratio": math.exp(limit),
                    "groups_moved": [name, *others],
                },
            )
        ]
