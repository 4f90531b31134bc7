"""StatLoop: a Loop that also reports timing and size statistics in its outputs.

Statistics are taken on the host without waiting for the device (the steps in flight are
bounded, so host time is device time); compilation time is left out of the rates. Opt-in:
tokens/s, model TFLOP/s per device and MFU, and a goodput split.

Example, a language model whose batches hold a ``'mask'`` of real tokens::

    loop = StatLoop(step, tokens_key='mask', model_flops_per_token=6 * num_params)
    state, outputs = loop(state, batches, num_steps=100)
    outputs[STAT_TOKENS_PER_SEC], outputs[STAT_MFU], loop.stats[STAT_STEPS_PER_SEC]
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from jaxloop import loop as loop_lib
from jaxloop import types
from jaxloop.diagnostics import goodput, throughput

# Re-exported: the opt-in statistics' names and `token_count`, as ``stat_loop.<name>``.
from jaxloop.diagnostics.throughput import (  # noqa: F401
    STAT_GOODPUT,
    STAT_MFU,
    STAT_MFU_XLA,
    STAT_MODEL_TFLOPS,
    STAT_TIME_PREFIX,
    STAT_TOKENS_PER_SEC,
    token_count,
)

Loop = loop_lib.Loop
Output = types.Output
State = types.TrainState
Step = loop_lib.Step

STAT_PREFIX = "jaxloop"
STAT_STEPS_PER_SEC = "jaxloop/steps_per_sec"
STAT_EXAMPLES_PER_SEC = "jaxloop/examples_per_sec"
STAT_LOOP_TIME_SECS = "jaxloop/loop_time_secs"
STAT_NUM_STEPS = "jaxloop/num_steps"
STAT_NUM_PARAMS = "jaxloop/num_params"
STAT_NUM_FLOPS = "jaxloop/num_flops"
STAT_LIFE_TIME_SECS = "jaxloop/life_time_secs"
STAT_COMPILE_SECS = "jaxloop/compile_secs"
# Wall-clock times (seconds since the epoch, `time.time()`): the loop's construction and the
# last loop's begin, as google/jaxloop records them.
STAT_INIT_TIME = "jaxloop/init_time"
STAT_BEGIN_TIME = "jaxloop/begin_time"

ALL_STATS = (STAT_STEPS_PER_SEC, STAT_EXAMPLES_PER_SEC, STAT_LOOP_TIME_SECS, STAT_NUM_STEPS,
             STAT_NUM_PARAMS, STAT_NUM_FLOPS, STAT_LIFE_TIME_SECS, STAT_COMPILE_SECS,
             STAT_INIT_TIME, STAT_BEGIN_TIME)
# As google/jaxloop: the outputs hold no statistics unless asked; `StatLoop.stats` has all.
DEFAULT_STATS: tuple[str, ...] = ()


class StatLoop(loop_lib.Loop):
    """Measures each loop: `stats` holds its `jaxloop/...` statistics (plain floats), and
    the outputs hold those named in `stat_names` and the opt-in ones asked for.

    Args:
      stat_names: which of `ALL_STATS` to add to the outputs (none by default).
      global_batch_size: examples per step across all processes, for examples/s.
      model_flops_per_example, model_flops_per_token, tokens_key, peak_flops_per_device,
        recorder: opt-in throughput figures (`jaxloop.diagnostics.throughput.Throughput`).
    """

    def __init__(self, step: Any, stat_names: Sequence[str] | None = None,
                 global_batch_size: int | None = None, max_steps_in_flight: int | None = None,
                 steps_per_execution: int = 1, unroll: bool = False,
                 model_flops_per_example: float | str | None = None, recorder: Any = None,
                 donate_input_state: bool = False, model_flops_per_token: float | None = None,
                 tokens_key: str | Sequence[str] | None = None,
                 peak_flops_per_device: float | None = None):
        super().__init__(step, max_steps_in_flight=max_steps_in_flight,
                         steps_per_execution=steps_per_execution, unroll=unroll,
                         donate_input_state=donate_input_state)
        stat_names = DEFAULT_STATS if stat_names is None else tuple(stat_names)
        unknown = sorted(set(stat_names) - set(ALL_STATS))
        if unknown:
            raise ValueError(f"Unknown stat names {unknown}; known: {list(ALL_STATS)}")
        if global_batch_size is not None and global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        self._stat_names = stat_names
        self._throughput = throughput.Throughput(
            global_batch_size, model_flops_per_example, model_flops_per_token, tokens_key,
            peak_flops_per_device, recorder)
        self._created = time.perf_counter()
        self._init_time = self._begin_time = time.time()
        self._loop_start = self._compile_mark = 0.0
        self.compile_secs = 0.0
        """Seconds the last loop spent tracing and compiling (left out of its rates)."""
        self.stats: dict[str, float] = {}
        """Every statistic of the last loop, named or not."""

    def begin(self, state: State, dataset: Iterator[Any]) -> tuple[State, Iterator[Any]]:
        self._begin_time = time.time()
        self._loop_start = time.perf_counter()
        self._compile_mark = goodput.compile_seconds()
        self._throughput.begin()
        return super().begin(state, dataset)

    def _get_next_batch(self, dataset: Iterator[Any]) -> Any:
        if self._throughput.recorder is None:  # no clock read per batch when none is kept
            batch = super()._get_next_batch(dataset)
        else:
            start = time.perf_counter()
            try:
                batch = super()._get_next_batch(dataset)
            finally:
                self._throughput.waited(time.perf_counter() - start)
        self._throughput.read(batch)
        return batch

    def run(self, state: State, dataset: Iterator[Any], num_steps: int | None = None,
            log_num_flops: bool = False, **kwargs: Any) -> tuple[State, Output | None]:
        wants_flops = (STAT_NUM_FLOPS in self._stat_names or self._throughput.wants_xla_flops
                       ) and getattr(self.step, "num_flops", None) is None
        return super().run(state, dataset, num_steps,
                           log_num_flops=log_num_flops or wants_flops, **kwargs)

    def end(self, state: State, outputs: Output | None) -> tuple[State, Output | None]:
        loop_secs = time.perf_counter() - self._loop_start
        self.compile_secs = goodput.compile_seconds() - self._compile_mark
        elapsed = loop_secs - self.compile_secs
        steps_per_sec = self.num_steps_run / elapsed if elapsed > 0 else 0.0
        stats = {STAT_STEPS_PER_SEC: steps_per_sec, STAT_LOOP_TIME_SECS: loop_secs,
                 STAT_COMPILE_SECS: self.compile_secs, STAT_NUM_STEPS: float(self.num_steps_run),
                 STAT_LIFE_TIME_SECS: time.perf_counter() - self._created,
                 STAT_INIT_TIME: self._init_time, STAT_BEGIN_TIME: self._begin_time}
        if self._throughput.global_batch_size is not None:
            stats[STAT_EXAMPLES_PER_SEC] = steps_per_sec * self._throughput.global_batch_size
        for name, attribute in ((STAT_NUM_PARAMS, "num_params"), (STAT_NUM_FLOPS, "num_flops")):
            value = getattr(self.step, attribute, None)  # a plain callable step has neither
            if value is not None:
                stats[name] = float(value)
        stats.update(self._throughput.stats(self.step, elapsed, steps_per_sec,
                                            self.compile_secs))
        self.stats = stats
        outputs = dict(outputs or {})
        outputs.update({k: v for k, v in stats.items()
                        if k in self._stat_names or k not in ALL_STATS})
        return super().end(state, outputs)
