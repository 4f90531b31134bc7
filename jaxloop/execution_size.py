"""Choosing how many steps run per compiled call (``steps_per_execution='auto'``).

Each compiled call costs the host a fixed dispatch time; fusing k steps into one call
spreads it over k steps. `ExecutionSizeTuner` measures this instead of guessing. A loop
with ``steps_per_execution='auto'`` runs its first steps as timed segments of executions
of k = 1, 2, 4, ... steps, up to a limit (32, the loop's length, the smallest interval of
the step's actions). The sizes take turns, round after round, so that a change in the
machine's load hits them alike; each segment holds at least 5 executions and 32 steps.
Its steps run as the loop always runs them, with steps in flight, and the wall clock
times the executions between its first and its last, in that steady state (see
`Segment`). A first, untimed execution of each size compiles it.

Each size's time per step is estimated from 5 rounds: the median of the fastest size's
segments, times the median over the rounds of the size's ratio to the fastest size's
segment of the same round. The segments of a round run back to back, so a change in the
machine's load between rounds cancels out of these ratios (medians of each size's own
segments had the guide's CNN keep k=1 in one try of four, its k=2 being 5% faster). The
median, not the best: a segment of a large size holds few executions, and one of them
timed on a quiet machine made the best of 5 rank a slower size first (the MLP's k=32).
Of the sizes measured, the loop keeps the smallest whose predicted loop time is within
2.5% of the best: a larger k would buy almost nothing, and the host's dispatch left at
that size is a few percent of an execution's time at most (with a fixed cost D per
execution and u per step, a step costs ``D/k + u``). The prediction counts a short
execution (a loop's remainder, the steps up to a step action; see `loop.Loop`) as a full
one, so a k that fits the loop length and the actions' intervals wins over one that does
not, and a k whose fused program runs slower (XLA:CPU's rolled convolutions) is never
kept; sizes 3 times slower than the best after the first round are measured no further.
Results do not depend on the choice: every k gives the same steps, bit for bit where XLA
compiles the fused body like a single step (see `jaxloop.program`).

Example::

    tuner = ExecutionSizeTuner(max_size=16)
    while not tuner.done:
        k, steps = tuner.candidate, tuner.segment_steps
        ...  # run `steps` steps in executions of k, taking `seconds`
        tuner.record(k, steps, seconds)
    k = tuner.choose(lambda k: num_executions_of_up_to(k))
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxloop import agreement

DEFAULT_MAX_SIZE = 32
MIN_SEGMENT_STEPS = 32
MIN_SEGMENT_EXECUTIONS = 5


def _agreed(values: list[float]) -> list[float]:
    """Process 0's values on every process: all processes must run the same programs in
    the same order, so measurements (which differ per host) decide nothing locally."""
    return [float(v) for v in agreement.agreed(lambda: values)]


def size_limit(actions: Sequence[Any]) -> int:
    """The largest size worth trying under these step actions: `DEFAULT_MAX_SIZE`, or the
    smallest interval of an action that fires every `interval` steps, if smaller."""
    intervals = [
        a.interval for a in actions
        if getattr(a, "fires_at", None) is None and getattr(a, "trigger", None) is None
        and isinstance(getattr(a, "interval", None), int)
    ]
    return min([DEFAULT_MAX_SIZE, *intervals])


class Segment:
    """The clock of one timed segment of executions, started at loop step `first_step`.

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

    def executed(self, token: Any, steps_done: int) -> None:
        """Called after each execution is dispatched, with an array that is ready when it
        has finished (None: the loop has waited for it already)."""
        self._executions += 1
        self._previous, self._last = self._last, (token, steps_done)
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


