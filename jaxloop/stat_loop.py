"""StatLoop: a Loop that also reports timing and size statistics in its outputs.

Statistics are measured at the loop's end, where the loop waits for its last step anyway
(an action boundary), so they cost no per-step synchronisation.

Example::

    loop = StatLoop(step, global_batch_size=256)
    state, outputs = loop(state, batches, num_steps=100)
    outputs[STAT_STEPS_PER_SEC], outputs[STAT_EXAMPLES_PER_SEC]
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from jaxloop import loop as loop_lib
from jaxloop import types

Output = types.Output
State = types.TrainState

STAT_PREFIX = "jaxloop"
STAT_STEPS_PER_SEC = "jaxloop/steps_per_sec"
STAT_EXAMPLES_PER_SEC = "jaxloop/examples_per_sec"
STAT_LOOP_TIME_SECS = "jaxloop/loop_time_secs"
STAT_NUM_STEPS = "jaxloop/num_steps"
STAT_NUM_PARAMS = "jaxloop/num_params"
STAT_NUM_FLOPS = "jaxloop/num_flops"
STAT_LIFE_TIME_SECS = "jaxloop/life_time_secs"

ALL_STATS = (
    STAT_STEPS_PER_SEC,
    STAT_EXAMPLES_PER_SEC,
    STAT_LOOP_TIME_SECS,
    STAT_NUM_STEPS,
    STAT_NUM_PARAMS,
    STAT_NUM_FLOPS,
    STAT_LIFE_TIME_SECS,
)
DEFAULT_STATS = (STAT_STEPS_PER_SEC, STAT_EXAMPLES_PER_SEC, STAT_LOOP_TIME_SECS)

# Opt-in (see `jaxloop.goodput`): reported when StatLoop is given model flops / a recorder.
STAT_MFU = "jaxloop/mfu"
STAT_MFU_XLA = "jaxloop/mfu_xla_cost_analysis"
STAT_GOODPUT = "jaxloop/goodput"
STAT_TIME_PREFIX = "jaxloop/time/"


class StatLoop(loop_lib.Loop):
    """Adds `jaxloop/...` statistics (plain floats) to the loop outputs.

    Args:
      step: the Step to run.
      stat_names: which statistics to report (see `ALL_STATS`); the defaults are steps/s,
        examples/s (when `global_batch_size` is known) and the loop time.
      global_batch_size: examples per step across all processes, for examples/s.
      max_steps_in_flight: see `Loop`.
      steps_per_execution / unroll: steps per compiled call and how they compile, see
        `Loop`.
      model_flops_per_example: training flops per example (forward and backward) to report
        ``jaxloop/mfu`` (needs `global_batch_size`), or ``'xla'`` for
        ``jaxloop/mfu_xla_cost_analysis`` from XLA's cost analysis of the compiled step;
        left out where the device's peak is unknown (see `jaxloop.goodput`).
      recorder: a `goodput.Recorder`: the loop times its input waits and its steps and
        reports the wall-time split since the previous loop (``jaxloop/time/*_secs``,
        ``jaxloop/goodput``).
    """

    def __init__(
        self,
        step: Any,
        stat_names: Sequence[str] | None = None,
        global_batch_size: int | None = None,
        max_steps_in_flight: int | None = None,
        steps_per_execution: int | str = 1,
        unroll: int | bool = 1,
        model_flops_per_example: float | str | None = None,
        recorder: Any = None,
        donate_input_state: bool = False,
    ):
        super().__init__(
            step,
            max_steps_in_flight=max_steps_in_flight,
            steps_per_execution=steps_per_execution,
            unroll=unroll,
            donate_input_state=donate_input_state,
        )
        stat_names = DEFAULT_STATS if stat_names is None else tuple(stat_names)
        unknown = sorted(set(stat_names) - set(ALL_STATS))
        if unknown:
            raise ValueError(f"Unknown stat names {unknown}; known: {list(ALL_STATS)}")
        if global_batch_size is not None and global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        self._stat_names = stat_names
        self._global_batch_size = global_batch_size
        if isinstance(model_flops_per_example, str) and model_flops_per_example != "xla":
            raise ValueError(
                f"model_flops_per_example must be a number or 'xla', got "
                f"{model_flops_per_example!r}"
            )
        self._model_flops = model_flops_per_example
        self._recorder = recorder
        self._created = time.perf_counter()
        self._loop_start = 0.0
        self._input_secs = 0.0
        self._compile_mark = 0.0

    def begin(self, state: State, dataset: Iterator[Any]) -> tuple[State, Iterator[Any]]:
        self._loop_start = time.perf_counter()
        if self._recorder is not None:
            from jaxloop import goodput  # noqa: PLC0415

            self._input_secs, self._compile_mark = 0.0, goodput.compile_seconds()
        return super().begin(state, dataset)

    def _get_next_batch(self, dataset: Iterator[Any]) -> Any:
        if self._recorder is None:
            return super()._get_next_batch(dataset)
        start = time.perf_counter()
        try:
            return super()._get_next_batch(dataset)
        finally:
            waited = time.perf_counter() - start
            self._input_secs += waited
            self._recorder.add("input", waited)

    def run(
        self,
        state: State,
        dataset: Iterator[Any],
        num_steps: int | None = None,
        log_num_flops: bool = False,
        **kwargs: Any,
    ) -> tuple[State, Output | None]:
        wants_flops = (
            STAT_NUM_FLOPS in self._stat_names or self._model_flops == "xla"
        ) and getattr(self.step, "num_flops", None) is None
        state, outputs = super().run(
            state, dataset, num_steps, log_num_flops=log_num_flops or wants_flops, **kwargs
        )
        # The timing covers the device work, so wait for the last step (loop boundary).
        jax.block_until_ready((state, outputs))
        return state, outputs

    def _stats(self, num_steps: int) -> dict[str, float]:
        elapsed = time.perf_counter() - self._loop_start
        steps_per_sec = num_steps / elapsed if elapsed > 0 else 0.0
        stats = {
            STAT_STEPS_PER_SEC: steps_per_sec,
            STAT_LOOP_TIME_SECS: elapsed,
            STAT_NUM_STEPS: float(num_steps),
            STAT_LIFE_TIME_SECS: time.perf_counter() - self._created,
        }
        if self._global_batch_size is not None:
            stats[STAT_EXAMPLES_PER_SEC] = steps_per_sec * self._global_batch_size
        # A plain step object (the reference's loops accept any callable) has neither.
        num_params = getattr(self.step, "num_params", None)
        num_flops = getattr(self.step, "num_flops", None)
        if num_params is not None:
            stats[STAT_NUM_PARAMS] = float(num_params)
        if num_flops is not None:
            stats[STAT_NUM_FLOPS] = float(num_flops)
        stats = {k: v for k, v in stats.items() if k in self._stat_names}
        if self._model_flops is not None or self._recorder is not None:
            stats.update(self._goodput_stats(elapsed, steps_per_sec))
        return stats

    def _goodput_stats(self, elapsed: float, steps_per_sec: float) -> dict[str, float]:
        from jaxloop import goodput  # noqa: PLC0415

        stats: dict[str, float] = {}
        if self._model_flops == "xla" and self.step.num_flops:
            # `num_flops` is per device (the compiled program's), as `mfu`'s argument.
            value = goodput.mfu(self.step.num_flops * steps_per_sec)
            if value is not None:
                stats[STAT_MFU_XLA] = value
        elif self._model_flops is not None and self._global_batch_size is not None:
            per_device = (
                float(self._model_flops) * self._global_batch_size * steps_per_sec
                / jax.device_count()
            )
            value = goodput.mfu(per_device)
            if value is not None:
                stats[STAT_MFU] = value
        if self._recorder is not None:
            compiled = goodput.compile_seconds() - self._compile_mark
            self._recorder.train_loop(elapsed, self._input_secs, compiled)
            split = self._recorder.window()
            stats.update({f"{STAT_TIME_PREFIX}{k}_secs": v for k, v in split.items()})
            if split["wall"] > 0:
                stats[STAT_GOODPUT] = split["compute"] / split["wall"]
        return stats

    def end(self, state: State, outputs: Output | None) -> tuple[State, Output | None]:
        outputs = dict(outputs or {})
        outputs.update(self._stats(self.num_steps_run))
        return super().end(state, outputs)
