"""Loop: runs a Step over many batches and collects its outputs.

The host never waits for a step's result; it only bounds how far ahead it runs
(`jaxloop.engine.in_flight`).

Example::

    loop = Loop(train_step)
    state, outputs = loop(state, iter(train_batches), num_steps=100)
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
from jaxloop.engine import in_flight, outputs, ownership, staging
from jaxloop.engine import prefetch as prefetch_lib
from jaxloop.engine.host_count import host_step, remember_step
from jaxloop.hooks import step_actions
from jaxloop.launch import preemption

Output = types.Output
State = types.TrainState
Step = step_lib.Step
# Names kept here for code that imports them from the loop module.
MetricList = outputs.MetricList


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

    What the user keeps stays usable: a state (or any part of one) that an action, a hook
    or a cell keeps is never consumed; the step after it runs without donation
    (`engine.ownership`). After any exception, `stopped_state` is the live state at the
    last completed step.

    Override `begin`, `run`, `end` or `update_outputs` to customise; `_get_next_batch`,
    `_run_one_step` and `_run_steps` are the per-batch hooks.
    """

    def __init__(self, step: Step, max_steps_in_flight: int | None = None,
                 steps_per_execution: int = 1, unroll: bool = False,
                 donate_input_state: bool = False):
        if max_steps_in_flight is None:
            max_steps_in_flight = in_flight.default_max_steps_in_flight(step)
        self._in_flight = in_flight.InFlight(max_steps_in_flight)
        if (not isinstance(steps_per_execution, int) or isinstance(steps_per_execution, bool)
                or steps_per_execution < 1):
            raise ValueError(
                "steps_per_execution must be a positive integer (choose k by measuring: "
                f"see benchmarks/overhead.py), got {steps_per_execution!r}")
        if not isinstance(unroll, bool):
            raise TypeError(f"unroll must be True or False, got {unroll!r}")
        self._step = step
        self._steps_per_execution = steps_per_execution
        self._unroll = unroll
        self._donate_input_state = donate_input_state
        self._adopted: Any = None
        self._prefetch: prefetch_lib.Prefetcher | None = None
        # A batch of another layout, left for the next execution.
        self._pending: Any = None
        # Batches read from a dataset but not trained on (read ahead when a call ended):
        # the next call on that dataset takes them first. (dataset, [(batch, position)]).
        self._unread: tuple[Any, list[tuple[Any, Any]]] | None = None
        # The outputs of the steps a call completed before an exception ended it.
        self.partial_outputs: Output | None = None
        self.dataset_exhausted = False
        self.preempted = False
        self.num_steps_run = 0
        # The live state where Ctrl-C or a preemption stopped the last call (else None).
        self.stopped_state: Any = None

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

    def _own(self, state: State) -> State:
        """Marks `state` held by the caller (its first step consumes nothing) unless it was
        adopted or ``donate_input_state`` is set."""
        adopted, self._adopted = self._adopted, None
        if state is not adopted and not self._donate_input_state:
            ownership.mark_held(state)
        return state

    def begin(self, state: State, dataset: Iterator[Any]) -> tuple[State, Iterator[Any]]:
        """Called before the first step; returns the state and `dataset` as an iterator."""
        ahead = self._prefetch
        if ahead is not None and ahead.source is not dataset:
            raise ValueError(
                f"this loop is prefetching a {type(ahead.source).__name__} (`Loop.prefetching`), "
                "but was called with another dataset: call it with the iterator given to "
                "`prefetching`, or outside the `with` block")
        if not isinstance(dataset, Iterator):
            if not isinstance(dataset, Iterable):
                raise TypeError(f"dataset must be an iterator or iterable, got {type(dataset)}")
            dataset = iter(dataset)
        if self._unread is not None and self._unread[0] is not dataset:
            self._unread = None  # batches of another dataset: never asked for again
        return state, dataset

    def update_outputs(self, loop_outputs: Output, step_outputs: Output | None) -> Output:
        """Appends each step output to the loop's per-key lists (`outputs.append`)."""
        return outputs.append(loop_outputs, step_outputs)

    def _get_next_batch(self, dataset: Iterator[Any]) -> Any:
        """The next batch: one an earlier call read but did not train on, else from the
        prefetcher inside `prefetching(dataset)`, else from `dataset`; raises
        StopIteration at the end."""
        unread = self._unread_from(dataset)
        if unread:
            batch = unread.pop(0)[0]
            if isinstance(batch, BaseException):  # the source failed there when read ahead
                raise batch
            return batch
        return next(self._prefetch if self._prefetch is not None else dataset)

    def _unread_from(self, dataset: Any) -> list[tuple[Any, Any]]:
        """The (batch, position before it) pairs read from `dataset` but not trained on."""
        unread = self._unread
        return unread[1] if unread is not None and unread[0] is dataset else []

    def _keep_unread(self, dataset: Any, batches: list[tuple[Any, Any]],
                     first: bool = False) -> None:
        """Keeps `batches` ((batch, position before it) pairs read from `dataset` but not
        trained on) for the next call on `dataset`: after those kept already, or `first`."""
        if batches:
            kept = self._unread_from(dataset)
            self._unread = (dataset, [*batches, *kept] if first else [*kept, *batches])

    def forget_unread(self, dataset: Any) -> None:
        """Drops the batches kept unread from `dataset`, e.g. once a checkpoint moved it
        back to their position."""
        if self._unread_from(dataset):
            self._unread = None

    @contextlib.contextmanager
    def prefetching(self, dataset: Iterator[Any], size: int = 2, place: bool | None = None
                    ) -> Iterator[Iterator[Any]]:
        """While open, prepares `dataset`'s batches `size` ahead in a thread, placed on the
        devices where `place` (None: `prefetch.places_ahead`). The loop reads its batches
        from the prefetcher it is handed here, and it, `run` and the actions still see
        `dataset` itself; calling the loop with another dataset meanwhile is an error.
        Batches read ahead and not trained on when the block ends are the first the next
        call on `dataset` trains on (a source with ``set_state``, such as grain's, is moved
        back instead), so no batch is lost between calls.

        Example::

            it = iter(train_batches)
            with train_loop.prefetching(it, size=2):
                state, outputs = train_loop(state, it, num_steps=100)
        """
        if size <= 0:
            yield dataset
            return
        previous = self._prefetch
        if place is None:
            place = prefetch_lib.places_ahead(self._step)
        step = self._step
        self._prefetch = prefetch_lib.Prefetcher(dataset, step.prepare_batch if place else (
            lambda b: staging.PreparedBatch(step.preprocess_batch(b))), size)
        try:
            yield dataset
        finally:
            current, self._prefetch = self._prefetch, previous
            self._keep_unread(dataset, current.close())

    def data_position(self, dataset: Any) -> Any:
        """`dataset`'s checkpointable position after the batches trained on (or None)."""
        unread = self._unread_from(dataset)
        if unread:
            return unread[0][1]
        if self._prefetch is not None:
            return self._prefetch.position()
        if not callable(getattr(dataset, "get_state", None)):
            return None
        from jaxloop import data  # noqa: PLC0415 (grain loads only when asked)

        return data.iterator_state(dataset)

    def _run_one_step(self, state: State, dataset: Iterator[Any], loop_outputs: Output,
                      per_loop_step_number: int, log_num_flops: bool = False,
                      return_state_from_step: bool = True, **kwargs: Any
                      ) -> tuple[State, Output]:
        """Runs one batch and records its outputs; `return_state_from_step=False` (eval)
        keeps the given state."""
        batch = self._get_next_batch(dataset)
        new_state, step_outputs = self._step(
            state, batch, per_loop_step_number, log_num_flops=log_num_flops, **kwargs)
        if return_state_from_step:
            state = new_state
        self._in_flight.add(in_flight.token(self._step, step_outputs, new_state))
        return state, self.update_outputs(loop_outputs, step_outputs)

    def _run_steps(self, state: State, dataset: Iterator[Any], loop_outputs: Output,
                   per_loop_step_number: int, num_steps: int, log_num_flops: bool = False,
                   return_state_from_step: bool = True, **kwargs: Any
                   ) -> tuple[State, Output, int]:
        """Runs up to `num_steps` batches in one execution; returns the state, the outputs
        and the steps run (fewer at the dataset's end or before a batch of another layout,
        kept for the next execution)."""
        batches = [self._pending[0]] if self._pending is not None else []
        self._pending = None
        layout = staging.batch_layout(batches[0]) if batches else None
        try:
            while len(batches) < num_steps:
                position = self.data_position(dataset)
                batch = self._get_next_batch(dataset)
                if layout is None:
                    layout = staging.batch_layout(batch)
                elif staging.batch_layout(batch) != layout:
                    self._pending = (batch, position)
                    break
                batches.append(batch)
        except StopIteration:
            self.dataset_exhausted = True
            if not batches:
                raise
        count = len(batches)
        new_state, stacked = self._step.call_steps(
            state, batches, per_loop_step_number, log_num_flops=log_num_flops,
            carry_state=return_state_from_step, unroll=self._unroll,
            size=self._steps_per_execution, **kwargs)
        if return_state_from_step:
            state = new_state
        self._in_flight.add(in_flight.token(self._step, stacked, new_state))
        if isinstance(stacked, dict) and type(self).update_outputs is Loop.update_outputs:
            # Kept stacked: a step's entry is sliced off when something reads it.
            return state, outputs.extend_stacked(loop_outputs, stacked, count), count
        per_step = [None] * count if stacked is None else staging.unstack(stacked)[:count]
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
        self.dataset_exhausted = False
        self.preempted = False
        # Against the host's step count: the check never waits for the device.
        check_preemption = preemption.active() and train
        # A plain callable may advance `state.step` otherwise (or not at all).
        counted = train and getattr(self._step, "train", False) and hasattr(state, "step")
        first_step = host_step(state) if counted or check_preemption else None
        # An evaluation may stop at any batch on Ctrl-C; a training loop at a step boundary.
        check_interrupt = preemption.active() and not train
        done = 0
        if train:
            state = self._own(state)
        donating = getattr(self._step, "donating_state", None)
        size = self._steps_per_execution
        try:
            with donating() if donating and train else contextlib.nullcontext():
                while num_steps is None or done < num_steps:
                    first_flops = log_num_flops and done == 0
                    try:
                        if size == 1 and self._pending is None:
                            state, loop_outputs = self._run_one_step(
                                state, dataset, loop_outputs, done + 1,
                                log_num_flops=first_flops, return_state_from_step=train,
                                **kwargs)
                            ran = 1
                        else:
                            remaining = size if num_steps is None else min(size, num_steps - done)
                            state, loop_outputs, ran = self._run_steps(
                                state, dataset, loop_outputs, done + 1,
                                step_actions.execution_length(
                                    self._step.begin_actions, self._step.end_actions, done + 1,
                                    remaining),
                                log_num_flops=first_flops, return_state_from_step=train,
                                **kwargs)
                    except StopIteration:
                        self.dataset_exhausted = True
                        break
                    done += ran
                    # The agreed sync step may fall inside an execution: stop at its end.
                    if check_preemption and (
                            preemption.reached_sync_point(first_step + done) if ran == 1
                            else any(preemption.reached_sync_point(first_step + n)
                                     for n in range(done - ran + 1, done + 1))):
                        self.preempted = True
                        break
                    if check_interrupt and preemption.interrupted():
                        self.preempted = True
                        break
                    if self.dataset_exhausted:
                        break
        except BaseException:
            # The live state: the one the failed step was given, or the one it made if it
            # had consumed that (an error after its execution, in an end hook or action).
            live = state
            if train and _deleted(state):
                made = getattr(self._step, "last_state", None)
                live = made if made is not None and not _deleted(made) else state
            self.stopped_state = live
            self.partial_outputs = dict(loop_outputs)
            self.num_steps_run = done
            raise
        finally:
            if self._pending is not None:  # held back at a layout change: not trained on
                self._keep_unread(dataset, [self._pending], first=True)
                self._pending = None
        if counted:
            remember_step(state, first_step + done)
        self.num_steps_run = done
        return state, dict(loop_outputs)

    def end(self, state: State, outputs: Output | None) -> tuple[State, Output | None]:
        """Called after the last step of each loop."""
        return state, outputs

    def __call__(self, state: State, dataset: Iterator[Any] | Iterable[Any],
                 num_steps: int | None = None, **kwargs: Any) -> tuple[State, Output | None]:
        """Runs `begin`, `run` and `end`; returns the final state and the loop outputs.

        Ctrl-C ends the loop at the next step boundary: `end` runs, a training loop saves,
        then `preemption.Interrupted` is raised with the live state (also `stopped_state`),
        unless an `OuterLoop` runs it."""
        self.stopped_state = None
        self.partial_outputs = None
        owner = not preemption.active()
        with (preemption.handling_preemption((signal.SIGINT,)) if owner
              else contextlib.nullcontext()):
            try:
                state, dataset = self.begin(state, dataset)
                state, outputs = self.run(state, dataset, num_steps, **kwargs)
                if type(self).end.__module__.startswith("jaxloop."):
                    state, outputs = self.end(state, outputs)
                else:  # a user's `end` may keep the state
                    state, outputs = ownership.call(self.end, state, outputs)
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

