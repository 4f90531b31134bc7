"""Loop: runs a Step over many batches and collects its outputs.

The host never waits for a step's result inside the loop; it only bounds how far ahead it
runs (`jaxloop.in_flight`). With ``steps_per_execution=k`` the loop runs k steps per
compiled call (`Step.call_steps`), which removes the per-step dispatch cost for small
steps. Results, step counts and outputs (per-step lists, `jaxloop.outputs`) equal those of
k=1; see `Loop` for how executions are cut.

Example::

    loop = Loop(train_step)
    state, outputs = loop(state, iter(train_batches), num_steps=100)
    losses = outputs['loss']        # a list of 100 device scalars
"""

from __future__ import annotations

import collections
import contextlib
import functools
import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxloop import execution_size, in_flight, outputs, preemption, staging, step_actions, types
from jaxloop import prefetch as prefetch_lib
from jaxloop import step as step_lib

Output = types.Output
State = types.TrainState
Step = step_lib.Step
# Names kept here for code that imports them from the loop module.
MetricList = outputs.MetricList
DEFAULT_MAX_STEPS_IN_FLIGHT = in_flight.DEFAULT_MAX_STEPS_IN_FLIGHT
default_max_steps_in_flight = in_flight.default_max_steps_in_flight


@functools.lru_cache(maxsize=32)
def _copier(shardings: tuple[jax.sharding.Sharding, ...]) -> Callable[[list], list]:
    """Copies a list of arrays on their devices, each keeping its sharding, in one
    dispatch (`jax.device_put(..., may_alias=False)` spent 25 us a leaf on the host)."""
    return jax.jit(lambda arrays: [jnp.copy(x) for x in arrays], out_shardings=list(shardings))


