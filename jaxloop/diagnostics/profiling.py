"""Profiling: `ProfileAction`, a Step's begin and end action, captures a `jax.profiler` trace
of a range of steps (from 1 within their loop) into `logdir`, waiting for the device at both
ends only, so the trace holds exactly those steps' work::

    profile = profiling.ProfileAction(workdir / 'profile', start_step=10, num_steps=5)
    train_step = MyStep(key, model, optimizer, train=True,
                        begin_actions=[profile], end_actions=[profile])
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

from jaxloop import types
from jaxloop.hooks.action import Action

log = logging.getLogger(__name__)


class ProfileAction(Action):
    """Traces steps ``start_step .. start_step + num_steps - 1`` of a loop, once (a loop
    ending inside the range: stopped before the next loop's first step, or at `close`)."""

    def __init__(self, logdir: str | os.PathLike[str], start_step: int = 2, num_steps: int = 5):
        super().__init__(interval=1)
        for name, value in (("start_step", start_step), ("num_steps", num_steps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.logdir = os.fspath(logdir)
        self._start = start_step
        self._stop = start_step + num_steps - 1
        self._tracing = False
        self.done = False  # whether the trace has been captured

    def fires_at(self, per_loop_step_number: int, begin: bool) -> bool:
        """Before `start_step` and after the last traced step (while tracing, also before a
        new loop's early steps: a trace the previous loop left running stops)."""
        if self.done:
            return False
        if begin:
            return per_loop_step_number == self._start or (
                self._tracing and per_loop_step_number < self._start
            )
        return per_loop_step_number == self._stop

    def __call__(self, state: types.TrainState, outputs: types.Output | None,
                 **kwargs: Any) -> None:
        # A Step gives begin actions the step's batch and end actions its outputs.
        begin = "batch" in kwargs
        if begin and not self._tracing:
            jax.block_until_ready(state)  # earlier steps' device work stays out of the trace
            jax.profiler.start_trace(self.logdir)
            self._tracing = True
        elif self._tracing:
            jax.block_until_ready((state, outputs))
            self.close()

    def close(self) -> None:
        """Stops a trace still running."""
        if self._tracing:
            jax.profiler.stop_trace()
            self._tracing = False
            self.done = True
            log.info("Wrote a profile to %s", self.logdir)
