"""When a Step's own actions (``Step(begin_actions=..., end_actions=...)``) run, and where
an execution of fused steps must end so that the host sees every step one fires on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxloop.engine import ownership


def action_fires(action: Any, per_loop_step_number: int, begin: bool) -> bool:
    """Whether a step-level action runs at this step (before it when `begin`, else after):
    where its ``trigger`` (`triggers.Trigger`) or its ``fires_at(per_loop_step_number,
    begin)`` method says, else every ``interval`` steps."""
    if (trigger := getattr(action, "trigger", None)) is not None:
        return trigger.fires_within_loop(per_loop_step_number)
    if (fires_at := getattr(action, "fires_at", None)) is not None:
        return bool(fires_at(per_loop_step_number, begin))
    return per_loop_step_number % action.interval == 0


def fire(actions: Sequence[Any], begin: bool, step_number: int, state: Any,
         outputs: Any = None, batch: Any = None) -> None:
    """Calls the actions firing at this step: begin ones with the batch, end ones with outputs."""
    for action in actions:
        if action_fires(action, step_number, begin):
            # An action may keep the state: the next step then consumes nothing.
            ownership.call(action, state, None if begin else outputs,
                           per_loop_step_number=step_number, **({"batch": batch} if begin else {}))


def execution_length(begin_actions: Sequence[Any], end_actions: Sequence[Any],
                     first: int, size: int) -> int:
    """How many steps from `first` (at most `size`) one execution runs: it stops before a
    later step a begin action fires on, and after one an end action fires on."""
    if begin_actions or end_actions:
        for n in range(first, first + size):
            if n > first and any(action_fires(a, n, True) for a in begin_actions):
                return n - first
            if any(action_fires(a, n, False) for a in end_actions):
                return n - first + 1
    return size


def check_none_inside(begin_actions: Sequence[Any], end_actions: Sequence[Any],
                      first: int, last: int) -> None:
    """Raises ValueError if an action fires inside the execution of steps `first`..`last`."""
    for actions, begin, steps in ((begin_actions, True, range(first + 1, last + 1)),
                                  (end_actions, False, range(first, last))):
        for action in actions:
            inner = next((n for n in steps if action_fires(action, n, begin)), None)
            if inner is not None:
                raise ValueError(
                    f"Step action {action!r} fires on step {inner}, inside an execution of "
                    f"steps {first}..{last}; run the steps around it separately (loops with "
                    "steps_per_execution do this)")
