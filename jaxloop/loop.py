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

from jaxloop import execution_size, preemption, types
from jaxloop import step as step_lib

Output = types.Output
State = types.TrainState
Step = step_lib.Step

# The bound on a mesh of several CPU devices (see `default_max_steps_in_flight`).
DEFAULT_MAX_STEPS_IN_FLIGHT = 2


def default_max_steps_in_flight(step: Step) -> int:
    """How many dispatched executions a loop lets run ahead of the device by default.

    2 on a mesh of several CPU devices: with hundreds of sharded steps queued, XLA's CPU
    collectives deadlocked ("Expected 8 threads to join the rendezvous"). 8 elsewhere, so
    that a host thread woken late (a loaded machine, a garbage collection) still finds
    queued work for the device; with 2, a loaded 2-core machine lost up to 30% of the
    throughput of 0.2 ms steps.

    Example::

        default_max_steps_in_flight(step)  # 8 for a SingleDevicePartitioner's step
    """
    mesh = getattr(getattr(step, "partitioner", None), "mesh", None)
    if mesh is None:
        return DEFAULT_MAX_STEPS_IN_FLIGHT
    cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
    return DEFAULT_MAX_STEPS_IN_FLIGHT if cpu and mesh.size > 1 else 8


# A tuple: isinstance checks it faster than a union, once per output per step.
_METRIC_TYPES = (clu_metrics.Metric, clu_metrics.Collection)


@jax.jit
def _merge_metrics(total: clu_metrics.Metric, new: clu_metrics.Metric) -> clu_metrics.Metric:
    """One dispatch per step instead of one per array op; the result stays on device."""
    return total.merge(new)


def _split_steps(outputs: Output, num_steps: int) -> list[Output]:
    per_step: list[Output] = [{} for _ in range(num_steps)]
    for key, value in outputs.items():
        if isinstance(value, _METRIC_TYPES):
            # Merged here in step order, so the loop merges once per execution.
            merged = jax.tree.map(lambda x: x[0], value)
            for i in range(1, num_steps):
                merged = merged.merge(jax.tree.map(lambda x, i=i: x[i], value))
            per_step[-1][key] = merged
        else:
            for i in range(num_steps):
                per_step[i][key] = jax.tree.map(lambda x, i=i: x[i], value)
    return per_step


# Splits an execution's stacked outputs into per-step outputs in one dispatch.
_split_steps_jit = jax.jit(_split_steps, static_argnums=1)


def _sync_token(outputs: Any) -> jax.Array | None:
    """An array that is ready once its step has finished and that no later step donates."""
    if isinstance(outputs, dict) and outputs:
        first = next(iter(outputs.values()))
        if isinstance(first, jax.Array):  # the usual case, without flattening every output
            return first
    for leaf in jax.tree.leaves(outputs):
        if isinstance(leaf, jax.Array):
            return leaf
    return None


