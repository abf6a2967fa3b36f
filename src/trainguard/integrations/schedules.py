"""`ScheduleHistory`: a framework's LR schedulers as they stood before each guard step a
rollback can reach, so a rollback puts the schedule back with the weights; `PerStepSchedule`:
schedulers that step at their own cadence, as the lint traces them."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.guard import Guard


class ScheduleHistory:
    """The schedulers' `state_dict`s kept per guard step, from the oldest snapshot the guard
    holds to now; the framework (not the guard) steps them."""

    def __init__(self, schedulers: list[Any]) -> None:
        self.schedulers = [s for s in schedulers if hasattr(s, "state_dict")]
        self._states: dict[int, list[dict[str, Any]]] = {}

    def keep(self, guard: Guard) -> None:
        """Keep the states for the guard's next step (taken before the framework steps them
        into it), and forget those before its oldest snapshot or after that step (undone by a
        rollback)."""
        if not self.schedulers:
            return
        step = guard.global_step
        oldest = min((s.step for s in guard.ring.snapshots), default=step)
        self._states[step] = [copy.deepcopy(s.state_dict()) for s in self.schedulers]
        for kept in [k for k in self._states if k < oldest or k > step]:
            del self._states[kept]

    def follow(self, guard: Guard, before: int) -> int:
        """After a guard step taken at step `before`: the steps a rollback undid (0 when it
        stepped or skipped), with the schedulers put back to the step it restored; the states
        for the next step kept."""
        lost = before + 1 - guard.global_step
        if lost:
            self.restore(guard.global_step)
        self.keep(guard)
        return lost

    def restore(self, step: int) -> bool:
        """Put the schedulers back to where they stood before guard step `step`; False when
        no state for it was kept."""
        saved = self._states.get(step)
        if saved is None:
            return False
        for scheduler, state in zip(self.schedulers, saved, strict=True):
            scheduler.load_state_dict(copy.deepcopy(state))
        return True


class PerStepSchedule:
    """LR schedulers that each step every `every` optimizer steps (Lightning's interval and
    frequency) behind one `step()` per optimizer step, with a `state_dict`: the run's schedule
    as the lint traces it."""

    def __init__(self, schedulers: list[tuple[Any, int]]) -> None:
        self.schedulers = schedulers
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        for scheduler, every in self.schedulers:
            if self.steps % every == 0:
                scheduler.step()

    @property
    def last_epoch(self) -> int:
        return self.steps

    @property
    def total_steps(self) -> int | None:
        """The optimizer steps after which a scheduler with its own `total_steps` (OneCycleLR,
        which raises past it) would be stepped past it; None without one."""
        ends = [
            self.steps + (scheduler.total_steps - scheduler.last_epoch) * every
            for scheduler, every in self.schedulers
            if isinstance(getattr(scheduler, "total_steps", None), int)
            and isinstance(getattr(scheduler, "last_epoch", None), int)
        ]
        return min(ends, default=None)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "schedulers": [s.state_dict() for s, _ in self.schedulers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        for (scheduler, _), saved in zip(self.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)
