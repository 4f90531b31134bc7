"""`Action`, the base of every action (host-side work a loop runs at its boundaries).

Users reach it as ``jaxloop.actions.Action``; it lives here so that the actions in other
modules (checkpointing, metrics, diagnostics) need not import the loops.
"""
from __future__ import annotations

from typing import Any

from jaxloop import types
from jaxloop.engine import triggers

State = types.TrainState
Output = types.Output


class Action:
    """Base class for actions: fires every `interval` loops, or where its
    `triggers.Trigger` says (global train steps or seconds).

    Example::

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
