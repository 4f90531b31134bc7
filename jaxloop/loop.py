"""Loop: runs a Step over many batches and collects its outputs.

The host never waits for a step's result inside the loop. It only bounds how far ahead it
runs: once `max_steps_in_flight` steps are unfinished it waits until half of them are. That keeps
the device busy while capping queued work (unbounded dispatch of sharded steps crashed XLA's
CPU collectives on small machines, and would hold every batch in memory). The default bound
depends on the step's mesh (`default_max_steps_in_flight`).

With ``steps_per_execution=k`` the loop runs k steps per compiled call (`Step.call_steps`,
a `jax.lax.scan` over k stacked batches), which removes the per-step dispatch cost for
small steps. Results, step counts and outputs (per-step lists) equal those of k=1; see
`Loop` for how executions are cut.

Example::

    loop = Loop(train_step)
    state, outputs = loop(state, iter(train_batches), num_steps=100)
    losses = outputs['loss']        # a list of 100 device scalars
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import jax
from clu import metrics as clu_metrics

from jaxloop import execution_size, preemption, staging, types
from jaxloop import step as step_lib

Output = types.Output
State = types.TrainState
Step = step_lib.Step

# The bound on a mesh of several CPU devices (see `default_max_steps_in_flight`).
DEFAULT_MAX_STEPS_IN_FLIGHT = 2


def default_max_steps_in_flight(step: Step) -> int:
    """How many dispatched executions a loop lets run ahead of the device by default.

    2 on a mesh of several CPU devices, for correctness: with hundreds of sharded steps
    queued, XLA's CPU collectives deadlocked ("Expected 8 threads to join the
    rendezvous"). 8 elsewhere, so the device finds queued work whenever the host thread
    is late.

    Example::

        default_max_steps_in_flight(step)  # 8 for a SingleDevicePartitioner's step
    """
    mesh = getattr(getattr(step, "partitioner", None), "mesh", None)
    if mesh is None:
        return DEFAULT_MAX_STEPS_IN_FLIGHT
    cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
    return DEFAULT_MAX_STEPS_IN_FLIGHT if cpu and mesh.size > 1 else 8


_METRIC_TYPES = (clu_metrics.Metric, clu_metrics.Collection)


@jax.jit
def _merge_all(metrics: list[Any]) -> Any:
    merged = metrics[0]
    for metric in metrics[1:]:
        merged = merged.merge(metric)
    return merged


class MetricList(list):
    """A loop output's per-step `clu.metrics` values: a list (``len``, indexing) whose
    `merged` metric over all steps is one jitted reduction.

    Example::

        outputs['accuracy'][3]          # step 4's metric
        outputs['accuracy'].compute()   # over the whole loop
    """

    def merged(self) -> Any:
        """All steps' metrics merged (one dispatch; stays on the device)."""
        if not self:
            raise ValueError("No metric to merge: the loop ran no step")
        return _merge_all(list(self))

    def compute(self) -> Any:
        """The metric over all steps: ``merged().compute()``."""
        return self.merged().compute()


def _sync_token(outputs: Any) -> jax.Array | None:
    """An array that is ready once its step has finished and that no later step donates."""
    return next((x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)), None)


class _Prefetch:
    """A device prefetcher over `source` (`data.prefetch_to_device` with the step's
    `prepare_batch`), started on the first batch asked of it."""

    def __init__(self, source: Iterator[Any], size: int):
        self.source = source
        self._size = size
        self._iterator: Any = None

    @property
    def started(self) -> bool:
        return self._iterator is not None

    def batches(self, step: Step) -> Iterator[Any]:
        if self._iterator is None:
            from jaxloop import data  # noqa: PLC0415

            self._iterator = data.prefetch_to_device(self.source, step.prepare_batch, self._size)
        return self._iterator

    def position(self) -> Any:
        return self._iterator.get_state()

    def close(self) -> None:
        if self._iterator is not None:
            self._iterator.close()


