"""Profiling: capture a `jax.profiler` trace of a chosen range of steps.

`ProfileAction` is a step-level action: give the same instance to a Step as a begin action
and as an end action. It starts a trace before step `start_step` of the first loop that
reaches it and stops it after step ``start_step + num_steps - 1``, writing TensorBoard's
profile plugin files (``logdir/plugins/profile/<run>/*.xplane.pb``). View them with
``tensorboard --logdir LOGDIR`` (Profile tab) or https://ui.perfetto.dev.

Example::

    profile = profiling.ProfileAction(workdir / 'profile', start_step=10, num_steps=5)
    train_step = MyStep(key, model, optimizer, train=True,
                        begin_actions=[profile], end_actions=[profile])
    outer(state, train_dataset, train_total_steps=1000, train_loop_steps=100)
    # a trace of steps 10..14 of the first train loop is in workdir/profile

Steps are numbered within their loop (``per_loop_step_number``, from 1), which the host
knows without asking the device. With ``steps_per_execution=k`` the loop starts an
execution at `start_step` and ends one after the last traced step, so the trace shows the
fused executions as they normally run. The action waits for the device at both ends of the
range (so the trace holds exactly those steps' device work); no other step waits.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax

from jaxloop import actions, types

log = logging.getLogger(__name__)


class ProfileAction(actions.Action):
    """Traces steps ``start_step .. start_step + num_steps - 1`` of a loop, once.

    Args:
      logdir: where the trace goes (a TensorBoard log directory, e.g. the workdir).
      start_step: the first traced step, counted within its loop from 1.
      num_steps: how many steps to trace.

    If the loop ends before the range does, the trace stops before the next loop's first
    step (or call `close`). Use it as a step action only (a Step's begin and end actions).

    Example::

        profile = ProfileAction('/tmp/workdir', start_step=3, num_steps=2)
        step = MyStep(key, model, train=True, begin_actions=[profile], end_actions=[profile])
    """

    def __init__(self, logdir: str | os.PathLike[str], start_step: int = 2, num_steps: int = 5):
        super().__init__(interval=1)
        if not isinstance(start_step, int) or start_step < 1:
            raise ValueError(f"start_step must be a positive integer, got {start_step!r}")
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        self._logdir = os.fspath(logdir)
        self._start = start_step
        self._stop = start_step + num_steps - 1
        self._tracing = False
        self._done = False

    @property
    def logdir(self) -> str:
        return self._logdir

    @property
    def done(self) -> bool:
        """Whether the trace has been captured."""
        return self._done

    def fires_at(self, per_loop_step_number: int, begin: bool) -> bool:
        """Before `start_step` and after the last traced step (see `step.action_fires`);
        while tracing, also before the early steps of a new loop, to stop a trace that the
        previous loop left running."""
        if self._done:
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
            jax.profiler.start_trace(self._logdir)
            self._tracing = True
        elif self._tracing:
            jax.block_until_ready((state, outputs))
            self.close()

    def close(self) -> None:
        """Stops a trace still running (e.g. when training ended inside the range)."""
        if self._tracing:
            jax.profiler.stop_trace()
            self._tracing = False
            self._done = True
            log.info("Wrote a profile to %s", self._logdir)
