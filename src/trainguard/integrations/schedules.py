"""`ScheduleHistory`: a framework's LR schedulers as they stood before each guard step a
rollback can reach, so a rollback puts the schedule back with the weights."""

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

    def keep(self, step: int, oldest: int) -> None:
        """Keep the states for guard step `step` (taken before the framework steps them into
        it), and forget those before `oldest` or after `step` (undone by a rollback)."""
        if not self.schedulers:
            return
        self._states[step] = [copy.deepcopy(s.state_dict()) for s in self.schedulers]
        for kept in [k for k in self._states if k < oldest or k > step]:
            del self._states[kept]

    def keep_for(self, guard: Guard) -> None:
        """Keep the states for the guard's next step, back to its oldest snapshot."""
        step = guard.global_step
        self.keep(step, min((s.step for s in guard.ring.snapshots), default=step))

    def restore(self, step: int) -> bool:
        """Put the schedulers back to where they stood before guard step `step`; False when
        no state for it was kept."""
        saved = self._states.get(step)
        if saved is None:
            return False
        for scheduler, state in zip(self.schedulers, saved, strict=True):
            scheduler.load_state_dict(copy.deepcopy(state))
        return True
