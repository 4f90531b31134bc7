"""ActionLoop: a StatLoop that runs actions at the beginning and end of every loop.

An action with interval k fires on loops k, 2k, 3k, ... (`loop_count`, saved with
checkpoints); one holding a `triggers.Trigger` fires where the trigger says. Example::

    loop = ActionLoop(step, end_actions=[SummaryAction(writer, interval=2)])
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxloop import actions as actions_lib
from jaxloop import async_action_context, stat_loop, stop_handler, types
from jaxloop import step as step_lib
from jaxloop.engine import host_count, ownership
from jaxloop.hooks.action import ActionContext

Action = actions_lib.Action
Output = types.Output
State = types.TrainState
Step = step_lib.Step
Phase = Callable[[State, Output | None, ActionContext], None]


class ActionLoop(stat_loop.StatLoop):
    """Runs `begin_actions` before and `end_actions` after the loops their interval picks,
    with the keywords ``loop=self``, ``loop_count``, ``first_step`` and ``context`` (an
    `ActionContext`). The lists are the caller's: the loop never changes them."""

    def __init__(self, step: Any, begin_actions: Sequence[actions_lib.Action] | None = None,
                 end_actions: Sequence[actions_lib.Action] | None = None, **kwargs: Any):
        super().__init__(step, **kwargs)
        self._begin_actions = list(begin_actions or [])
        self._end_actions = list(end_actions or [])
        for action in self._begin_actions + self._end_actions:
            interval = getattr(action, "interval", None)
            if not isinstance(interval, int) or interval <= 0:
                raise ValueError(
                    f"Action {action!r} must have a positive integer `interval`, got {interval!r}")
        self._loop_count = 0
        self._continues = False  # the next loop finishes one cut short
        self._first_step: int | None = None
        self._dataset: Any = None
        self._owner: tuple[tuple[Phase, ...], Callable[[], dict[str, Any]] | None] = ((), None)

    @property
    def begin_actions(self) -> list[actions_lib.Action]:
        return self._begin_actions

    @property
    def end_actions(self) -> list[actions_lib.Action]:
        return self._end_actions

    @property
    def loop_count(self) -> int:
        """How many loops have begun (1 during the first)."""
        return self._loop_count

    @loop_count.setter
    def loop_count(self, value: int) -> None:
        self.resume_count(value)

    def resume_count(self, loop_count: int, cut_short: bool = False) -> None:
        """Takes back a count (a checkpoint's): the next loop is ``loop_count + 1``, or, if
        loop `loop_count` was `cut_short` (a preemption, a checkpoint inside it), the next
        call finishes it under that count, so interval actions keep their rhythm."""
        if loop_count < 0:
            raise ValueError(f"loop_count must be >= 0, got {loop_count}")
        self._loop_count, self._continues = loop_count, cut_short

    @property
    def first_step(self) -> int | None:
        """The state's step when the current (or last) loop began."""
        return self._first_step

    @property
    def dataset(self) -> Any:
        """The iterator the current (or last) loop reads, e.g. to save its position."""
        return self._dataset

    @contextlib.contextmanager
    def phases(self, at_end: Sequence[Phase] = (),
               checkpoint_meta: Callable[[], dict[str, Any]] | None = None) -> Iterator[None]:
        """For the loop's owner (an `OuterLoop`): while open, each loop's end runs the
        phases `at_end`, ``phase(state, outputs, context)``, before the end actions (so a
        checkpoint they save holds what the phases did), and `ActionContext.checkpoint_meta`
        is `checkpoint_meta`. The action lists are left as they are. Example::

            with train_loop.phases(at_end=[record], checkpoint_meta=lambda: {'run': 'a'}):
                state, outputs = train_loop(state, batches, num_steps=100)
        """
        previous, self._owner = self._owner, (tuple(at_end), checkpoint_meta)
        try:
            yield
        finally:
            self._owner = previous

    def action_context(self, begin: bool = False) -> ActionContext:
        """What an action is told at the loop's beginning, or at (or after) its end."""
        first = last = self._first_step
        if not begin and first is not None and getattr(self._step, "train", False):
            last = first + self.num_steps_run
        return ActionContext(self, self._loop_count, first, last,
                             functools.partial(self.data_position, self._dataset),
                             self._owner[1])

    def _fire(self, actions: Sequence[Any], state: State, outputs: Output | None,
              phases: Sequence[Phase] = ()) -> None:
        # A loop boundary: errors of background work (async writes, checkpoint saves) surface.
        async_action_context.get_async_action_context().check_exceptions_and_raise(wait=False)
        context = self.action_context(begin=outputs is None)
        for phase in phases:
            phase(state, outputs, context)
        # A trigger is asked about the steps the loop ran, else the step it stands at.
        first, last = context.first_step or 0, context.step or 0
        steps = (first + 1, last) if last > first else (last,)
        for action in actions:
            trigger = getattr(action, "trigger", None)
            if (self._loop_count % action.interval == 0 if trigger is None
                    else trigger.fires(*steps)):
                try:
                    # An action may keep the state: the next step then consumes nothing.
                    ownership.call(action, state, outputs, loop=self, context=context,
                                   loop_count=self._loop_count, first_step=self._first_step)
                except stop_handler.StopTrainingError as e:
                    e.state = state  # live here; the one passed in may have been donated
                    raise

    def begin(self, state: State, dataset: Iterator[Any]) -> tuple[State, Iterator[Any]]:
        self._loop_count += not self._continues
        self._continues = False
        self._first_step = host_count.host_step(state) if hasattr(state, "step") else None
        # A train step's triggered actions count global steps from where this loop starts.
        step = self._step
        offset = (self._first_step or 0) if getattr(step, "train", False) else 0
        for action in [*getattr(step, "begin_actions", []), *getattr(step, "end_actions", [])]:
            if getattr(action, "trigger", None) is not None:
                action.trigger.start_loop(offset)
        state, dataset = super().begin(state, dataset)
        self._dataset = dataset
        self._fire(self._begin_actions, state, None)
        return state, dataset

    def end(self, state: State, outputs: Output | None) -> tuple[State, Output | None]:
        state, outputs = super().end(state, outputs)
        self._fire(self._end_actions, state, outputs, self._owner[0])
        return state, outputs
