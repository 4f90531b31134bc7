"""`Action`, the base of every action, and the `ActionContext` a loop hands them: here so
that actions in other folders need not import the loops (users write ``actions.Action``)."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from jaxloop import types
from jaxloop.hooks import triggers

State = types.TrainState
Output = types.Output


@dataclasses.dataclass(frozen=True)
class ActionContext:
    """What a loop-level action is told at a loop boundary, as the keyword ``context=``
    (beside ``loop``, ``loop_count`` and ``first_step``): host values, never a wait for the
    device. `step` is the state's step now (at a train loop's end, `first_step` plus the
    steps run; None for a state without one); `checkpoint_meta` gives the JSON values the
    loop's owner (an `OuterLoop`) saves with each checkpoint (None: nothing). Example::

        class LogPosition(actions.Action):
            def __call__(self, state, outputs, context=None, **kwargs):
                print(context.loop_count, context.step, context.data_position)
    """

    loop: Any
    loop_count: int
    first_step: int | None
    step: int | None
    read_position: Callable[[], Any] = dataclasses.field(default=lambda: None, repr=False)
    checkpoint_meta: Callable[[], dict[str, Any]] | None = None

    @functools.cached_property
    def data_position(self) -> Any:
        """The checkpointable position of the loop's data after the batches it trained on
        (a grain iterator's state), or None; read when first asked, as it is not free."""
        return self.read_position()


class Action:
    """Base class for actions: fires every `interval` loops, or where its
    `triggers.Trigger` says (global train steps or seconds). Example::

        SummaryAction(writer).with_trigger(triggers.Trigger(at_steps=(1, 10), every_secs=60))
    """

    def __init__(self, interval: int = 1, trigger: triggers.Trigger | None = None):
        if not isinstance(interval, int) or interval <= 0:
            raise ValueError(f"`interval` must be a positive integer, got {interval!r}")
        self._interval = interval
        self.with_trigger(trigger)

    @property
    def interval(self) -> int:
        return self._interval

    @property
    def trigger(self) -> triggers.Trigger | None:
        """What decides when this action fires (None: every `interval`)."""
        return getattr(self, "_trigger", None)

    def with_trigger(self, trigger: triggers.Trigger | None) -> Action:
        """Has `trigger` decide when this action fires; returns the action."""
        if trigger is not None and not isinstance(trigger, triggers.Trigger):
            raise TypeError(f"`trigger` must be a triggers.Trigger, got {trigger!r}")
        self._trigger = trigger
        return self

    def __call__(self, state: State, outputs: Output | None, **kwargs: Any) -> Any:
        raise NotImplementedError("Action subclasses implement __call__(state, outputs, **kw)")
