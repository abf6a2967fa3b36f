"""`StepPolicy`: step, skip, roll back or halt, from the events of one step and its own history."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from trainguard.config import PolicyConfig, PreemptConfig, RecoveryConfig
from trainguard.detectors.base import Detector, EvalPoint, MetricPoint
from trainguard.events import Action, Decision, Event, EventKind, PreemptCall

SAME_REGION = 2  # rollbacks to targets this many snapshot intervals apart hit the same region
MAX_WIDENING = 3  # the skip doubles with each repeat in a region, up to 2**3 times
HELD_STEPS = 256  # suspect and quarantined steps remembered, to confirm or release them

TargetCheck = Callable[[int], bool]  # whether a rollback target exists for an incident at step s
# event kinds raised by a detector of another name (the device gate asks the raiser for a bound)
RAISED_BY = {"spike_classified": "loss_spike", "fp16_overflow": "nonfinite"}
# kinds the device gate skips on by itself: a non-finite loss or gradient (an overflow needs a
# GradScaler, which keeps the synchronous path)
GATED_ALWAYS = frozenset({"nonfinite", "fp16_overflow"})


def clears_noise(event: Event) -> bool:
    """Whether a loss spike's jump cleared the noise: z over the z rule's threshold, whichever
    rule raised it (the ratio rule's lower floor of z is enough to skip a step, not to take a
    batch away for good); True for an event that does not say."""
    z, threshold = event.metrics.get("z_score"), event.metrics.get("z_threshold")
    if not isinstance(z, (int, float)) or not isinstance(threshold, (int, float)):
        return True
    return bool(z >= threshold)  # a NaN z clears nothing


# the precursors an LR cut answers: attention logits, activations and log Z run away with a high
# LR; Adam's eps ratio falling towards 1 (eps damping the updates) slows a run, and a cut would
# damp it further
LR_CUT_SIGNALS = frozenset({"max_logit", "attn_entropy", "block_rms", "log_z"})


class StepPolicy:
    """The only place where events become an action (README: the rules, in order)."""

    def __init__(
        self,
        config: PolicyConfig | None = None,
        recovery: RecoveryConfig | None = None,
        preempt: PreemptConfig | None = None,
    ) -> None:
        self.config = config or PolicyConfig()
        self.preempt = preempt or PreemptConfig()
        self.recovery = (recovery or RecoveryConfig()).sized(None)  # the Guard sizes it to a run
        self.consecutive_skips = 0
        self.consecutive_nonfinite = 0
        self.nonfinite_steps: deque[int] = deque(maxlen=self.recovery.nonfinite_rollback)
        self.rollback_steps: deque[int] = deque(maxlen=self.recovery.max_rollbacks + 1)
        self.lr_cuts = 0
        self.architecture_rollbacks = 0
        self.last_target: int | None = None
        self.region_repeats = 0
        self.suspects: deque[int] = deque(maxlen=HELD_STEPS)  # skipped, awaiting the follow-up
        self.quarantined: deque[int] = deque(maxlen=HELD_STEPS)  # confirmed by the follow-up
        self.unrolled: int | None = None  # the last incident with no rollback target: LR cut
        self._no_target: int | None = None  # this step's incident without a target
        self.restored_to: int | None = None  # the step the last rollback restored
        self.resynced = False  # the last decision gave diverged replicas a copy
        # "action/signal/layer" -> the step of the precursor warning it was taken on
        self.preempted: dict[str, int] = {}
        self.clipping_from: int | None = None  # the max_logit warning that started the clipping

    def decide(
        self,
        point: MetricPoint,
        events: list[Event],
        can_roll_back: bool | TargetCheck = False,
    ) -> Decision:
        """The action for this step. `can_roll_back` says whether a rollback target exists, for
        every incident (a bool) or for an incident whose first step is given (a callable)."""
        self._no_target = None
        has_target: TargetCheck = (
            can_roll_back if callable(can_roll_back) else (lambda _: bool(can_roll_back))
        )
        decision = self._choose(point, events, has_target)
        self.resynced = decision.resync_from is not None
        self._judge_suspects(decision, events)
        incident = self._no_target
        if (
            incident is not None
            and decision.action in ("step", "skip")
            and (self.unrolled is None or abs(incident - self.unrolled) > self._same_fault)
            and decision.lr_factor is None
        ):  # one LR cut per incident that has no rollback target (and per fault still going on)
            self.unrolled = incident
            decision.unrolled_incident = incident
            decision.lr_factor = self._next_lr_factor()
        if decision.action == "step":  # a skipped or undone step's warning is not acted on
            decision.preempt = self._preempt(point, events)
        return decision

    def gate_blockers(self, detectors: Sequence[Detector]) -> list[str]:
        """The `skip_on` kinds a live detector raises with no bound the device gate could skip
        on before the host reads the step (where any, the guard keeps the synchronous path)."""
        live = {d.name: d for d in detectors if not d.needs_ranks}  # the gate is one process's
        blockers = []
        for kind in self.config.skip_on:
            raiser = live.get(RAISED_BY.get(kind, kind))
            if kind not in GATED_ALWAYS and raiser is not None and raiser.gate_figure is None:
                blockers.append(kind)
        return blockers

    def gate_bounds(self, detectors: Sequence[Detector]) -> dict[str, float]:
        """Per gated figure ("loss", "grad_norm"): the value over which the next step is skipped
        for a `skip_on` event, from the live detectors' state; inf once `max_consecutive_skips`
        are spent (the next such step is taken)."""
        bounds = {"loss": math.inf, "grad_norm": math.inf}
        if self.consecutive_skips >= self.config.max_consecutive_skips:
            return bounds
        for detector in detectors:
            figure = detector.gate_figure
            if figure is not None and detector.name in self.config.skip_on:
                bounds[figure] = min(bounds[figure], detector.gate_bound())
        return bounds

    def on_evaluation(self, point: EvalPoint, events: list[Event]) -> list[Event]:
        """What an evaluation's events lead to: warnings, never an action. An evaluation never
        skips, rolls back or halts (its step was taken long ago): copies of the events, none
        over `warning`, whatever the evaluation (`point`)."""
        return [
            dataclasses.replace(
                e, action=None, severity="warning" if e.severity == "critical" else e.severity
            )
            for e in events
        ]

    def _preempt(self, point: MetricPoint, events: list[Event]) -> list[PreemptCall]:
        """The preemptive actions `precursors.preempt.actions` allows on this step's precursor
        warnings (not on `info`: a collapse the run learns through foretells nothing): each at
        most once a warning episode (a signal of a layer) and layer, one LR cut a step at most,
        and an LR cut only on the signals of divergence (`LR_CUT_SIGNALS`)."""
        chosen = self.preempt.actions
        if not chosen:
            return []
        calls: list[PreemptCall] = []
        for e in events:
            if e.kind != EventKind.PRECURSOR or e.severity != "warning":
                continue
            signal, layer = str(e.metrics.get("signal")), str(e.metrics.get("layer"))
            value = float(e.metrics.get("value", math.nan))
            if (
                "lr_cut" in chosen
                and signal in LR_CUT_SIGNALS
                and not any(c.action == "lr_cut" for c in calls)
            ):
                calls += self._once(
                    PreemptCall("lr_cut", layer, signal, value, self.preempt.lr_factor, e.step)
                )
            if "qk_rescale" in chosen and signal == "max_logit":
                calls += self._qk_rescales(point, layer, value, e.step)
            if "z_loss" in chosen and signal == "log_z":
                calls += self._once(PreemptCall("z_loss", layer, signal, value, None, e.step))
        if any(c.action == "qk_rescale" for c in calls) and self.clipping_from is None:
            self.clipping_from = point.step
        elif "qk_rescale" in chosen and self.clipping_from is not None:
            calls += self._keep_clipped(point, calls)
        return calls

    def _keep_clipped(self, point: MetricPoint, calls: list[PreemptCall]) -> list[PreemptCall]:
        """Max-logit clipping after the first max_logit warning: every sampled layer whose max
        logit is past `qk_threshold` again is brought back to `qk_target`, warned or not."""
        assert self.clipping_from is not None
        cfg = self.preempt
        done = {c.layer for c in calls if c.action == "qk_rescale"}
        logits = (point.precursors or {}).get("max_logit") or {}
        return [
            PreemptCall("qk_rescale", name, "max_logit", v, cfg.qk_target / v, self.clipping_from)
            for name, v in sorted(logits.items())
            if name not in done and math.isfinite(v) and v > cfg.qk_threshold
        ]

    def _qk_rescales(
        self, point: MetricPoint, layer: str, value: float, step: int
    ) -> list[PreemptCall]:
        """QK rescales on a max-logit warning: the warned layer and every layer past
        `qk_threshold`, each brought down to `qk_target`."""
        cfg = self.preempt
        logits = dict((point.precursors or {}).get("max_logit") or {})
        over = {name: v for name, v in logits.items() if v > cfg.qk_threshold}
        over.setdefault(layer, value)
        calls: list[PreemptCall] = []
        for name, v in sorted(over.items()):
            if math.isfinite(v) and v > cfg.qk_target:
                call = PreemptCall("qk_rescale", name, "max_logit", v, cfg.qk_target / v, step)
                calls += self._once(call)
        return calls

    def _once(self, call: PreemptCall) -> list[PreemptCall]:
        """`[call]` unless this action was taken for this layer in this warning's episode or a
        later one (a replayed or resumed step)."""
        key = f"{call.action}/{call.signal}/{call.layer}"
        if self.preempted.get(key, -1) >= call.warning_step:
            return []
        self.preempted[key] = call.warning_step
        return [call]

    @property
    def _same_fault(self) -> int:
        """Incidents this many steps apart or closer are one fault still going on."""
        return self.recovery.snapshot_every or 1

    def forget_after(self, step: int) -> None:
        """A rollback to `step` undid the later steps: their suspects get no follow-up."""
        self.restored_to = step
        kept = [s for s in self.suspects if s < step]
        self.suspects.clear()
        self.suspects.extend(kept)

    def _judge_suspects(self, decision: Decision, events: list[Event]) -> None:
        """A suspect batch whose spike's follow-up confirms data toxicity is quarantined; one
        whose spike is re-typed (now or after a confirmation) is released."""
        for e in events:
            if e.kind != EventKind.SPIKE_CLASSIFIED:
                continue
            spike = int(e.metrics.get("spike_step", e.step))
            if (
                e.type == "data_toxicity"
                and not e.metrics.get("lasting")
                and spike in self.suspects
            ):
                self.suspects.remove(spike)
                self.quarantined.append(spike)
                decision.quarantine_step = spike
            elif (e.type != "data_toxicity" or e.metrics.get("lasting")) and (
                spike in self.suspects or spike in self.quarantined
            ):
                for held in (self.suspects, self.quarantined):
                    if spike in held:
                        held.remove(spike)
                decision.release_step = spike

    def _choose(self, point: MetricPoint, events: list[Event], has_target: TargetCheck) -> Decision:
        cfg, rec = self.config, self.recovery
        kinds = {e.kind for e in events}
        step = point.step
        nonfinite = (
            EventKind.NONFINITE in kinds
            or not point.loss_finite
            or (not point.grads_finite and not point.overflow)
        )
        halting = [e for e in events if e.kind in cfg.halt_on]
        if halting:  # the user's halt list wins over every other rule
            return self._halt(point, events, f"{halting[0].kind}: {halting[0].message}")
        diverged = [e for e in events if e.kind == EventKind.REPLICA_DIVERGENCE]
        if diverged:  # every later rule would act on replicas that no longer agree
            return self._replicas(point, events, diverged[0])
        if nonfinite:
            self.consecutive_nonfinite += 1
            self.nonfinite_steps.append(step)
            recent = [s for s in self.nonfinite_steps if step - s < rec.nonfinite_window]
            if rec.enabled and len(recent) >= rec.nonfinite_rollback and has_target(recent[0]):
                self.nonfinite_steps.clear()
                rollback = self._rollback(
                    point,
                    events,
                    recent[0],
                    f"{len(recent)} non-finite steps within {rec.nonfinite_window}",
                    explosion=True,
                )
                if rollback is not None:
                    return rollback
            if self.consecutive_nonfinite >= cfg.max_consecutive_nonfinite:
                return self._halt(
                    point,
                    events,
                    f"non-finite loss or gradients on {self.consecutive_nonfinite} steps in a "
                    "row: the weights or the data give NaN/Inf every step; resume from a "
                    "checkpoint before the incident with a lower LR, or trace the first module "
                    "that made it",
                )
            return self._decide(point, events, "skip", "non-finite loss or gradients")
        self.consecutive_nonfinite = 0
        if rec.enabled:  # before the overflow skip: weights that overflow every step need it
            decision = self._recovery(point, events, has_target)
            if decision is not None:
                return decision
        if point.overflow:
            return self._decide(point, events, "skip", "fp16 overflow: the scaler skipped it")
        if rec.enabled and EventKind.OSCILLATION in kinds:
            decision = self._decide(point, events, "step", "oscillation: LR lowered")
            decision.lr_factor = self._next_lr_factor()
            return decision
        skipping = [e for e in events if e.kind in cfg.skip_on]
        if skipping:
            if self.consecutive_skips < cfg.max_consecutive_skips:
                self.consecutive_skips += 1
                reasons = ", ".join(sorted({e.kind for e in skipping}))
                decision = self._decide(point, events, "skip", f"skipped for {reasons}")
                decision.suspect = cfg.quarantine and any(
                    e.kind == EventKind.LOSS_SPIKE
                    and e.type == "data_toxicity"
                    and clears_noise(e)
                    and e.metrics.get("since_step", e.step) == e.step  # a one-off
                    for e in skipping
                )
                if decision.suspect:  # quarantined only when the spike's follow-up confirms
                    self.suspects.append(step)
                return decision
            return self._decide(
                point,
                events,
                "step",
                f"{self.consecutive_skips} skips in a row already: stepping, since skipping "
                "more batches does not repair the model",
            )
        self.consecutive_skips = 0
        return self._decide(point, events, "step", "")

    def _replicas(self, point: MetricPoint, events: list[Event], event: Event) -> Decision:
        """Diverged replicas: skip the step (its gradients came in part from them) and give the
        diverged ranks a copy of the `source` replica, which agrees with the majority; with no
        such replica, or with recovery off, halt with the diagnosis."""
        source = event.metrics.get("source")
        agreed = event.metrics.get("last_agreed_step")
        if self.resynced:  # checked right after a copy: the copy did not hold
            return self._halt(
                point,
                events,
                f"{event.message}; the replicas differ again right after the last step gave the "
                "diverged ranks an agreeing copy, so copying does not repair them: look for a "
                "faulty device or a misconfigured parallelism",
            )
        if source is None or not self.recovery.enabled:
            why = (
                "recovery is off (recovery.enabled), so no replica is copied over the others"
                if source is not None
                else "no replica agrees with a majority of the others in every layer group, so "
                "none can be trusted to copy from: resume every rank from a checkpoint taken "
                + (f"at or before step {agreed}" if agreed is not None else "before it")
                + " (Guard.resume takes the newest: move newer step-N folders out of "
                "run_dir/checkpoints first; with none that old, restart from scratch), and look "
                "for the rank's faulty device, or the misconfigured parallelism"
            )
            return self._halt(point, events, f"{event.message}; {why}")
        ranks = [int(r) for r in event.metrics.get("ranks", [])]
        shown = ", ".join(map(str, ranks))
        decision = self._decide(
            point, events, "skip", f"replica divergence: rank {shown} given rank {source}'s copy"
        )
        decision.resync_from = int(source)
        decision.resync_ranks = ranks
        decision.agreed_step = None if agreed is None else int(agreed)
        return decision

    # -- recovery ---------------------------------------------------------------------------------
    def _recovery(
        self, point: MetricPoint, events: list[Event], has_target: TargetCheck
    ) -> Decision | None:
        """A rollback for a gradient explosion (typed at onset or on follow-up), an
        architecture-type spike or a divergence; None when no event calls for one, or when no
        snapshot lies before the incident (then `_no_target` names it, for an LR cut)."""
        for e in events:
            decision: Decision | None = None
            if e.kind == EventKind.LOSS_SPIKE and e.type == "gradient_explosion":
                start = int(e.metrics.get("since_step", e.step))  # a lasting jump's first step
                decision = self._rollback(
                    point, events, start, "gradient-explosion spike", True, has_target
                )
            elif e.kind == EventKind.SPIKE_CLASSIFIED and e.type == "gradient_explosion":
                spike = int(e.metrics.get("spike_step", e.step))
                sudden = e.metrics.get("previous_type") == "data_toxicity"  # no build-up
                margin = self.recovery.sudden_margin if sudden else None
                if sudden and spike == self.restored_to:  # no update since the restored state
                    margin = 0
                decision = self._rollback(
                    point,
                    events,
                    spike,
                    "gradient explosion confirmed",
                    True,
                    has_target,
                    margin,
                    sudden=sudden,
                )
            elif e.kind == EventKind.DIVERGENCE or (
                e.kind == EventKind.SPIKE_CLASSIFIED
                and (e.type == "architecture" or e.metrics.get("lasting"))
            ):
                start = e.step - (
                    int(e.metrics.get("window", 0)) if e.kind == EventKind.DIVERGENCE else 0
                )
                if e.kind == EventKind.SPIKE_CLASSIFIED:
                    start = int(e.metrics.get("spike_step", e.step))
                if not has_target(start):
                    self._no_target = start
                    continue
                self.architecture_rollbacks += 1
                if self.architecture_rollbacks > self.recovery.architecture_rollbacks:
                    return self._halt(
                        point,
                        events,
                        f"{e.kind} survived {self.recovery.architecture_rollbacks} rollbacks: "
                        f"{e.message}; "
                        + (
                            "the bad data goes on past the batches skipped: check the data "
                            "source (a corrupt or degrading shard)"
                            if e.metrics.get("lasting")
                            else "this looks like an architecture or initialisation fault "
                            "(normalisation, residual scaling), not bad data or a bad step"
                        ),
                    )
                decision = self._rollback(point, events, start, e.kind, True, has_target)
            if decision is not None:
                return decision
        return None

    def _rollback(
        self,
        point: MetricPoint,
        events: list[Event],
        incident: int,
        why: str,
        explosion: bool,
        has_target: TargetCheck = lambda _: True,
        margin: int | None = None,
        sudden: bool = False,
    ) -> Decision | None:
        """Roll back to `margin` (default `rollback_margin`) steps before `incident`, or to the
        newest snapshot at or before it; None when no snapshot lies before it. A `sudden`
        incident (a jump with no build-up) with no rollback before it in the window keeps the LR
        and the data: one bad step or write is undone, and only a repeat says the LR is too high
        or the data bad."""
        rec = self.recovery
        step = point.step
        if not has_target(incident):
            self._no_target = incident
            return None
        recent = [s for s in self.rollback_steps if step - s < rec.rollback_window]
        if len(recent) >= rec.max_rollbacks:
            return self._halt(
                point,
                events,
                f"{len(recent) + 1} rollbacks within {rec.rollback_window} steps and the "
                f"incidents continue ({why}); nothing the guard can do helps: check the data "
                "around these steps, the LR schedule and the model's numerics",
            )
        # a rollback within `snapshot_every` steps of the previous one: the same fault still
        # going on when it rolled back (a burst of bad steps), not a recurrence at a restored LR
        continuing = bool(recent) and step - recent[-1] <= self._same_fault
        self.rollback_steps.append(step)
        target = incident - (rec.rollback_margin if margin is None else margin)
        if self.last_target is not None and abs(target - self.last_target) <= (
            SAME_REGION * (rec.snapshot_every or 1)
        ):
            self.region_repeats += 1
        else:
            self.region_repeats = 0
        self.last_target = target
        base = rec.skip_after_explosion if explosion else rec.skip_after_toxicity
        decision = self._decide(point, events, "rollback", why)
        decision.rollback_to = target
        decision.incident_step = incident
        decision.skip_widening = 2 ** min(self.region_repeats, MAX_WIDENING)
        decision.skip_after = base * decision.skip_widening
        if sudden and not recent:
            # one bad step or write: nothing yet says the LR is too high or the data bad, so the
            # LR is kept and the batches are fed again; toxic data spikes again on the restored
            # weights (skipped then), and a repeat here cuts the LR and skips a region
            decision.lr_factor = None
            decision.replay_incident = True
        else:
            decision.lr_factor = self._next_lr_factor()  # compounding: a repeat cuts further
        if not recent or continuing:  # the cut LR climbs back; a later repeat keeps its cut
            decision.rewarm_steps = rec.rewarm_steps or 0
        self.consecutive_skips = 0
        self.consecutive_nonfinite = 0
        return decision

    def _next_lr_factor(self) -> float:
        """The original schedule: max(0.1, 0.5 ** (1 + 0.1 * cuts so far)), compounding."""
        factor = float(max(0.1, 0.5 ** (1 + 0.1 * self.lr_cuts)))
        self.lr_cuts += 1
        return factor

    def _halt(self, point: MetricPoint, events: list[Event], reason: str) -> Decision:
        return self._decide(point, events, "halt", reason)

    @staticmethod
    def _decide(point: MetricPoint, events: list[Event], action: Action, reason: str) -> Decision:
        """The decision, with copies of `events` that carry its action (the events stay as the
        detectors raised them)."""
        acted = [dataclasses.replace(event, action=action) for event in events]
        return Decision(step=point.step, action=action, events=acted, reason=reason)

    def state_dict(self) -> dict[str, Any]:
        return {
            "consecutive_skips": self.consecutive_skips,
            "consecutive_nonfinite": self.consecutive_nonfinite,
            "nonfinite_steps": list(self.nonfinite_steps),
            "rollback_steps": list(self.rollback_steps),
            "lr_cuts": self.lr_cuts,
            "architecture_rollbacks": self.architecture_rollbacks,
            "last_target": self.last_target,
            "region_repeats": self.region_repeats,
            "suspects": list(self.suspects),
            "quarantined": list(self.quarantined),
            "unrolled": self.unrolled,
            "restored_to": self.restored_to,
            "resynced": self.resynced,
            "preempted": dict(self.preempted),
            "clipping_from": self.clipping_from,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_skips = int(state["consecutive_skips"])
        self.consecutive_nonfinite = int(state["consecutive_nonfinite"])
        self.nonfinite_steps.clear()
        self.nonfinite_steps.extend(state.get("nonfinite_steps", []))
        self.rollback_steps.clear()
        self.rollback_steps.extend(state.get("rollback_steps", []))
        self.lr_cuts = int(state.get("lr_cuts", 0))
        self.architecture_rollbacks = int(state.get("architecture_rollbacks", 0))
        self.last_target = state.get("last_target")
        self.region_repeats = int(state.get("region_repeats", 0))
        self.suspects.clear()
        self.suspects.extend(int(s) for s in state.get("suspects", []))
        self.quarantined.clear()
        self.quarantined.extend(int(s) for s in state.get("quarantined", []))
        unrolled = state.get("unrolled")
        self.unrolled = None if unrolled is None else int(unrolled)
        restored = state.get("restored_to")
        self.restored_to = None if restored is None else int(restored)
        self.resynced = bool(state.get("resynced", False))
        self.preempted = {str(k): int(v) for k, v in state.get("preempted", {}).items()}
        clipping = state.get("clipping_from")  # earlier: no clipping after the warning
        self.clipping_from = None if clipping is None else int(clipping)
