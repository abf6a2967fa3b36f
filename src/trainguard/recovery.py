"""`Recovery`: snapshots on schedule, rollback, the data's rewind and skip, LR cuts, quarantine."""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from trainguard.actions.checkpoint_files import DamagedCheckpoint
from trainguard.actions.data import GuardedBatches, sized_skip
from trainguard.actions.host_memory import Budget, rank_budget, size_text
from trainguard.actions.optimizer_step import OptimizerActions
from trainguard.actions.quarantine import Quarantine
from trainguard.actions.snapshots import (
    Snapshot,
    SnapshotPlan,
    SnapshotRing,
    Stateful,
    budget_interval,
)
from trainguard.config import GuardConfig, RecoveryConfig
from trainguard.detectors import DetectorSuite
from trainguard.events import Decision, Event, EventKind
from trainguard.policy import StepPolicy

MAX_BATCH_IDS = 64
POSITIONS_KEPT = 8192  # steps whose data position is remembered, to map incidents to batches
STEP_TIMES_KEPT = 32  # recent step times whose median sizes the snapshot interval


class DurableTarget(Protocol):
    """Durable checkpoints as rollback targets, where at most one snapshot fits in memory."""

    def known_good_at_or_before(self, step: int) -> int | None: ...

    def restore_step(self, step: int) -> dict[str, Any]: ...

    def forget(self, step: int) -> None: ...


