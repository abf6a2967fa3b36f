"""Actions of the user's own: `GuardAction`, answered after the guard's own actions, and the
registry (`register_action`) every Guard builds them from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from trainguard.actions.data import GuardedBatches
from trainguard.config import GuardConfig
from trainguard.events import Decision, Event, TrainguardError


@dataclass
class ActionTarget:
    """What an action may touch at a step: the guard's model, optimizer, scheduler and data."""

    step: int
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    batches: GuardedBatches | None


class GuardAction:
    """An action that answers the policy's decision: called after the guard's own actions when
    the decision's action ("step", "skip", "rollback", "halt") or one of its events' kinds is in
    `on`; returns the events that say what it did. Only the policy decides; an action acts."""

    name: ClassVar[str] = "action"
    on: ClassVar[frozenset[str]] = frozenset()

    def answers(self, decision: Decision) -> bool:
        """Whether this action is called for `decision`."""
        return decision.action in self.on or any(e.kind in self.on for e in decision.events)

    def __call__(self, decision: Decision, target: ActionTarget) -> list[Event]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Plain data to checkpoint with the guard; none by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `state_dict` gave."""


ActionFactory = Callable[[GuardConfig], GuardAction]
_REGISTRY: list[tuple[Any, ActionFactory]] = []  # (what was registered, its factory)


def register_action(factory: type[GuardAction] | ActionFactory) -> Any:
    """Register an action for every Guard built after this: a `GuardAction` subclass (built
    with no arguments) or a function of the `GuardConfig`; usable as a class decorator."""
    if isinstance(factory, type):
        if not issubclass(factory, GuardAction):
            raise TrainguardError(
                f"{factory.__name__} is not a trainguard.GuardAction: subclass it to register it"
            )
        cls = factory
        _REGISTRY.append((factory, lambda _config: cls()))
    else:
        _REGISTRY.append((factory, factory))
    return factory


def unregister_action(factory: type[GuardAction] | ActionFactory) -> None:
    """Remove what `register_action` added (the same class or factory); nothing if absent."""
    for i, (registered, _) in enumerate(_REGISTRY):
        if registered is factory:
            del _REGISTRY[i]
            return


def build_actions(config: GuardConfig) -> list[GuardAction]:
    """One instance of every registered action, in the order they were registered."""
    actions = [factory(config) for _, factory in _REGISTRY]
    for action in actions:
        if not isinstance(action, GuardAction):
            raise TrainguardError(
                f"a registered action factory returned {type(action).__name__}, not a "
                "trainguard.GuardAction"
            )
    return actions


def run_actions(
    actions: Sequence[GuardAction], decision: Decision, target: ActionTarget
) -> list[Event]:
    """Call each action that answers `decision`; the events they return, in order."""
    events: list[Event] = []
    for action in actions:
        if action.answers(decision):
            events.extend(action(decision, target))
    return events