class Loop:
    """Runs a step repeatedly over a dataset iterator.

    Args:
      step: the Step to run on each batch.
      max_steps_in_flight: how many dispatched executions may be unfinished at once
        (>= 1); None: `in_flight.default_max_steps_in_flight(step)`.
      steps_per_execution: how many steps run in one compiled call (>= 1), or ``'auto'``:
        the loop times its first executions of 1, 2, 4, ... steps and keeps the smallest
        size within 2.5% of the best predicted loop time, at most the loop's length and the
        smallest interval of the step's actions (see `execution_size`; with several
        processes, process 0's timings decide). `steps_per_execution` reports the choice
        (1 until it is made).
      unroll: with ``steps_per_execution > 1``, True compiles an execution's steps as
        straight-line code; otherwise they are one loop body run `count` times (a dynamic
        trip count, which XLA cannot partly unroll: an integer means the same). XLA:CPU
        runs convolutions inside a loop body on a slower kernel, so unroll conv nets there
        (see `jaxloop.program`).
      donate_input_state: False (the default) leaves the state you pass untouched: a
        training loop copies it once on the devices, with its own shardings, and then
        donates only the states its steps produce (one state plus the step's temporaries
        in the steady state; two while you hold yours). True consumes the state you pass
        instead (its arrays are deleted): for a model whose state does not fit twice.
        A state the loop was handed with `adopt` is never copied.

    With ``steps_per_execution=k > 1`` the loop reads up to k batches and runs them with
    `Step.call_steps` through one compiled program, whatever the number of batches, so a
    run compiles one program per step kind. Each step's outputs still reach
    `update_outputs` one step at a time. Executions are cut so that the host sees exactly
    what it would at k=1: step actions fire on their steps (`step_actions`), a batch of
    another layout (a smaller last batch) starts an execution of its own, and preemption is
    honoured at the end of the execution holding the requested step. `Step.begin` and
    `Step.end` run once per compiled call.

    Override `begin`, `run`, `end` or `update_outputs` to customise; `_get_next_batch`,
    `_run_one_step` and `_run_steps` are the per-batch hooks.
    """

    def __init__(
        self,
        step: Step,
        max_steps_in_flight: int | None = None,
        steps_per_execution: int | str = 1,
        unroll: int | bool = 1,
        donate_input_state: bool = False,
    ):
        if max_steps_in_flight is None:
            max_steps_in_flight = default_max_steps_in_flight(step)
        self._in_flight = in_flight.InFlight(max_steps_in_flight)
        self._auto: execution_size.Auto | None = None
        if steps_per_execution == "auto":
            self._auto = execution_size.Auto(execution_size.size_limit(
                [*getattr(step, "begin_actions", ()), *getattr(step, "end_actions", ())]
            ))
            steps_per_execution = 1
        elif not isinstance(steps_per_execution, int) or steps_per_execution < 1:
            raise ValueError(
                "steps_per_execution must be a positive integer or 'auto', got "
                f"{steps_per_execution!r}"
            )
        self._step = step
        self._steps_per_execution = steps_per_execution
        self._unroll = unroll
        self._donate_input_state = donate_input_state
        self._adopted: Any = None
        self._prefetch: prefetch_lib.Prefetcher | None = None
        # A batch read but left for the next execution (another layout than the one before).
        self._pending: Any = None
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
        """Steps per compiled call; with 'auto', the size chosen (1 while measuring)."""
        return self._steps_per_execution

    @property
    def execution_size_tuner(self) -> execution_size.ExecutionSizeTuner | None:
        """With ``steps_per_execution='auto'``: the measurements (per-step seconds by
        size in ``per_step_secs``) and whether the choice is made (``done``)."""
        return None if self._auto is None else self._auto.tuner

    def adopt(self, state: State) -> State:
        """Hands the loop a state that no caller holds (one restored from a checkpoint,
        built from `Step.abstract_state`, or produced by this loop's previous run and never
        handed out): the next run donates it without copying it first. Returns `state`.

        Example::

            state, outputs = loop(loop.adopt(step.restore_model(abstract, ckpt_dir)), it)
        """
        self._adopted = state
        return state

    def _own(self, state: State) -> State:
        """The state this run may donate: `state` itself when the loop may consume it (an
        adopted state, ``donate_input_state``, a step that never donates or that the user
        compiled to donate), else a copy on the devices with each array's own sharding."""
        adopted, self._adopted = self._adopted, None
        step = self._step
        if (state is adopted or self._donate_input_state or not getattr(step, "train", False)
                or getattr(step, "donates_input_state", True)):
            return state
        leaves, treedef = jax.tree.flatten(state)
        # One copy per set of devices: a state may hold leaves on several (params placed
        # on a mesh beside a step counter on one device), and one jit takes only one set.
        groups: dict[frozenset, list[int]] = {}
        for i, x in enumerate(leaves):
            if isinstance(x, jax.Array):
                groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
        for at in groups.values():
            copies = _copier(tuple(leaves[i].sharding for i in at))([leaves[i] for i in at])
            for i, copy in zip(at, copies, strict=True):
                leaves[i] = copy
        return jax.tree.unflatten(treedef, leaves)

    def begin(self, state: State, dataset: Iterator[Any]) -> tuple[State, Iterator[Any]]:
        """Called before the first step of each loop; returns the state and iterator.

        An iterable `dataset` is turned into an iterator. (A restored data position is
        given to the iterator by `checkpoint.restore(..., dataset=it)` or `OuterLoop`,
        never through the state.)
        """
        if not isinstance(dataset, Iterator):
            if not isinstance(dataset, Iterable):
                raise TypeError(f"dataset must be an iterator or iterable, got {type(dataset)}")
            dataset = iter(dataset)
        return state, dataset

    def update_outputs(self, loop_outputs: Output, step_outputs: Output | None) -> Output:
        """Appends each step output to the loop's per-key lists (`outputs.append`)."""
        return outputs.append(loop_outputs, step_outputs)

    def _get_next_batch(self, dataset: Iterator[Any]) -> Any:
        """The next batch; raises StopIteration when the dataset is exhausted.

        Inside `prefetching(dataset)` the batch comes from the prefetcher (a
        `step.PreparedBatch`, as the program takes it); otherwise from ``next(dataset)``.
        """
        ahead = self._prefetch
        return next(ahead if ahead is not None and ahead.source is dataset else dataset)

    @contextlib.contextmanager
    def prefetching(self, dataset: Iterator[Any], size: int = 2) -> Iterator[Iterator[Any]]:
        """Prepares the batches of `dataset` `size` ahead in a background thread while
        open (`prefetch.Prefetcher`, which `_get_next_batch` reads through). The loop still
        receives `dataset` itself: ``run``, ``_get_next_batch`` and the actions see the
        very object the user passed. `data_position` is after the batches consumed.

        Example::

            it = iter(train_batches)
            with train_loop.prefetching(it, size=2):
                state, outputs = train_loop(state, it, num_steps=100)
        """
        if size <= 0:
            yield dataset
            return
        previous = self._prefetch
        self._prefetch = prefetch_lib.Prefetcher(dataset, self._step.prepare_batch, size)
        try:
            yield dataset
        finally:
            current, self._prefetch = self._prefetch, previous
            current.close()

    def data_position(self, dataset: Any) -> Any:
        """The checkpointable position of `dataset` after the batches this loop consumed
        (None when the iterator cannot report one)."""
        ahead = self._prefetch
        if ahead is not None and ahead.source is dataset:
            return ahead.position()
        from jaxloop import data  # noqa: PLC0415 (grain loads only when asked)

        return data.iterator_state(dataset)

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
        self._in_flight.add(step_outputs, new_state)
        return state, self.update_outputs(loop_outputs, step_outputs)

    def _run_steps(
        self,
        state: State,
        dataset: Iterator[Any],
        loop_outputs: Output,
        per_loop_step_number: int,
        num_steps: int,
        log_num_flops: bool = False,
        return_state_from_step: bool = True,
        **kwargs: Any,
    ) -> tuple[State, Output, int]:
        """Runs up to `num_steps` batches in one execution and records each step's outputs.

        Returns the state, the loop outputs and how many steps ran: fewer when the dataset
        ends first (which also sets `dataset_exhausted`) or a batch of another layout
        comes (it is kept for the next execution).
        """
        batches = [self._pending] if self._pending is not None else []
        self._pending = None
        try:
            while len(batches) < num_steps:
                batch = self._get_next_batch(dataset)
                if batches and staging.batch_layout(batch) != staging.batch_layout(batches[0]):
                    self._pending = batch
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
            size=self._steps_per_execution, **kwargs,
        )
        if return_state_from_step:
            state = new_state
        per_step = [None] * count if stacked is None else staging.unstack(stacked)[:count]
        self._in_flight.add(per_step[-1], new_state)
        for step_outputs in per_step:
            loop_outputs = self.update_outputs(loop_outputs, step_outputs)
        return state, loop_outputs, count

    def _execution_size(self, first: int, remaining: int | None, size: int | None = None) -> int:
        """How many steps the execution starting at step `first` runs, of at most `size`
        (default: `steps_per_execution`; see `Loop`)."""
        size = size or self._steps_per_execution
        if remaining is not None:
            size = min(size, remaining)
        return step_actions.execution_length(
            self._step.begin_actions, self._step.end_actions, first, size)

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
        self._pending = None
        # Preemption is checked between training steps against a host-side step count, read
        # once here (a loop boundary) so the per-step check never waits for the device.
        check_preemption = preemption.active() and return_state_from_step
        host_step = int(state.step) if check_preemption else 0
        # An evaluation may stop at any batch on Ctrl-C; a training loop at a step boundary.
        check_interrupt = preemption.active() and not return_state_from_step
        auto = self._auto
        if auto is not None:
            auto.begin_loop(num_steps, None if num_steps is None else lambda k: (
                execution_size.executions(lambda f, r: self._execution_size(f, r, k), num_steps)
            ))
        done = 0
        if return_state_from_step:
            state = self._own(state)
        donating = getattr(self._step, "donating_state", None)
        with donating() if donating and return_state_from_step else contextlib.nullcontext():
            while num_steps is None or done < num_steps:
                if auto is not None:
                    self._steps_per_execution = auto.size(done)
                first_flops = log_num_flops and done == 0
                try:
                    if self._steps_per_execution == 1 and self._pending is None:
                        size = 1
                        state, loop_outputs = self._run_one_step(
                            state, dataset, loop_outputs, done + 1, log_num_flops=first_flops,
                            return_state_from_step=return_state_from_step, **kwargs,
                        )
                    else:
                        remaining = None if num_steps is None else num_steps - done
                        state, loop_outputs, size = self._run_steps(
                            state, dataset, loop_outputs, done + 1,
                            self._execution_size(done + 1, remaining), log_num_flops=first_flops,
                            return_state_from_step=return_state_from_step, **kwargs,
                        )
                except StopIteration:
                    self.dataset_exhausted = True
                    break
                done += size
                if auto is not None:
                    auto.executed(self._in_flight.last, done)
                # Every step number is offered: with several processes the agreed sync step may
                # fall inside an execution, and all processes then stop at that execution's end.
                if check_preemption and (
                        preemption.reached_sync_point(host_step + done) if size == 1
                        else any(preemption.reached_sync_point(host_step + n)
                                 for n in range(done - size + 1, done + 1))):
                    self.preempted = True
                    break
                if check_interrupt and preemption.interrupted():
                    self.preempted = True
                    break
                if self.dataset_exhausted:
                    break
        self._in_flight.clear()
        if auto is not None:
            self._steps_per_execution = auto.end_loop(done, self.dataset_exhausted)
        self.num_steps_run = done
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
        """Runs `begin`, `run` and `end`; returns the final state and the loop outputs.

        Ctrl-C (a notebook's Stop button) ends the loop at the next step boundary (an
        evaluation at its next batch): `end` runs, a training loop saves with its
        checkpoint action if it has one, then `preemption.Interrupted` (a
        `KeyboardInterrupt`) is raised carrying the live state, which `stopped_state` also
        holds. Inside an `OuterLoop` the outer loop ends the run instead.
        """
        self.stopped_state = None
        owner = not preemption.active()
        with (preemption.handling_preemption((signal.SIGINT,)) if owner
              else contextlib.nullcontext()):
            state, dataset = self.begin(state, dataset)
            state, outputs = self.run(state, dataset, num_steps, **kwargs)
            state, outputs = self.end(state, outputs)
            if owner and self.preempted:
                self.stopped_state = state
                saved = self.save_checkpoint(state, outputs)
                raise preemption.stopped(state, int(state.step), saved)
        return state, outputs

    def save_checkpoint(self, state: State, outputs: Output | None) -> bool:
        """Saves `state` now, where the loop can (a training loop with a checkpoint
        action); returns whether a checkpoint of its step exists. This loop saves
        nothing."""
        return False