def segment_steps(size: int) -> int:
    """Steps in a timed segment of executions of `size` steps."""
    return size * max(MIN_SEGMENT_EXECUTIONS, -(-MIN_SEGMENT_STEPS // size))


class ExecutionSizeTuner:
    """Times segments of executions of 1, 2, 4, ... steps and picks a steps_per_execution.

    Args:
      max_size: the largest size tried (the loop also caps it at its length and at the
        smallest interval of the step's actions).
      rounds: timed segments per size.
      tolerance: the loop time, relative to the best size's, within which the smallest
        size is kept.
    """

    def __init__(self, max_size: int = DEFAULT_MAX_SIZE, rounds: int = 5,
                 tolerance: float = 0.025):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.rounds = rounds
        self.tolerance = tolerance
        self.sizes = [1 << i for i in range(max_size.bit_length()) if 1 << i <= max_size]
        self.per_step_secs: dict[int, float] = {}
        self._timed: list[dict[int, float]] = []  # per timed round: seconds per step, by size
        self.done = False
        self._round = 0  # round 0: one untimed execution of each size (compiles it)
        self._turn = 0

    @property
    def candidate(self) -> int:
        """The size of the next segment's executions."""
        return self.sizes[self._turn]

    @property
    def segment_steps(self) -> int:
        """The steps of the next segment (one execution in the compiling round)."""
        return self.candidate if self._round == 0 else segment_steps(self.candidate)

    def limit(self, num_steps: int) -> None:
        """Drops the sizes whose segments do not fit in a loop of `num_steps` steps."""
        fits = [k for k in self.sizes if segment_steps(k) <= num_steps]
        if fits != self.sizes:
            self.sizes = fits or [1]
            self._turn = min(self._turn, len(self.sizes) - 1)
            if not fits:
                self.done = True

    def record(self, size: int, steps: int, seconds: float) -> None:
        """Reports a segment of `segment_steps` steps run in executions of `size` steps
        (some perhaps one by one), of which `steps` took `seconds` (the loop times the
        executions between the first and the last). Ignored for a size not asked for."""
        if self.done or size != self.candidate:
            return
        if self._round > 0 and steps > 0:
            if len(self._timed) < self._round:
                self._timed.append({})
            self._timed[self._round - 1][size] = seconds / steps
            self.per_step_secs.update(self._estimates())
        self._turn += 1
        if self._turn < len(self.sizes):
            return
        self._turn = 0
        self._round += 1
        if self._round == 1:
            return
        times = _agreed([self.per_step_secs[k] for k in self.sizes])
        self.per_step_secs.update(zip(self.sizes, times, strict=True))
        self.sizes = [k for k, t in zip(self.sizes, times, strict=True) if t <= 3 * min(times)]
        if self._round > self.rounds:
            self.done = True

    def _estimates(self) -> dict[int, float]:
        """Seconds per step of each size timed: the fastest size's median segment, times
        the median of the size's per-round ratios to the fastest size's segment."""
        segments: dict[int, list[float]] = {}
        for timed in self._timed:
            for size, secs in timed.items():
                segments.setdefault(size, []).append(secs)
        medians = {k: statistics.median(v) for k, v in segments.items()}
        fastest = min(medians, key=medians.__getitem__)
        estimates = {}
        for size, median in medians.items():
            ratios = [t[size] / t[fastest] for t in self._timed if size in t and fastest in t]
            estimates[size] = medians[fastest] * statistics.median(ratios) if ratios else median
        return estimates

    def choose(self, plan: Callable[[int], int] | None = None) -> int:
        """The smallest measured size whose predicted loop time is within `tolerance` of
        the best one's.

        `plan(k)` gives the number of executions of up to k steps in a loop of the caller's
        length (each costs a full one: one program runs them all); None predicts from the
        per-step times alone.
        """
        measured = self.per_step_secs
        if not measured:
            return 1

        def predicted(k: int) -> float:
            return measured[k] if plan is None else plan(k) * k * measured[k]

        bound = min(predicted(k) for k in measured) * (1 + self.tolerance)
        return min(k for k in measured if predicted(k) <= bound)


def executions(length: Callable[[int, int], int], num_steps: int) -> int:
    """The executions of a loop of `num_steps` steps, where ``length(first, remaining)``
    is how many steps the execution starting at step `first` runs."""
    count = done = 0
    while done < num_steps:
        done += length(done + 1, num_steps - done)
        count += 1
    return count


class Auto:
    """A loop's ``steps_per_execution='auto'``: the tuner's segments timed as the loop runs
    them, then the size chosen, kept for every later loop.

    The loop calls `begin_loop` before its first step, `size` before each execution,
    `executed` after dispatching it and `end_loop` when the loop is over.

    Example::

        auto = Auto(size_limit(actions))
        auto.begin_loop(num_steps=200, plan=lambda k: executions(length_of(k), 200))
        size = auto.size(done)  # before each execution of the loop ...
        auto.executed(token, done + size)  # ... and after it
        steps_per_execution = auto.end_loop(done, exhausted=False)
    """

    def __init__(self, max_size: int):
        self.tuner = ExecutionSizeTuner(max_size)
        self.chosen: int | None = None
        self._segment: Segment | None = None
        self._num_steps: int | None = None
        self._plan: Callable[[int], int] | None = None

    def begin_loop(self, num_steps: int | None, plan: Callable[[int], int] | None) -> None:
        """A loop of `num_steps` steps starts; `plan(k)` counts its executions of up to k."""
        self._num_steps, self._plan, self._segment = num_steps, plan, None
        if self.chosen is None and num_steps is not None:
            self.tuner.limit(num_steps)

    def size(self, done: int) -> int:
        """The size of the execution after the loop's first `done` steps."""
        if self.chosen is None and self.tuner.done:
            self.chosen = self.tuner.choose(self._plan)
        if self.chosen is not None:
            return self.chosen
        if self._segment is None:
            self._segment = Segment(done)
        return self.tuner.candidate

    def executed(self, token: Any, done: int) -> None:
        """An execution was dispatched (see `Segment.executed`); `done` steps are now run."""
        segment = self._segment
        if self.chosen is not None or segment is None:
            return
        segment.executed(token, done)
        if done - segment.first_step >= self.tuner.segment_steps:
            self.tuner.record(self.tuner.candidate, *segment.timed())
            self._segment = None

    def end_loop(self, done: int, exhausted: bool) -> int:
        """The loop ran `done` steps (all its dataset had, when `exhausted`); returns the
        size the loop reports: the choice, or 1 while measuring (a segment cut by the
        loop's end does not count, and the next loop starts it anew)."""
        if self.chosen is None and exhausted and self._num_steps is None:
            self.tuner.limit(done)  # now the loop's length is known (an eval loop's dataset)
        if self.chosen is None and self.tuner.done:
            self.chosen = self.tuner.choose(self._plan)
        return self.chosen or 1