class _Prefetch:
    """A device prefetcher over `source`, started on the first batch asked of it.

    None starts for a step whose batches stay on the host (`Step.batches_stay_on_host`):
    there is nothing to place ahead, so they are read from `source` as needed, each while
    the steps already dispatched run. A thread would only take CPU from those steps (on a
    tiny step on 2 CPU cores it added about 26 us of wall time per step).
    """

    def __init__(self, source: Iterator[Any], size: int):
        self.source = source
        self._size = size
        self._iterator: Any = None
        self._on_host: bool | None = None

    @property
    def started(self) -> bool:
        return self._iterator is not None

    def batches(self, step: Step) -> Iterator[Any]:
        if self._iterator is None:
            if self._on_host is None:
                self._on_host = step.batches_stay_on_host()
            if self._on_host:
                return self.source
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

    With ``steps_per_execution=k > 1`` the loop reads k batches, stacks them and runs them
    with `Step.call_steps`; each step's outputs still reach `update_outputs` one step at a
    time (split on the device in one dispatch; clu metrics arrive merged over the
    execution, with its last step). Executions are cut so that everything the host sees
    stays exact:

    - only two programs ever run: the k-step one and the single step. A loop of n steps
      runs ``n // k`` executions of k and its last ``n % k`` steps one by one, so no loop
      length compiles anything after the first loop;
    - a step-level action of the Step (see `step.action_fires`) fires exactly on its steps:
      an execution never spans a step a begin action fires on (except as its first step)
      or an end action fires on (except as its last); the steps up to such a step run one
      by one, so intervals that are multiples of k cost nothing;
    - the Step's `begin` and `end` run once per execution, on the stacked batch (leading
      axis k) and the stacked outputs;
    - when the dataset ends inside an execution, the batches read run as single steps;
      batches of different shapes (a smaller last batch) also run as single steps;
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

        `clu.metrics` Metric and Collection outputs are merged instead (on the device, no
        transfer), so the loop reports one metric over all its steps; call `.compute()` on
        it, or let SummaryAction do so.
        """
        if step_outputs is not None:
            for key, value in step_outputs.items():
                if isinstance(value, _METRIC_TYPES):
                    previous = loop_outputs.get(key)
                    loop_outputs[key] = value if previous is None else _merge_metrics(
                        previous, value
                    )
                else:
                    loop_outputs[key].append(value)
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
        consumed, not after those read ahead. Batches the step leaves on the host
        (`Step.batches_stay_on_host`: CPU devices in one process) are read as needed, with
        no thread: there is nothing to place ahead, and the steps already dispatched run
        while the next batch is read.

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
        """Runs `num_steps` batches in one execution and records each step's outputs.

        Returns the state, the loop outputs and how many steps ran: fewer (as single steps)
        when the dataset ends first, which also sets `dataset_exhausted`.
        """
        batches = []
        try:
            for _ in range(num_steps):
                batches.append(self._get_next_batch(dataset))
        except StopIteration:
            self.dataset_exhausted = True
            if not batches:
                raise
        prepared = None
        if len(batches) == num_steps:
            try:
                prepared = self._step.prepare_batches(batches)
            except step_lib.BatchLayoutError:
                pass  # e.g. a smaller last batch: run these one by one
        if prepared is None:
            remaining = iter(batches)
            for i in range(len(batches)):
                state, loop_outputs = self._run_one_step(
                    state, remaining, loop_outputs, per_loop_step_number + i,
                    log_num_flops=log_num_flops and i == 0,
                    return_state_from_step=return_state_from_step, **kwargs,
                )
            return state, loop_outputs, len(batches)
        new_state, outputs = self._step.call_steps(
            state, prepared, per_loop_step_number, log_num_flops=log_num_flops,
            carry_state=return_state_from_step, unroll=self._unroll, **kwargs,
        )
        if return_state_from_step:
            state = new_state
        per_step = [None] * num_steps if outputs is None else _split_steps_jit(
            outputs, num_steps)
        self._wait_for_room(per_step[-1], new_state)
        for step_outputs in per_step:
            loop_outputs = self.update_outputs(loop_outputs, step_outputs)
        return state, loop_outputs, num_steps

    def _execution_size(self, first: int, remaining: int | None) -> int:
        """How many steps the execution starting at step `first` runs (see `Loop`)."""
        return self._cut(first, remaining, self._steps_per_execution)

    def _cut(self, first: int, remaining: int | None, size: int) -> int:
        """`_execution_size` for executions of at most `size` steps."""
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
        if size == 1:
            return preemption.reached_sync_point(host_step + steps_done)
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
        # Preemption is checked between training steps against a host-side step count, read
        # once here (a loop boundary) so the per-step check never waits for the device.
        check_preemption = preemption.active() and return_state_from_step
        host_step = int(state.step) if check_preemption else 0
        tuner = None if self._auto_chosen else self._tuner
        if tuner is not None and num_steps is not None:
            tuner.limit(num_steps)
        fused = self._steps_per_execution > 1 or tuner is not None
        segment: _Segment | None = None  # the timed segment under way ('auto')
        per_loop_step_number = 0
        while num_steps is None or per_loop_step_number < num_steps:
            size = 1
            if tuner is not None:
                if tuner.done:
                    self._choose_steps_per_execution(tuner, num_steps)
                    tuner = None
                    fused = self._steps_per_execution > 1
                else:
                    self._steps_per_execution = tuner.candidate
                    if segment is None:
                        segment = _Segment(per_loop_step_number)
            if fused:
                remaining = None if num_steps is None else num_steps - per_loop_step_number
                size = self._execution_size(per_loop_step_number + 1, remaining)
                if size < self._steps_per_execution:
                    # Fewer steps (a loop's remainder, the steps up to an action) run one
                    # by one: a program of another size would compile anew.
                    size = 1
            try:
                if size == 1:
                    state, loop_outputs = self._run_one_step(
                        state,
                        dataset,
                        loop_outputs,
                        per_loop_step_number + 1,
                        log_num_flops=log_num_flops and per_loop_step_number == 0,
                        return_state_from_step=return_state_from_step,
                        **kwargs,
                    )
                else:
                    state, loop_outputs, size = self._run_steps(
                        state,
                        dataset,
                        loop_outputs,
                        per_loop_step_number + 1,
                        size,
                        log_num_flops=log_num_flops and per_loop_step_number == 0,
                        return_state_from_step=return_state_from_step,
                        **kwargs,
                    )
            except StopIteration:
                self.dataset_exhausted = True
                break
            per_loop_step_number += size
            if tuner is not None:
                segment.executed(self._in_flight, per_loop_step_number)
                if per_loop_step_number - segment.first_step >= tuner.segment_steps:
                    tuner.record(self._steps_per_execution, *segment.timed())
                    segment = None
            if check_preemption and self._reached_sync_point(host_step, per_loop_step_number, size):
                self.preempted = True
                break
            if self.dataset_exhausted:
                break
        self._in_flight.clear()
        if tuner is not None:
            if self.dataset_exhausted and num_steps is None:
                # Now the loop's length is known (an eval loop over its whole dataset).
                tuner.limit(per_loop_step_number)
            if tuner.done:
                self._choose_steps_per_execution(tuner, num_steps)
            else:
                # Still measuring (a segment cut by the loop's end does not count): the
                # next loop goes on from the same segment.
                self._steps_per_execution = 1
        self.num_steps_run = per_loop_step_number
        return state, dict(loop_outputs)

    def _choose_steps_per_execution(
        self, tuner: execution_size.ExecutionSizeTuner, num_steps: int | None
    ) -> None:
        plan = None if num_steps is None else (lambda k: self._plan(k, num_steps))
        self._steps_per_execution = tuner.choose(plan)
        self._auto_chosen = True

    def _plan(self, size: int, num_steps: int) -> tuple[int, int]:
        """(executions of `size` steps, single steps) of a loop of `num_steps` steps."""
        executions = singles = 0
        done = 0
        while done < num_steps:
            if self._cut(done + 1, num_steps - done, size) < size:
                singles += 1
                done += 1
            else:
                executions += 1
                done += size
        return executions, singles

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
