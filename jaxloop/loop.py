"""Loop: runs a Step over many batches and collects its outputs. The host never waits for a
step's result; it only bounds how far ahead it runs (`jaxloop.engine.in_flight`).

Example::

    state, outputs = Loop(train_step)(state, iter(train_batches), num_steps=100)
    losses = outputs['loss']        # a list of 100 device scalars
"""

from __future__ import annotations

import collections
import contextlib
import signal
from collections.abc import Iterable, Iterator
from typing import Any

import jax

from jaxloop import step as step_lib
from jaxloop import types
from jaxloop.data import read_ahead
from jaxloop.engine import in_flight, outputs, ownership, staging
from jaxloop.engine.host_count import host_step, remember_step
from jaxloop.hooks import step_actions
from jaxloop.launch import preemption

Output = types.Output
State = types.TrainState
Step = step_lib.Step
MetricList = outputs.MetricList  # as the docs write it: `loop.MetricList`


def _deleted(state: Any) -> bool:
    """Whether a leaf of `state` was consumed (donated) by a step."""
    return any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state))


class Loop:
    """Runs a step repeatedly over a dataset iterator.

    Args:
      max_steps_in_flight: unfinished executions allowed; None: `in_flight`'s default.
      steps_per_execution: steps per compiled call (`Step.call_steps`), cut so the host
        sees what it would at k=1 (step actions, layout changes, preemption).
      unroll: compile an execution's steps straight-line, not as one loop body.
      donate_input_state: True consumes the state you pass; False (default): the first
        step runs without donating it (new buffers beside yours, no copy), and the steps
        after it consume only states the loop made. An `adopt`-ed state is consumed.

    A state (or any part of one) that an action, a hook or a cell keeps is never consumed
    (`engine.ownership`). After any exception, `stopped_state` is the live state at the
    last completed step.

    Override `begin`, `run`, `end` or `update_outputs` to customise; `_get_next_batch`,
    `_run_one_step` and `_run_steps` are the per-batch hooks.
    """

    def __init__(self, step: Step, max_steps_in_flight: int | None = None,
                 steps_per_execution: int = 1, unroll: bool = False,
                 donate_input_state: bool = False):
        self._in_flight = in_flight.InFlight(in_flight.default_max_steps_in_flight(step) if
                                             max_steps_in_flight is None else max_steps_in_flight)
        if type(steps_per_execution) is not int or steps_per_execution < 1:
            raise ValueError(
                "steps_per_execution must be a positive integer (choose k by measuring: "
                f"see benchmarks/overhead.py), got {steps_per_execution!r}")
        if not isinstance(unroll, bool):  # here, not at the first fused call (k=1 makes none)
            raise TypeError(f"unroll must be True or False, got {unroll!r}")
        self._step, self._steps_per_execution, self._unroll = step, steps_per_execution, unroll
        self._donate_input_state = donate_input_state
        self._adopted: Any = None
        self._prefetch: read_ahead.Prefetcher | None = None
        self._prepared: list[staging.PreparedBatch] = []  # read since the step last ran
        self._pending: Any = None  # (a batch of another layout, its position): next execution's
        # (dataset, [(batch, position before it)]) read, not trained on: first in its next call.
        self._unread: tuple[Any, list[tuple[Any, Any]]] | None = None
        self.partial_outputs: Output | None = None  # of the steps before an exception
        self.dataset_exhausted = self.preempted = False
        self.num_steps_run = 0
        self.stopped_state: Any = None  # the live state where Ctrl-C or preemption stopped

    @property
    def step(self) -> Step:
        return self._step

    @property
    def max_steps_in_flight(self) -> int:
        return self._in_flight.bound

    @property
    def steps_per_execution(self) -> int:
        return self._steps_per_execution

    def adopt(self, state: State) -> State:
        """Hands the loop a state no caller holds (restored, say): the next run donates it
        without a copy. Returns `state`, as in ``loop(loop.adopt(restored), it)``."""
        self._adopted = state
        return state

    def begin(self, state: State, dataset: Iterator[Any]) -> tuple[State, Iterator[Any]]:
        """Called before the first step; returns the state and `dataset` as an iterator."""
        ahead = self._prefetch
        if ahead is not None and ahead.source is not dataset:
            raise ValueError(
                f"this loop is prefetching a {type(ahead.source).__name__} (`Loop.prefetching`)"
                ", but was called with another dataset: call it with the iterator given to "
                "`prefetching`, or outside the `with` block")
        if not isinstance(dataset, Iterable):
            raise TypeError(f"dataset must be an iterator or iterable, got {type(dataset)}")
        dataset = dataset if isinstance(dataset, Iterator) else iter(dataset)
        if self._unread is not None and self._unread[0] is not dataset:
            self._unread = None  # batches of another dataset: never asked for again
        return state, dataset

    def update_outputs(self, loop_outputs: Output, step_outputs: Output | None) -> Output:
        """Appends each step output to the loop's per-key lists (`outputs.append`)."""
        return outputs.append(loop_outputs, step_outputs)

    def _get_next_batch(self, dataset: Iterator[Any]) -> Any:
        """The next batch (StopIteration at the end): one an earlier call read but did not
        train on, else the prefetcher's inside `prefetching(dataset)` (prepared already; the
        step prepares a batch an override returns in its place), else `dataset`'s."""
        unread = self._unread_from(dataset)
        batch = unread.pop(0)[0] if unread else next(
            self._prefetch if self._prefetch is not None else dataset)
        if isinstance(batch, BaseException):  # the source failed there when read ahead
            raise batch
        if isinstance(batch, staging.PreparedBatch):
            self._prepared.append(batch)
            return batch.batch
        return batch

    def _read(self, dataset: Iterator[Any]) -> Any:
        batch = self._get_next_batch(dataset)  # as prepared when read ahead: not done twice
        prepared = next((p for p in self._prepared if p.batch is batch), batch)
        self._prepared.clear()
        return prepared

    def _unread_from(self, dataset: Any) -> list[tuple[Any, Any]]:
        return self._unread[1] if self._unread and self._unread[0] is dataset else []

    def _keep_unread(self, dataset: Any, batches: list[tuple[Any, Any]], first=False) -> None:
        if batches:
            kept = self._unread_from(dataset)
            self._unread = (dataset, [*batches, *kept] if first else [*kept, *batches])

    def forget_unread(self, dataset: Any) -> None:
        """Drops the batches kept unread from `dataset` (a checkpoint moved it back)."""
        if self._unread_from(dataset):
            self._unread = None

    @contextlib.contextmanager
    def prefetching(self, dataset: Iterator[Any], size: int = 2, place: bool | None = None
                    ) -> Iterator[Iterator[Any]]:
        """While open, prepares `dataset`'s batches `size` ahead in a thread, placed on the
        devices where `place` (None: `read_ahead.places_ahead`); the loop, `run` and the
        actions still see `dataset` itself (calling the loop with another is an error).
        Batches read ahead but not trained on when the block ends come first in the next call
        on `dataset` (a source with ``set_state``, such as grain's, is moved back instead).

        Example::

            it = iter(train_batches)
            with train_loop.prefetching(it, size=2):
                state, outputs = train_loop(state, it, num_steps=100)
        """
        if size <= 0:
            yield dataset
            return
        previous, step = self._prefetch, self._step
        place = read_ahead.places_ahead(step) if place is None else place
        self._prefetch = read_ahead.Prefetcher(dataset, step.prepare_batch if place else (
            lambda b: staging.PreparedBatch(step.preprocess_batch(b))), size)
        try:
            yield dataset
        finally:
            current, self._prefetch = self._prefetch, previous
            self._keep_unread(dataset, current.close())

    def data_position(self, dataset: Any) -> Any:
        """`dataset`'s checkpointable position after the batches trained on (or None)."""
        unread = self._unread_from(dataset)
        if unread or self._prefetch is not None:
            return unread[0][1] if unread else self._prefetch.position()
        if not callable(getattr(dataset, "get_state", None)):
            return None
        from jaxloop import data  # noqa: PLC0415 (grain loads only when asked)

        return data.iterator_state(dataset)

    def _run_one_step(self, state: State, dataset: Iterator[Any], loop_outputs: Output,
                      per_loop_step_number: int, log_num_flops: bool = False,
                      return_state_from_step: bool = True, **kwargs: Any
                      ) -> tuple[State, Output]:
        """Runs one batch and records its outputs (`return_state_from_step=False`: eval)."""
        new_state, step_outputs = self._step(state, self._read(dataset), per_loop_step_number,
                                             log_num_flops=log_num_flops, **kwargs)
        self._in_flight.add(in_flight.token(self._step, step_outputs, new_state))
        return (new_state if return_state_from_step else state,
                self.update_outputs(loop_outputs, step_outputs))

    def _run_steps(self, state: State, dataset: Iterator[Any], loop_outputs: Output,
                   per_loop_step_number: int, num_steps: int, log_num_flops: bool = False,
                   return_state_from_step: bool = True, **kwargs: Any
                   ) -> tuple[State, Output, int]:
        """Runs up to `num_steps` batches in one execution; returns the state, the outputs
        and the steps run (fewer at the end or before a batch of another layout)."""
        batches, self._pending = [self._pending[0]] if self._pending else [], None
        layout = staging.batch_layout(batches[0]) if batches else None
        try:
            while len(batches) < num_steps:
                position = self.data_position(dataset)
                batch = self._read(dataset)
                layout = layout or staging.batch_layout(batch)
                if staging.batch_layout(batch) != layout:
                    self._pending = (batch, position)
                    break
                batches.append(batch)
        except StopIteration:
            self.dataset_exhausted = True
            if not batches:
                raise
        new_state, stacked = self._step.call_steps(
            state, batches, per_loop_step_number, log_num_flops=log_num_flops,
            carry_state=return_state_from_step, unroll=self._unroll,
            size=self._steps_per_execution, **kwargs)
        state = new_state if return_state_from_step else state
        self._in_flight.add(in_flight.token(self._step, stacked, new_state))
        count = len(batches)
        if isinstance(stacked, dict) and type(self).update_outputs is Loop.update_outputs:
            # Kept stacked: a step's entry is sliced off when something reads it.
            return state, outputs.extend_stacked(loop_outputs, stacked, count), count
        per_step = [None] * count if stacked is None else outputs.unstack(stacked)[:count]
        for step_outputs in per_step:
            loop_outputs = self.update_outputs(loop_outputs, step_outputs)
        return state, loop_outputs, count

    def run(self, state: State, dataset: Iterator[Any], num_steps: int | None = None,
            log_num_flops: bool = False, **kwargs: Any) -> tuple[State, Output | None]:
        """Runs steps until `num_steps` or the end of `dataset`."""
        if num_steps is not None and num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        train = kwargs.pop("return_state_from_step", True)
        loop_outputs: Output = collections.defaultdict(list)
        self.dataset_exhausted = self.preempted = False
        # Against the host's step count: the check never waits for the device. An evaluation
        # may stop at any batch on Ctrl-C; a training loop at the agreed step boundary.
        watch = preemption.active()
        # A plain callable may advance `state.step` otherwise (or not at all).
        counted = train and getattr(self._step, "train", False) and hasattr(state, "step")
        first_step = host_step(state) if counted or (watch and train) else None
        done, size = 0, self._steps_per_execution
        if train:
            adopted, self._adopted = self._adopted, None
            if state is not adopted and not self._donate_input_state:
                ownership.mark_held(state)  # the caller's: its first step consumes nothing
        donating = getattr(self._step, "donating_state", None)
        try:
            with donating() if donating and train else contextlib.nullcontext():
                while num_steps is None or done < num_steps:
                    flags = dict(kwargs, log_num_flops=log_num_flops and done == 0,
                                 return_state_from_step=train)
                    try:
                        if size == 1 and self._pending is None:
                            ran, (state, loop_outputs) = 1, self._run_one_step(
                                state, dataset, loop_outputs, done + 1, **flags)
                        else:
                            length = step_actions.execution_length(
                                self._step.begin_actions, self._step.end_actions, done + 1,
                                size if num_steps is None else min(size, num_steps - done))
                            state, loop_outputs, ran = self._run_steps(
                                state, dataset, loop_outputs, done + 1, length, **flags)
                    except StopIteration:
                        self.dataset_exhausted = True
                        break
                    done += ran
                    # The agreed sync step may fall inside an execution: stop at its end.
                    self.preempted = watch and (any(
                        preemption.reached_sync_point(first_step + n)
                        for n in range(done - ran + 1, done + 1)) if train
                        else preemption.interrupted())
                    if self.preempted or self.dataset_exhausted:
                        break
        except BaseException:
            # The live state: the one the failed step was given, or the one it made if it
            # had consumed that (an error after its execution, in an end hook or action).
            made = getattr(self._step, "last_state", None) if train and _deleted(state) else None
            self.stopped_state = made if made is not None and not _deleted(made) else state
            self.partial_outputs = dict(loop_outputs)
            raise
        finally:
            self.num_steps_run = done
            if self._pending is not None:  # held back at a layout change: not trained on
                self._keep_unread(dataset, [self._pending], first=True)
                self._pending = None
        if counted:
            remember_step(state, first_step + done)
        return state, dict(loop_outputs)

    def end(self, state: State, outputs: Output | None) -> tuple[State, Output | None]:
        """Called after the last step of each loop."""
        return state, outputs

    def __call__(self, state: State, dataset: Iterator[Any] | Iterable[Any],
                 num_steps: int | None = None, **kwargs: Any) -> tuple[State, Output | None]:
        """Runs `begin`, `run` and `end`; returns the final state and the loop outputs. Ctrl-C
        ends it at the next step boundary: `end` runs, a training loop saves, then (unless an
        `OuterLoop` runs it) `preemption.Interrupted` is raised with the live state."""
        self.stopped_state = self.partial_outputs = None
        owner = not preemption.active()
        with (preemption.handling_preemption((signal.SIGINT,)) if owner
              else contextlib.nullcontext()):
            try:
                state, dataset = self.begin(state, dataset)
                state, outputs = self.run(state, dataset, num_steps, **kwargs)
                state, outputs = ownership.call(self.end, state, outputs)  # a user's may keep it
            except BaseException:
                if self.stopped_state is None:  # (`run` sets it when it fails)
                    self.stopped_state = state
                raise
            if owner and self.preempted:
                self.stopped_state = state
                saved = self.save_checkpoint(state, outputs)
                raise preemption.stopped(state, host_step(state), saved)
        return state, outputs

    def save_checkpoint(self, state: State, outputs: Output | None) -> bool:
        """Saves `state` now if the loop can; returns whether its step is saved (here never)."""
        return False