class _Segment:
    """The clock of a segment of executions timed for ``steps_per_execution='auto'``.

    It times the executions between the segment's first and last ones, in the steady state
    of a long loop: the clock starts when the first execution ends and stops when the one
    before the last ends, each waited for once the next is dispatched. So the device never
    idles for the clock, and the host prepares the next execution while each timed one runs,
    as it does in a long loop. (Timed from an idle device to an idle device instead, a
    segment of few large executions counted one of them without the host's competing work,
    which ranked a slower size first.)
    """

    def __init__(self, first_step: int):
        self.first_step = first_step
        self._executions = 0
        self._previous: tuple[Any, int] = (None, first_step)  # (sync token, steps done)
        self._last: tuple[Any, int] = (None, first_step)
        self._start: tuple[float, int] | None = None  # (clock, steps done) when it began

    def executed(self, in_flight: collections.deque, steps_done: int) -> None:
        """Called after each execution of the segment is dispatched."""
        self._executions += 1
        # No token: the loop has waited for this execution already (no array outputs).
        self._previous = self._last
        self._last = (in_flight[-1] if in_flight else None, steps_done)
        if self._executions == 2:
            self._start = (self._wait(self._previous[0]), self._previous[1])

    def timed(self) -> tuple[int, float]:
        """(steps timed, seconds): the executions after the first and before the last; none
        in a segment of fewer than three (the compiling round)."""
        if self._start is None or self._executions < 3:
            return 0, 0.0
        clock, steps = self._start
        return self._previous[1] - steps, self._wait(self._previous[0]) - clock

    @staticmethod
    def _wait(token: Any) -> float:
        if token is not None:
            token.block_until_ready()
        return time.perf_counter()


