"""Triggers: when an action fires, in global train steps (``state.step``) or in seconds
(docs/triggers_and_debugging.md). The time condition is one host exchange per loop. Example::

    trigger = triggers.Trigger(at_steps=(1000, 5000), every_n_steps=10_000, every_secs=600)
    train_loop = TrainLoop(step, end_actions=[CheckpointAction(manager).with_trigger(trigger)])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from jaxloop.launch import agreement

__all__ = ["Trigger"]


def _positive_int(name: str, value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"Trigger `{name}` must be a positive integer, got {value!r}")
    return value


class Trigger:
    """When an action fires: where any condition holds (the table of
    docs/triggers_and_debugging.md; `every_secs` counts process 0's `clock`). Example::

        Trigger(every_n_steps=100).fires(100)        # True
        Trigger(at_steps=(3, 7)).fires(first=1, last=5)  # True: step 3 is in 1..5
    """

    def __init__(self, every_n_steps: int | None = None, at_steps: Iterable[int] = (),
                 first_n_steps: int | None = None, first_n_process_steps: int | None = None,
                 every_secs: float | None = None, clock: Callable[[], float] = time.monotonic):
        self._every_n = _positive_int("every_n_steps", every_n_steps)
        self._first_n = _positive_int("first_n_steps", first_n_steps)
        self._first_process_n = _positive_int("first_n_process_steps", first_n_process_steps)
        steps = tuple(at_steps)
        bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad:
            raise ValueError(f"Trigger `at_steps` must be non-negative integers, got {bad}")
        self._at = frozenset(steps)
        if every_secs is not None and (isinstance(every_secs, bool) or not isinstance(
                every_secs, int | float) or not every_secs > 0):
            raise ValueError(f"Trigger `every_secs` must be positive seconds, got {every_secs!r}")
        if not callable(clock):
            raise TypeError(f"Trigger `clock` must be a callable returning seconds, got {clock!r}")
        self._every_secs, self._clock, self._last_time = every_secs, clock, clock()
        if not self._at and (self._every_n, self._first_n, self._first_process_n,
                             every_secs) == (None,) * 4:
            raise ValueError("A Trigger needs a condition: every_n_steps, at_steps, "
                             "first_n_steps, first_n_process_steps or every_secs")
        self._process_start: int | None = None
        self._loop_time: tuple[int, bool] | None = None  # a Step's own: (step decided, due)
        self._step_offset = 0

    def __repr__(self) -> str:
        parts = {"every_n_steps": self._every_n, "at_steps": tuple(sorted(self._at)) or None,
                 "first_n_steps": self._first_n, "first_n_process_steps": self._first_process_n,
                 "every_secs": self._every_secs}
        return "Trigger(" + ", ".join(f"{k}={v!r}" for k, v in parts.items() if v) + ")"

    @property
    def every_secs(self) -> float | None:
        return self._every_secs

    def restart(self) -> None:
        """Counts `every_secs` from now (e.g. after a save made for another reason)."""
        self._last_time = self._clock()

    def _time_due(self, step: int, phase: str) -> bool:
        # One host exchange: every process takes process 0's answer.
        due = bool(agreement.agreed(lambda: self._clock() - self._last_time >= self._every_secs,
                                    phase=phase, step=step))
        if due:
            self.restart()
        return due

    def fires(self, first: int, last: int | None = None, phase: str = "time trigger") -> bool:
        """Whether any step of ``first .. last`` (default: `first` alone) matches, or the
        time condition is due (asked now; `phase` names that decision if the processes
        part). The first step ever asked about is where this process started (for
        ``first_n_process_steps``)."""
        last = first if last is None else last
        return self._steps_fire(first, last) or (
            self._every_secs is not None and self._time_due(last, phase))

    def _steps_fire(self, first: int, last: int) -> bool:
        """Whether a step of ``first .. last`` matches a step condition."""
        if self._process_start is None:
            self._process_start = first
        every, start, count = self._every_n, self._process_start, self._first_process_n
        if every is not None and last // every > (first - 1) // every:
            return True
        if self._first_n is not None and first <= self._first_n:
            return True
        if count is not None and (start <= first < start + count or first <= start <= last):
            return True
        return any(first <= s <= last for s in self._at)

    def start_loop(self, step_offset: int) -> None:
        """A loop starts: a Step's own actions number its steps from ``step_offset + 1``."""
        self._step_offset = step_offset
        self._loop_time = None

    def fires_within_loop(self, per_loop_step_number: int) -> bool:
        """Whether a Step's own action fires on this step of its loop (counted from 1), at
        the global step ``step_offset + per_loop_step_number``."""
        step = self._step_offset + per_loop_step_number
        if self._steps_fire(step, step):
            return True
        if self._every_secs is None:
            return False
        if self._loop_time is None:
            self._loop_time = (step, self._time_due(step, "time trigger"))
        return self._loop_time == (step, True)
