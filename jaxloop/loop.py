"""Loop: runs a Step over many batches and collects its outputs.

The host never waits for a step's result inside the loop. It only bounds how far ahead it
runs: before dispatching a step it waits for the step `max_steps_in_flight` back. That keeps
the device busy while capping queued work (unbounded dispatch of sharded steps crashed XLA's
CPU collectives on small machines, and would hold every batch in memory).

Example::

    loop = Loop(train_step)
    state, outputs = loop(state, iter(train_batches), num_steps=100)
    losses = outputs['loss']        # a list of 100 device scalars
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Any

import jax
from clu import metrics as clu_metrics

from jaxloop import preemption, types
from jaxloop import step as step_lib

Output = types.Output
State = types.TrainState
Step = step_lib.Step

DEFAULT_MAX_STEPS_IN_FLIGHT = 2


@jax.jit
def _merge_metrics(total: clu_metrics.Metric, new: clu_metrics.Metric) -> clu_metrics.Metric:
    """One dispatch per step instead of one per array op; the result stays on device."""
    return total.merge(new)


def _sync_token(outputs: Any) -> jax.Array | None:
    """An array that is ready once its step has finished and that no later step donates."""
    for leaf in jax.tree.leaves(outputs):
        if isinstance(leaf, jax.Array):
            return leaf
    return None


class Loop:
    """Runs a step repeatedly over a dataset iterator.

    Args:
      step: the Step to run on each batch.
      max_steps_in_flight: how many dispatched steps may be unfinished at once (>= 1).

    Override `begin`, `run`, `end` or `update_outputs` to customise; `_get_next_batch` and
    `_run_one_step` are the per-batch hooks.
    """

    def __init__(self, step: Step, max_steps_in_flight: int = DEFAULT_MAX_STEPS_IN_FLIGHT):
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {max_steps_in_flight}")
        self._step = step
        self._max_steps_in_flight = max_steps_in_flight
        self._in_flight: collections.deque = collections.deque()
        self.dataset_exhausted = False
        self.preempted = False
        self.num_steps_run = 0

    @property
    def step(self) -> Step:
        return self._step

    @property
    def max_steps_in_flight(self) -> int:
        return self._max_steps_in_flight

    def begin(self, state: State, dataset: Iterator[Any]) -> tuple[State, Iterator[Any]]:
        """Called before the first step of each loop; returns the state and iterator."""
        if not isinstance(dataset, Iterator):
            if not isinstance(dataset, Iterable):
                raise TypeError(f"dataset must be an iterator or iterable, got {type(dataset)}")
            dataset = iter(dataset)
        return state, dataset

    def update_outputs(self, loop_outputs: Output, step_outputs: Output | None) -> Output:
        """Appends each step output to the loop's per-key lists.

        `clu.metrics` Metric and Collection outputs are merged instead (on the device, no
        transfer), so the loop reports one metric over all its steps; call `.compute()` on
        it, or let SummaryAction do so.
        """
        if step_outputs is not None:
            for key, value in step_outputs.items():
                if isinstance(value, clu_metrics.Metric | clu_metrics.Collection):
                    previous = loop_outputs.get(key)
                    loop_outputs[key] = value if previous is None else _merge_metrics(
                        previous, value
                    )
                else:
                    loop_outputs[key].append(value)
        return loop_outputs

    def _get_next_batch(self, dataset: Iterator[Any]) -> Any:
        """The next batch; raises StopIteration when the dataset is exhausted."""
        return next(dataset)

    def _wait_for_room(self, outputs: Any, state: State) -> None:
        token = _sync_token(outputs)
        if token is None:
            # A step without array outputs: its state is the only thing to wait on, and the
            # next (donating) step would delete it, so wait now.
            jax.block_until_ready(state)
            return
        self._in_flight.append(token)
        while len(self._in_flight) >= self._max_steps_in_flight:
            jax.block_until_ready(self._in_flight.popleft())

    def _run_one_step(
        self,
        state: State,
        dataset: Iterator[Any],
        loop_outputs: Output,
        per_loop_step_number: int,
        log_num_flops: bool = False,
        return_state_from_step: bool = True,
        **kwargs: Any,
    ) -> tuple[State, Output]:
        """Runs one batch through the step and records its outputs.

        With `return_state_from_step=False` (eval loops) the step's returned state is
        dropped, so the same state feeds every step.
        """
        batch = self._get_next_batch(dataset)
        new_state, step_outputs = self._step(
            state, batch, per_loop_step_number, log_num_flops=log_num_flops, **kwargs
        )
        if return_state_from_step:
            state = new_state
        self._wait_for_room(step_outputs, new_state)
        return state, self.update_outputs(loop_outputs, step_outputs)

    def run(
        self,
        state: State,
        dataset: Iterator[Any],
        num_steps: int | None = None,
        log_num_flops: bool = False,
        **kwargs: Any,
    ) -> tuple[State, Output | None]:
        """Runs steps until `num_steps` or the end of `dataset`."""
        if num_steps is not None and num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        return_state_from_step = kwargs.pop("return_state_from_step", True)
        loop_outputs: Output = collections.defaultdict(list)
        self.dataset_exhausted = False
        self.preempted = False
        self._in_flight.clear()
        # Preemption is checked between training steps against a host-side step count, read
        # once here (a loop boundary) so the per-step check never waits for the device.
        check_preemption = preemption.active() and return_state_from_step
        host_step = int(state.step) if check_preemption else 0
        per_loop_step_number = 0
        while num_steps is None or per_loop_step_number < num_steps:
            try:
                state, loop_outputs = self._run_one_step(
                    state,
                    dataset,
                    loop_outputs,
                    per_loop_step_number + 1,
                    log_num_flops=log_num_flops and per_loop_step_number == 0,
                    return_state_from_step=return_state_from_step,
                    **kwargs,
                )
            except StopIteration:
                self.dataset_exhausted = True
                break
            per_loop_step_number += 1
            if check_preemption and preemption.reached_sync_point(host_step + per_loop_step_number):
                self.preempted = True
                break
        self._in_flight.clear()
        self.num_steps_run = per_loop_step_number
        return state, dict(loop_outputs)

    def end(self, state: State, outputs: Output | None) -> tuple[State, Output | None]:
        """Called after the last step of each loop."""
        return state, outputs

    def __call__(
        self,
        state: State,
        dataset: Iterator[Any] | Iterable[Any],
        num_steps: int | None = None,
        **kwargs: Any,
    ) -> tuple[State, Output | None]:
        """Runs `begin`, `run` and `end`; returns the final state and the loop outputs."""
        state, dataset = self.begin(state, dataset)
        state, outputs = self.run(state, dataset, num_steps, **kwargs)
        return self.end(state, outputs)