class Loop:
    """Runs a step repeatedly over a dataset iterator.

    Args:
      step: the Step to run on each batch.
      max_steps_in_flight: how many dispatched executions (steps, when
        `steps_per_execution` is 1) may be unfinished at once (>= 1); None: the step's
        `default_max_steps_in_flight(step)` (2 on several CPU devices, else 8).
      steps_per_execution: how many steps run in one compiled call (>= 1), or ``'auto'``:
        the loop times its first executions with 1, 2, 4, ... steps, in turns, and keeps
        the smallest size whose predicted loop time is within 2.5% of the best (so the
        host's dispatch left is a few percent of an execution's time), never more than
        the loop's length or the smallest interval of the step's actions, preferring a
        size that divides them (see `execution_size`). The choice holds for the loop's
        later runs; `steps_per_execution` reports it (1 until it is made). With several
        processes all take process 0's timings, so all run the same programs.
      unroll: with ``steps_per_execution > 1``, how many steps the compiled loop body
        holds (`jax.lax.scan`'s `unroll`; True: all of them). 1 compiles fastest and suits
        dense models; XLA:CPU runs convolutions inside a loop body on a slower kernel that
        also rounds differently, so unroll conv nets there (see
        `Partitioner.partition_steps`).

    With ``steps_per_execution=k > 1`` the loop reads up to k batches, stacks them and runs
    them with `Step.call_steps` through one compiled program of k steps, whatever the
    number of batches (a loop's remainder, the steps up to an action, the end of the data):
    a run compiles one program per step kind whatever its loop lengths. Each step's outputs
    still reach `update_outputs` one step at a time (split on the device in one dispatch).
    Executions are cut so that everything the host sees stays exact:

    - a step-level action of the Step (see `step.action_fires`) fires exactly on its steps:
      an execution never spans a step a begin action fires on (except as its first step)
      or an end action fires on (except as its last);
    - the Step's `begin` and `end` run once per compiled call (see `Step.begin`);
    - batches of another layout (a smaller last batch) start an execution of their own;
    - preemption is honoured at the end of the execution holding the requested step.

    Override `begin`, `run`, `end` or `update_outputs` to customise; `_get_next_batch`,
    `_run_one_step` and (for executions of several steps) `_run_steps` are the per-batch
    hooks.
    """

    def __init__(
        self,
        step: Step,
        max_steps_in_flight: int | None = None,
        steps_per_execution: int | str = 1,
        unroll: int | bool = 1,
    ):
        if max_steps_in_flight is None:
            max_steps_in_flight = default_max_steps_in_flight(step)
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {max_steps_in_flight}")
        self._tuner: execution_size.ExecutionSizeTuner | None = None
        self._auto_chosen = False
        if steps_per_execution == "auto":
            self._tuner = execution_size.ExecutionSizeTuner(
                max_size=self._smallest_action_interval(step)
            )
            steps_per_execution = 1
        elif not isinstance(steps_per_execution, int) or steps_per_execution < 1:
            raise ValueError(
                "steps_per_execution must be a positive integer or 'auto', got "
                f"{steps_per_execution!r}"
            )
        self._step = step
        self._max_steps_in_flight = max_steps_in_flight
        self._steps_per_execution = steps_per_execution
        self._unroll = unroll
        self._in_flight: collections.deque = collections.deque()
        self._prefetch: _Prefetch | None = None
        # A batch read but left for the next execution (another layout than the one before).
        self._pending: Any = None
        self.dataset_exhausted = False
        self.preempted = False
        self.num_steps_run = 0

    @property
    def step(self) -> Step:
        return self._step

    @property
    def max_steps_in_flight(self) -> int:
        return self._max_steps_in_flight

    @property
    def steps_per_execution(self) -> int:
        """Steps per compiled call; with 'auto', the size chosen (1 while measuring)."""
        return self._steps_per_execution

    @property
    def execution_size_tuner(self) -> execution_size.ExecutionSizeTuner | None:
        """With ``steps_per_execution='auto'``: the measurements (per-step seconds by
        size in ``per_step_secs``) and whether the choice is made (``done``)."""
        return self._tuner

    @staticmethod
    def _smallest_action_interval(step: Step) -> int:
        actions = [*getattr(step, "begin_actions", ()), *getattr(step, "end_actions", ())]
        intervals = [
            a.interval
            for a in actions
            if getattr(a, "fires_at", None) is None
            and isinstance(getattr(a, "interval", None), int)
        ]
        return min([execution_size.DEFAULT_MAX_SIZE, *intervals])

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
        """Appends each step output to the loop's per-key lists.

        Every key holds one entry per step. `clu.metrics` values go to a `MetricList`,
        whose `compute()` merges them over the loop (one jitted reduction).
        """
        if step_outputs is not None:
            for key, value in step_outputs.items():
                values = loop_outputs.get(key)
                if values is None:
                    values = loop_outputs[key] = (
                        MetricList() if isinstance(value, _METRIC_TYPES) else []
                    )
                values.append(value)
        return loop_outputs

    def _get_next_batch(self, dataset: Iterator[Any]) -> Any:
        """The next batch; raises StopIteration when the dataset is exhausted.

        Inside `prefetching(dataset)` the batch comes from the background prefetcher (a
        `step.PreparedBatch`, already on the devices); otherwise from ``next(dataset)``.
        """
        prefetch = self._prefetch
        if prefetch is not None and prefetch.source is dataset:
            return next(prefetch.batches(self._step))
        return next(dataset)

    @contextlib.contextmanager
    def prefetching(self, dataset: Iterator[Any], size: int = 2) -> Iterator[Iterator[Any]]:
        """Prepares the batches of `dataset` `size` ahead in a background thread, while open.

        The loop still receives `dataset` itself -- ``run``, ``_get_next_batch`` and the
        actions see the very object the user passed, its attributes and methods -- and
        the default `_get_next_batch` takes each batch from the prefetcher, which starts
        on the first such read (a subclass that reads ``next(dataset)`` itself therefore
        never starts it). `data_position` reports the position after the batches
        consumed, not after those read ahead.

        Example::

            it = iter(train_batches)
            with train_loop.prefetching(it, size=2):
                state, outputs = train_loop(state, it, num_steps=100)
        """
        if size <= 0:
            yield dataset
            return
        previous, self._prefetch = self._prefetch, _Prefetch(dataset, size)
        try:
            yield dataset
        finally:
            current, self._prefetch = self._prefetch, previous
            current.close()

    def data_position(self, dataset: Any) -> Any:
        """The checkpointable position of `dataset` after the batches this loop consumed
        (None when the iterator cannot report one)."""
        from jaxloop import data  # noqa: PLC0415 (grain loads only when asked)

        prefetch = self._prefetch
        if prefetch is not None and prefetch.source is dataset and prefetch.started:
            return prefetch.position()
        return data.iterator_state(dataset)

    def _wait_for_room(self, outputs: Any, state: State) -> None:
        token = _sync_token(outputs)
        if token is None:
            # A step without array outputs: its state is the only thing to wait on, and the
            # next (donating) step would delete it, so wait now.
            jax.block_until_ready(state)
            return
        in_flight = self._in_flight
        in_flight.append(token)
        if len(in_flight) >= self._max_steps_in_flight:
            # Wait until half the bound remains in flight, not just one fewer: one wait
            # (a thread sleep and wake-up) per max/2 steps instead of one per step. Steps
            # finish in order, so the newest of those waited for is the only one to block on.
            for _ in range(len(in_flight) - self._max_steps_in_flight // 2 - 1):
                in_flight.popleft()
            in_flight.popleft().block_until_ready()

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
                if batches and step_lib.batch_layout(batch) != step_lib.batch_layout(
                    batches[0]
                ):
                    self._pending = batch
                    break
                batches.append(batch)
        except StopIteration:
            self.dataset_exhausted = True
            if not batches:
                raise
        count = len(batches)
        new_state, outputs = self._step.call_steps(
            state, batches, per_loop_step_number, log_num_flops=log_num_flops,
            carry_state=return_state_from_step, unroll=self._unroll,
            size=self._steps_per_execution, **kwargs,
        )
        if return_state_from_step:
            state = new_state
        per_step = [None] * count if outputs is None else staging.unstack(outputs)[:count]
        self._wait_for_room(per_step[-1], new_state)
        for step_outputs in per_step:
            loop_outputs = self.update_outputs(loop_outputs, step_outputs)
        return state, loop_outputs, count

    def _execution_size(self, first: int, remaining: int | None, size: int | None = None) -> int:
        """How many steps the execution starting at step `first` runs, of at most `size`
        (default: `steps_per_execution`; see `Loop`)."""
        size = size or self._steps_per_execution
        if remaining is not None:
            size = min(size, remaining)
        begin_actions = self._step.begin_actions
        end_actions = self._step.end_actions
        if begin_actions or end_actions:
            for n in range(first, first + size):
                if n > first and any(
                    step_lib.action_fires(a, n, begin=True) for a in begin_actions
                ):
                    return n - first
                if any(step_lib.action_fires(a, n, begin=False) for a in end_actions):
                    return n - first + 1
        return size

    @staticmethod
    def _reached_sync_point(host_step: int, steps_done: int, size: int) -> bool:
        # Every step number is offered: with several processes the agreed sync step may
        # fall inside an execution, and all processes then stop at that execution's end.
        return any(
            preemption.reached_sync_point(host_step + n)
            for n in range(steps_done - size + 1, steps_done + 1)
        )

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
        tuner = None if self._auto_chosen else self._tuner
        if tuner is not None and num_steps is not None:
            tuner.limit(num_steps)
        segment: _Segment | None = None  # the timed segment under way ('auto')
        done = 0
        while num_steps is None or done < num_steps:
            if tuner is not None:
                if tuner.done:
                    self._choose_steps_per_execution(tuner, num_steps)
                    tuner = None
                else:
                    self._steps_per_execution = tuner.candidate
                    if segment is None:
                        segment = _Segment(done)
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
            if tuner is not None:
                segment.executed(self._in_flight, done)
                if done - segment.first_step >= tuner.segment_steps:
                    tuner.record(self._steps_per_execution, *segment.timed())
                    segment = None
            if check_preemption and self._reached_sync_point(host_step, done, size):
                self.preempted = True
                break
            if self.dataset_exhausted:
                break
        self._in_flight.clear()
        if tuner is not None:
            if self.dataset_exhausted and num_steps is None:
                # Now the loop's length is known (an eval loop over its whole dataset).
                tuner.limit(done)
            if tuner.done:
                self._choose_steps_per_execution(tuner, num_steps)
            else:
                # Still measuring (a segment cut by the loop's end does not count): the
                # next loop goes on from the same segment.
                self._steps_per_execution = 1
        self.num_steps_run = done
        return state, dict(loop_outputs)

    def _choose_steps_per_execution(
        self, tuner: execution_size.ExecutionSizeTuner, num_steps: int | None
    ) -> None:
        plan = None if num_steps is None else (lambda k: self._plan(k, num_steps))
        self._steps_per_execution = tuner.choose(plan)
        self._auto_chosen = True

    def _plan(self, size: int, num_steps: int) -> tuple[int, int]:
        """(executions, 0) of a loop of `num_steps` steps in executions of up to `size`."""
        executions = done = 0
        while done < num_steps:
            done += self._execution_size(done + 1, num_steps - done, size)
            executions += 1
        return executions, 0

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