class Recovery:
    """Keeps known-good states and undoes incidents: snapshots on schedule, rollback to the one
    before an incident with the data rewound and a region skipped, LR cuts, and the quarantine
    of toxic batches. Each method returns the events that say what it did."""

    def __init__(
        self,
        config: GuardConfig,
        policy: StepPolicy,
        detectors: DetectorSuite,
        quarantine: Quarantine,
        model: Stateful | None = None,
        optimizer: Stateful | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        actions: OptimizerActions | None = None,
    ) -> None:
        self.guard_config = config
        self.config: RecoveryConfig = config.recovery.sized(config.diagnosis.total_steps)
        self.policy = policy
        self.detectors = detectors
        self.quarantine = quarantine
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.actions = actions
        self.ring = SnapshotRing(config.recovery.snapshots)
        self.batches: GuardedBatches | None = None
        self.positions: dict[int, int] = {}
        self.last_incident = -(10**9)
        self.step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self.snapshot_seconds: float | None = None  # what the last snapshot took
        self._snapshot_waiting = False  # a snapshot fell due before its memory was pinned
        self.unnamed_suspects: deque[int] = deque(maxlen=64)  # suspects without ids to name them
        self.policy.recovery = self.config
        self.durable: DurableTarget | None = None  # checkpoints, where one snapshot at most fits

    def size_to_data(self, batches: GuardedBatches) -> None:
        """Use `batches` for rewinds; a source with a `len()` sizes the recovery when
        `diagnosis.total_steps` is not set."""
        self.batches = batches
        length = batches.length
        if self.guard_config.diagnosis.total_steps is None and length is not None and length > 0:
            self.config = self.guard_config.recovery.sized(length)  # at least one pass
            self.policy.recovery = self.config

    @property
    def rewinds_data(self) -> bool:
        """Whether a rollback rewinds the data (it comes through `guard.batches`)."""
        return self.batches is not None

    # -- bookkeeping of each step -------------------------------------------------------------
    def remember_position(self, step: int) -> None:
        """Note where in the data this step's batch came from."""
        if self.batches is None or self.batches.current is None:
            return
        self.positions.pop(step, None)  # a replayed step moves to the newest end
        self.positions[step] = self.batches.current
        if len(self.positions) > POSITIONS_KEPT:
            del self.positions[next(iter(self.positions))]

    def note_decision(self, decision: Decision) -> None:
        """A step that was not a plain step, or raised a warning or worse, is an incident."""
        if decision.action != "step" or any(e.severity != "info" for e in decision.events):
            self.last_incident = decision.step

    def note_step_time(self, seconds: float) -> None:
        self.step_times.append(seconds)

    def healthy_window(self, step: int) -> bool:
        """No warning or worse, and no skip or rollback, in the `snapshot_every` steps before."""
        return step - self.last_incident > (self.config.snapshot_every or 1)

    def has_target(self, incident: int) -> bool:
        """Whether a snapshot lies at or before the first step of an incident (for the policy)."""
        rec = self.config
        if not rec.enabled:
            return False
        # one slot: the narrowest margin a rollback may ask for (a sudden incident's)
        margin = (
            min(rec.rollback_margin, rec.sudden_margin) if self._one_slot else rec.rollback_margin
        )
        if self.ring.target_for(incident, margin, self._one_slot) is not None:
            return True
        return self._durable_step(incident, rec.rollback_margin) is not None

    @property
    def _one_slot(self) -> bool:
        """Whether the ring holds a single snapshot: it serves only an incident that began its
        margin after it (its one chance: a snapshot at the incident's own step may hold the
        update that made it, and would be restored again and again)."""
        return self.ring.plan_made is not None and self.ring.slots == 1

    def _durable_step(self, incident: int, margin: int) -> int | None:
        """Where at most one snapshot fits in memory: the newest known-good durable checkpoint
        at least `margin` steps before the incident, else at or before its first step."""
        if self.durable is None or self.ring.plan_made is None or self.ring.slots > 1:
            return None
        for limit in (incident - margin, incident):
            found = self.durable.known_good_at_or_before(limit)
            if found is not None:
                return found
        return None

    # -- snapshots ----------------------------------------------------------------------------
    @property
    def snapshot_interval(self) -> int:
        """Steps between snapshots: `recovery.snapshot_every`, sized to the run, and longer
        where fewer snapshots fit in memory than `recovery.snapshots` asks for (the ring reaches
        as far back); where the data cannot be rewound and the interval is left to the run, as
        short as `recovery.snapshot_budget` allows (the last snapshot's cost against the median
        step time), but long enough that the ring still holds one from before a spike's
        follow-up."""
        rec = self.config
        every = rec.snapshot_every or 1
        slots = self.ring.slots
        if 2 <= slots < rec.snapshots:  # the same reach back with fewer snapshots
            every = math.ceil(every * (rec.snapshots - 1) / (slots - 1))
        if self.guard_config.recovery.snapshot_every is not None or self.rewinds_data:
            return every
        if self.snapshot_seconds is None or not self.step_times or slots < 2:
            return every
        reach = self.guard_config.loss_spike.classify_window + rec.sudden_margin
        shortest = min(every, math.ceil(reach / (slots - 1)))
        step_seconds = statistics.median(self.step_times)
        return budget_interval(
            self.snapshot_seconds, step_seconds, rec.snapshot_budget, shortest, every
        )

    def plan_snapshots(self, step: int) -> list[Event]:
        """Once, after the first update (the optimizer's state exists): size the ring to
        `recovery.snapshot_memory`, start allocating its host memory, and say how many
        snapshots fit and what a rollback does where none does."""
        if not self.config.enabled or self.model is None or self.optimizer is None:
            return []
        if self.ring.plan_made is not None:
            return []
        budget = rank_budget(self.guard_config.recovery.snapshot_memory)
        plan = self.ring.plan(self.model, self.optimizer, budget.nbytes)
        return [self._plan_event(step, plan, budget)]

    def _plan_event(self, step: int, plan: SnapshotPlan, budget: Budget) -> Event:
        rec = self.config
        budget_text = f"budget {size_text(plan.budget)} per rank ({budget.describe()})"
        held = "pinned in the background" if plan.pinned else "in host memory"
        if plan.slots == plan.wanted:
            fits = f"all {plan.wanted} fit, every {self.snapshot_interval} steps, {held}"
        elif plan.slots >= 2:
            fits = (
                f"{plan.slots} of {plan.wanted} fit: one every {self.snapshot_interval} steps "
                f"instead of {rec.snapshot_every}, so that the ring reaches as far back"
            )
        elif plan.slots == 1:
            fits = (
                f"1 of {plan.wanted} fits: it is taken every {self.snapshot_interval} steps, only "
                "after as many steps without a warning, and serves only an incident that began "
                f"{rec.rollback_margin} steps after it or more ({rec.sudden_margin} for a sudden "
                "one); " + self._fallback()
            )
        else:
            fits = "none fits: no in-memory rollback; " + self._fallback()
        if plan.slots < plan.wanted:
            needed = plan.wanted * plan.nbytes * budget.ranks
            fits += (
                f"; recovery.snapshot_memory of {size_text(needed)} or more on the node keeps "
                f"{plan.wanted}"
            )
        if budget.capped:
            fits += "; the size set was more than the node has available"
        return Event(
            step=step,
            kind=EventKind.SNAPSHOT,
            severity="info" if plan.slots == plan.wanted and not budget.capped else "warning",
            message=(
                f"snapshots take {size_text(plan.nbytes)} each on this rank "
                f"({size_text(plan.nbytes * plan.slots)} for the ring); {budget_text}: {fits}"
            ),
            metrics={
                "snapshot_bytes": plan.nbytes,
                "budget_bytes": plan.budget,
                "available_bytes": budget.available,
                "snapshots_wanted": plan.wanted,
                "snapshots_fit": plan.slots,
                "snapshot_every": self.snapshot_interval,
                "pinned": plan.pinned,
                "local_ranks": budget.ranks,
            },
        )

    def _fallback(self) -> str:
        """What a rollback does without an in-memory target, in words."""
        if self.durable is not None:
            return (
                "an incident without one rolls back to the newest durable checkpoint taken in a "
                "healthy window, else is skipped with an LR cut"
            )
        return "an incident without one is skipped with an LR cut (no run_dir: no checkpoint)"

    def maybe_snapshot(self, step: int) -> list[Event]:
        """Before `step` (the next one): keep a snapshot every `snapshot_interval` steps, on
        schedule whatever was raised before (with a single slot, only after a healthy window);
        whether it serves an incident is judged later. A snapshot due before its host memory is
        pinned comes late (said once), never slow."""
        if not self.config.enabled or self.model is None:
            return []
        if self.optimizer is None or self.actions is None:
            return []
        events = self.plan_snapshots(step)
        if self.ring.ready:  # a pinning that stopped short is said, even where it left none
            events += self._pinning_failed(step)
        if self.ring.slots == 0:
            return events
        if not self.snapshot_due(step):
            return events
        if self.ring.slots == 1 and not self.healthy_window(step):
            return events  # the only snapshot is not replaced by one that may hold the incident
        if not self.ring.ready:
            if not self._snapshot_waiting:
                events.append(self._waiting_event(step))
            self._snapshot_waiting = True
            return events
        self._snapshot_waiting = False
        events += self._pinning_failed(step)  # pinned since the check above
        if self.ring.slots == 0:
            return events
        started = time.perf_counter()
        guard_state = {
            "detectors": self.detectors.state_dict(),
            "schedule_lrs": copy.deepcopy(self.actions.schedule_lrs()),  # tensor LRs too
        }
        position = self.batches.state() if self.batches is not None else None
        last_warning = None if self.healthy_window(step) else self.last_incident
        try:
            self.ring.take(
                step,
                self.model,
                self.optimizer,
                self.scheduler,
                self.scaler,
                guard_state,
                position,
                last_warning,
            )
        except MemoryError as exc:  # a state that outgrew its slot, and no memory for more
            events.append(self._take_failed(step, exc))
            return events
        self.snapshot_seconds = time.perf_counter() - started
        return events

    def snapshot_due(self, step: int) -> bool:
        """Whether a snapshot falls due before `step` (every `snapshot_interval` steps, or one
        still waiting for its memory), before the healthy-window and memory checks."""
        every = self.snapshot_interval
        newest = self.ring.snapshots[-1].step if self.ring.snapshots else None
        due = step % every == 0 if newest is None else step - newest >= every
        return due or self._snapshot_waiting

    def _pinning_failed(self, step: int) -> list[Event]:
        """Said once: the background pinning stopped short, and how many snapshots it left."""
        pool = self.ring.pool
        if pool is None or pool.error is None:
            return []
        error, pool.error = pool.error, None
        return [
            Event(
                step=step,
                kind=EventKind.SNAPSHOT,
                severity="warning",
                message=(
                    f"pinning host memory for snapshots stopped ({error}); "
                    f"{len(pool.slots)} snapshot(s) kept instead of "
                    f"{self.ring.plan_made.slots if self.ring.plan_made else '?'}: lower "
                    "recovery.snapshot_memory"
                ),
                metrics={"snapshots_fit": len(pool.slots)},
            )
        ]

    def _take_failed(self, step: int, exc: MemoryError) -> Event:
        """The snapshot of `step` could not be taken (the state grew past its buffer, and a
        larger one could not be made): the older ones stay the rollback targets."""
        return Event(
            step=step,
            kind=EventKind.SNAPSHOT,
            severity="warning",
            message=(
                f"the snapshot of step {step} was not taken ({exc}); the "
                f"{len(self.ring.snapshots)} older one(s) stay the rollback targets"
            ),
            metrics={"step": step},
        )

    def _waiting_event(self, step: int) -> Event:
        plan = self.ring.plan_made
        size = size_text(plan.nbytes * plan.slots) if plan is not None else "its memory"
        return Event(
            step=step,
            kind=EventKind.SNAPSHOT,
            severity="info",
            message=(
                f"the snapshot due at step {step} waits for its host memory ({size}) to be "
                "pinned in the background: it is taken at the first step after"
            ),
            metrics={"step": step},
        )

    def before_update(self) -> None:
        """Before the optimizer writes the state: wait (on the device) for snapshot copies."""
        self.ring.before_update()

    def set_aside_after(self, step: int | None) -> list[int]:
        """Drop the snapshots taken after `step` (every one with None), which may hold a replica
        that diverged since; the steps of those dropped."""
        limit = -1 if step is None else step
        dropped = [s.step for s in self.ring.snapshots if s.step > limit]
        self.ring.drop_after(limit)
        return dropped

    # -- rollback -----------------------------------------------------------------------------
    def roll_back(self, decision: Decision) -> tuple[int, list[Event]]:
        """Restore the snapshot the ring holds for the incident (never one inside it), and skip
        the incident batch and a share of the data sized to what is left (nothing where the
        policy replays the incident); the step to go on from, and the events that say so."""
        model, optimizer, actions = self.model, self.optimizer, self.actions
        incident = decision.incident_step
        rollback_to = decision.rollback_to if decision.rollback_to is not None else decision.step
        start = incident if incident is not None else rollback_to
        snapshot = self.ring.target_for(start, start - rollback_to, self._one_slot)
        durable = None
        if snapshot is None and model is not None and actions is not None:
            durable = self._durable_step(start, start - rollback_to)
            if durable is not None:
                try:
                    snapshot = self._restore_durable(durable, actions)
                except DamagedCheckpoint as exc:  # nothing live was touched
                    if self.durable is not None:
                        self.durable.forget(durable)
                    reason = f"the checkpoint of step {durable} cannot be loaded ({exc})"
                    return decision.step + 1, self._unavailable(decision, reason)
            elif self._one_slot:  # the one snapshot is too close to this incident
                reason = "the one snapshot recovery.snapshot_memory holds is too close to it"
                return decision.step + 1, self._unavailable(decision, reason)
        if snapshot is None or model is None or optimizer is None or actions is None:
            raise RuntimeError("the policy rolled back without a rollback target")
        from_step = decision.step
        if durable is None:
            self.ring.restore(snapshot, model, optimizer, self.scheduler, self.scaler)
        # copies: the detectors go on mutating what they load, and a later rollback may return
        # to this same snapshot
        self.detectors.load_state_dict(copy.deepcopy(snapshot.guard["detectors"]))
        actions.restore_schedule_lrs(copy.deepcopy(snapshot.guard["schedule_lrs"]))
        factor = decision.lr_factor or 1.0
        if decision.lr_factor is not None:
            actions.cut_lr(factor, decision.rewarm_steps)
        self.ring.drop_after(snapshot.step)
        self.policy.forget_after(snapshot.step)
        self.quarantine.forget_after(snapshot.step)
        self.last_incident = snapshot.step
        skipped: tuple[int, int] | None = None
        skip_event: Event | None = None
        if self.batches is not None and snapshot.data_position is not None:
            position = self.positions.get(incident) if incident is not None else None
            if position is not None and not decision.replay_incident:
                skipped, skip_event = self._skip_after(decision, position)
            self.batches.rewind(snapshot.data_position, skipped)
        lost = None if self.rewinds_data else from_step + 1 - snapshot.step
        if skipped:
            note = f"; skipping batches {skipped[0]}..{skipped[1] - 1}"
        elif decision.replay_incident and self.rewinds_data:
            note = (
                "; no batch skipped: the incident's batches are fed again on the restored "
                "weights (a toxic one spikes again and is skipped then)"
            )
        else:
            note = "; no data to skip (iterate with guard.batches(loader) to skip it)"
        if lost is not None:
            note += f"; the data goes on, so the {lost} batches since the state are lost"
        if snapshot.step > rollback_to:
            note += (
                f"; no snapshot {start - rollback_to} steps before the incident was "
                f"kept, so the newest at or before its first step ({start}) was used"
            )
        if snapshot.last_warning is not None:
            note += f" (taken after a warning at step {snapshot.last_warning}, judged since)"
        if durable is not None:
            note += (
                f"; restored from the durable checkpoint step-{durable}, taken in a healthy "
                "window (recovery.snapshot_memory holds no snapshot that serves)"
            )
        lr = (
            f"LR kept at x{actions.lr_scale:.3g} of the schedule (a sudden "
            "incident undone; a repeat cuts it)"
            if decision.lr_factor is None
            else f"LR x{factor:.3g}, now x{actions.lr_scale:.3g} of the schedule, "
            + (
                f"climbing back over {decision.rewarm_steps} steps"
                if decision.rewarm_steps
                else "kept (a repeated incident, or re-warm off)"
            )
        )
        event = Event(
            step=from_step,
            kind=EventKind.ROLLBACK,
            severity="warning",
            message=(
                f"rolled back from step {from_step} to the state at step {snapshot.step}, "
                f"before the incident ({decision.reason}); {lr}{note}"
            ),
            metrics={
                "from_step": from_step,
                "to_step": snapshot.step,
                "incident_step": decision.incident_step,
                "lr_factor": factor,
                "lr_scale": actions.lr_scale,
                "rewarm_steps": decision.rewarm_steps,
                "skipped_batches": list(skipped) if skipped else None,
                "snapshot_after_warning": snapshot.last_warning,
                "lost_batches": lost,
            },
            action="rollback",
        )
        return snapshot.step, [event] if skip_event is None else [event, skip_event]

    def _unavailable(self, decision: Decision, reason: str) -> list[Event]:
        """A rollback that found no target it may use after all: nothing live was touched;
        training goes on with the LR cut, as where no target exists, and an event says why."""
        factor = decision.lr_factor or 0.5
        if self.actions is not None:
            self.actions.cut_lr(factor, decision.rewarm_steps)
        lr_scale = self.actions.lr_scale if self.actions is not None else factor
        return [
            Event(
                step=decision.step,
                kind=EventKind.ROLLBACK_UNAVAILABLE,
                severity="warning",
                message=(
                    f"no rollback for the incident at step {decision.incident_step}: {reason}; "
                    f"training goes on with the LR x{factor:.3g}, now x{lr_scale:.3g} of the "
                    "schedule"
                ),
                metrics={
                    "incident_step": decision.incident_step,
                    "lr_factor": factor,
                    "lr_scale": lr_scale,
                },
                action="rollback",
            )
        ]

    def _restore_durable(self, step: int, actions: OptimizerActions) -> Snapshot:
        """Load the known-good checkpoint of `step` into the live objects; what a snapshot of it
        would hold for the rest of the rollback (detectors, the schedule's LRs, data)."""
        assert self.durable is not None
        plain = self.durable.restore_step(step)
        guard = plain["guard"]
        saved = (guard.get("actions") or {}).get("schedule_lrs")
        lrs = saved if saved is not None else actions.schedule_lrs()
        return Snapshot(
            step=step,
            model={},
            optimizer={},
            scheduler=None,
            scaler=None,
            rng={},
            guard={"detectors": guard["detectors"], "schedule_lrs": lrs},
            data_position=plain.get("data"),
        )

    def _skip_after(self, decision: Decision, position: int) -> tuple[tuple[int, int], Event]:
        """The positions a rollback skips, the incident batch and a share of what is left (never
        past the end), and the `data_skipped` event that says so."""
        batches = self.batches
        left = batches.left_after(position) if batches is not None else None
        basis = "batches left in the data"
        total = self.guard_config.diagnosis.total_steps
        if left is None and total is not None:
            left, basis = max(0, total - decision.step - 1), "planned steps left"
        elif left is None:
            left, basis = max(1, decision.step), "steps made so far (the data has no length)"
        share = min(1.0, self.config.skip_share * decision.skip_widening)  # repeats widen it
        more = sized_skip(decision.skip_after, left, share)
        skipped = (position, position + 1 + more)
        message = (
            f"skipping {more + 1} batches ({position}..{position + more}): the one that fed the "
            f"incident at step {decision.incident_step} and {more} after it"
        )
        if more < decision.skip_after:
            message += f", not {decision.skip_after}: at most {share:.0%} of the {left} {basis}"
        event = Event(
            step=decision.step,
            kind=EventKind.DATA_SKIPPED,
            severity="info",
            message=message,
            metrics={
                "first": position,
                "last": position + more,
                "count": more + 1,
                "wanted": decision.skip_after + 1,
                "left": left,
                "basis": basis,
                "share": share,
            },
            action="rollback",
        )
        return skipped, event

    def data_ended(self, batches: GuardedBatches, step: int) -> Event:
        """The data source ran out: what the guard passed over in this pass, the pass's length
        and, against `diagnosis.total_steps`, whether the run fell short of its plan."""
        total = self.guard_config.diagnosis.total_steps
        short = total is not None and step < total
        passed = batches.skipped + batches.held_out
        message = (
            f"the data ran out at step {step} after {batches.position} batches; "
            f"the guard passed over {batches.skipped} skipped by rollbacks and "
            f"{batches.held_out} quarantined"
        )
        if short:
            message += f"; the run planned {total} steps"
        elif total is None and batches.length:  # one pass of several, maybe: no plan to judge
            message += f"; a pass of the data is {batches.length} batches"
        return Event(
            step=step,
            kind=EventKind.DATA_EXHAUSTED,
            severity="warning" if short and passed else "info",
            message=message,
            metrics={
                "batches": batches.position,
                "skipped": batches.skipped,
                "quarantined": batches.held_out,
                "planned_steps": total,
                "data_length": batches.length,
            },
        )

    # -- LR cuts and quarantine ---------------------------------------------------------------
    def cut_lr(self, decision: Decision) -> list[Event]:
        """Cut the LR as the decision says (where no rollback serves), and say so."""
        if self.actions is None or decision.lr_factor is None:
            return []
        self.actions.cut_lr(decision.lr_factor, decision.rewarm_steps)
        events: list[Event] = []
        if decision.unrolled_incident is not None:
            events.append(
                Event(
                    step=decision.step,
                    kind=EventKind.ROLLBACK_UNAVAILABLE,
                    severity="warning",
                    message=(
                        f"no snapshot at or before step {decision.unrolled_incident}, where the "
                        f"incident began, to roll back to ({decision.reason or 'see the events'});"
                        f" the LR is cut x{decision.lr_factor:.3g} instead"
                    ),
                    metrics={"incident_step": decision.unrolled_incident},
                    action=decision.action,
                )
            )
        events.append(
            Event(
                step=decision.step,
                kind=EventKind.LR_REDUCED,
                severity="warning",
                message=(
                    f"LR x{decision.lr_factor:.3g} ({decision.reason or 'no rollback target'}); "
                    f"now x{self.actions.lr_scale:.3g} of the schedule"
                ),
                metrics={"lr_factor": decision.lr_factor, "lr_scale": self.actions.lr_scale},
                action=decision.action,
            )
        )
        return events

    def hold_data(
        self,
        decision: Decision,
        loss: float,
        batch_ids: Iterable[Any] | None,
        sample_ids: Iterable[Any] | None,
    ) -> list[Event]:
        """Hold this step's batch as a suspect, quarantine a suspect its spike's follow-up
        confirmed, or release one whose spike was re-typed; each for good is an event."""
        if decision.suspect:
            ids = list(batch_ids) if batch_ids is not None else None
            if ids is None and self.batches is not None:
                ids = self.batches.current_ids
            samples = [plain_id(i) for i in sample_ids] if sample_ids is not None else None
            if not ids and not samples:
                self.unnamed_suspects.append(decision.step)
            self.quarantine.suspect(
                decision.step, decision.reason, loss, [plain_id(i) for i in ids] if ids else None,
                samples,
            )  # fmt: skip
        events: list[Event] = []
        if decision.quarantine_step is not None:
            spike = decision.quarantine_step
            record = self.quarantine.confirm(
                spike, decision.step, "its follow-up confirmed data toxicity"
            )
            if record is not None:
                events.append(_quarantine_event(decision, spike, record, released=False))
            elif spike in self.unnamed_suspects:
                events.append(_unnamed_event(decision, spike))
        if decision.release_step is not None:
            spike = decision.release_step
            record = self.quarantine.release(
                spike, decision.step, "its spike was re-typed: not data toxicity"
            )
            if record is not None:
                events.append(_quarantine_event(decision, spike, record, released=True))
        return events

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The last incident and the remembered data positions: plain data."""
        return {
            "last_incident": self.last_incident,
            "positions": [[k, v] for k, v in self.positions.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_incident, self.positions = self.read_state(state)

    def read_state(self, state: dict[str, Any]) -> tuple[int, dict[int, int]]:
        """The last incident and the data positions of a state, checked (raises when malformed)."""
        return (
            int(state.get("last_incident", self.last_incident)),
            {int(k): int(v) for k, v in state.get("positions", [])},
        )


def _quarantine_event(
    decision: Decision, spike: int, record: dict[str, Any], released: bool
) -> Event:
    ids = record.get("sample_ids") or record.get("batch_ids") or []
    what = "samples" if record.get("sample_ids") else "batch"
    message = (
        f"released the {what} of step {spike} from the quarantine: its spike was re-typed"
        if released
        else f"quarantined the {what} of step {spike} for good: its spike's follow-up "
        "confirmed data toxicity"
    )
    return Event(
        step=decision.step,
        kind=EventKind.QUARANTINE,
        severity="info",
        message=message,
        metrics={"spike_step": spike, "released": released, "ids": ids[:MAX_BATCH_IDS]},
        action=decision.action,
    )


def _unnamed_event(decision: Decision, spike: int) -> Event:
    """A confirmed toxic batch that carries no ids, so that nothing can keep it out."""
    return Event(
        step=decision.step,
        kind=EventKind.QUARANTINE,
        severity="warning",
        message=(
            f"the batch of step {spike} was confirmed as toxic data but has no ids, so it cannot "
            "be quarantined: pass batch_ids= to guard.step, or ids= to guard.batches"
        ),
        metrics={"spike_step": spike, "released": False, "ids": [], "unnamed": True},
        action=decision.action,
    )


def plain_id(value: Any) -> Any:
    """A batch or sample id as plain JSON data."""
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() != 1 else value.item()
    if isinstance(value, (int, str, bool)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)
