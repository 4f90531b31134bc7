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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop import loop as loop_lib
from jaxloop import types
from jaxloop.diagnostics import goodput
from jaxloop.engine import staging
from jaxloop.launch import agreement

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
STAT_COMPILE_SECS = "jaxloop/compile_secs"

ALL_STATS = (STAT_STEPS_PER_SEC, STAT_EXAMPLES_PER_SEC, STAT_LOOP_TIME_SECS, STAT_NUM_STEPS,
             STAT_NUM_PARAMS, STAT_NUM_FLOPS, STAT_LIFE_TIME_SECS, STAT_COMPILE_SECS)
# As google/jaxloop: the outputs hold no statistics unless asked; `StatLoop.stats` has all.
DEFAULT_STATS: tuple[str, ...] = ()

# Opt-in: reported when StatLoop is given model flops, a recorder or `tokens_key`.
STAT_MFU = "jaxloop/mfu"
STAT_MFU_XLA = "jaxloop/mfu_xla_cost_analysis"
STAT_GOODPUT = "jaxloop/goodput"
STAT_TIME_PREFIX = "jaxloop/time/"
STAT_TOKENS_PER_SEC = "jaxloop/tokens_per_sec"
STAT_MODEL_TFLOPS = "jaxloop/model_tflops_per_sec_per_device"


def token_count(batch: Any, key: str | Sequence[str]) -> Any:
    """The tokens a batch holds: the sum of ``batch[key]`` (a token mask or a count);
    `key` may be a path into nested mappings. A device scalar for a placed batch (no
    transfer), else a float of this process's rows.

    Example::

        token_count({'ids': ids, 'mask': np.array([[1, 1, 0], [1, 0, 0]])}, 'mask')  # 3.0
    """
    if isinstance(batch, staging.PreparedBatch):  # prefetched: preprocessed and placed
        batch = batch.batch
    value = batch
    for part in (key,) if isinstance(key, str) else tuple(key):
        if not isinstance(value, Mapping) or part not in value:
            keys = sorted(map(str, value)) if isinstance(value, Mapping) else type(value).__name__
            raise ValueError(f"tokens_key {key!r}: the batch has no entry {part!r} (a token "
                             f"mask or count); there it holds {keys}")
        value = value[part]
    if isinstance(value, jax.Array):
        return jnp.sum(value, dtype=jnp.float32)
    return float(np.sum(value))


class StatLoop(loop_lib.Loop):
    """Measures each loop: `stats` holds its `jaxloop/...` statistics (plain floats), and
    the outputs hold those named in `stat_names` and the opt-in ones asked for.

    Args:
      stat_names: which of `ALL_STATS` to add to the outputs (none by default).
      global_batch_size: examples per step across all processes, for examples/s.
      model_flops_per_example: training flops per example, for ``jaxloop/mfu`` and
        ``jaxloop/model_tflops_per_sec_per_device`` (needs `global_batch_size`), or
        ``'xla'`` for ``jaxloop/mfu_xla_cost_analysis`` from the compiled step. MFU needs
        the device's peak (`jaxloop.diagnostics.goodput`, or `peak_flops_per_device`).
      model_flops_per_token: training flops per token (``6 * num_params`` for a
        transformer), instead of per example; needs `tokens_key`.
      tokens_key: the batch entry (or path) holding a token mask or count
        (`token_count`), to report ``jaxloop/tokens_per_sec`` over all processes.
      recorder: a `goodput.Recorder`, to report the wall-time split since the previous
        loop (``jaxloop/time/*_secs``, ``jaxloop/goodput``).
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
        self._global_batch_size = global_batch_size
        if isinstance(model_flops_per_example, str) and model_flops_per_example != "xla":
            raise ValueError(f"model_flops_per_example must be a number or 'xla', got "
                             f"{model_flops_per_example!r}")
        if model_flops_per_token is not None and (
            model_flops_per_example is not None or tokens_key is None
        ):
            raise ValueError("model_flops_per_token needs tokens_key (the batch entry that "
                             "counts tokens) and excludes model_flops_per_example")
        if peak_flops_per_device is not None and not peak_flops_per_device > 0:
            raise ValueError(
                f"peak_flops_per_device must be positive, got {peak_flops_per_device}")
        self._model_flops = model_flops_per_example
        self._flops_per_token = model_flops_per_token
        self._tokens_key = tokens_key
        self._peak = peak_flops_per_device
        self._tokens: list[Any] = []
        self._recorder = recorder
        self._created = time.perf_counter()
        self._loop_start = self._input_secs = self._compile_mark = 0.0
        self.compile_secs = 0.0
        """Seconds the last loop spent tracing and compiling (left out of its rates)."""
        self.stats: dict[str, float] = {}
        """Every statistic of the last loop, named or not."""

    def begin(self, state: State, dataset: Iterator[Any]) -> tuple[State, Iterator[Any]]:
        self._loop_start = time.perf_counter()
        self._tokens = []
        self._input_secs, self._compile_mark = 0.0, goodput.compile_seconds()
        return super().begin(state, dataset)

    def _get_next_batch(self, dataset: Iterator[Any]) -> Any:
        if self._recorder is None:
            batch = super()._get_next_batch(dataset)
        else:
            start = time.perf_counter()
            try:
                batch = super()._get_next_batch(dataset)
            finally:
                waited = time.perf_counter() - start
                self._input_secs += waited
                self._recorder.add("input", waited)
        if self._tokens_key is not None:
            self._tokens.append(token_count(batch, self._tokens_key))
        return batch

    def _total_tokens(self) -> float:
        """The tokens of the batches read, over all processes."""
        on_device = [c for c in self._tokens if isinstance(c, jax.Array)]
        host = sum(c for c in self._tokens if not isinstance(c, jax.Array))
        if len(on_device) < len(self._tokens):
            host = agreement.summed([host])[0]
        return float(host) + (float(jnp.sum(jnp.stack(on_device))) if on_device else 0.0)

    def _num_devices(self) -> int:
        partitioner = getattr(self.step, "partitioner", None)
        return partitioner.mesh.devices.size if partitioner is not None else jax.device_count()

    def run(self, state: State, dataset: Iterator[Any], num_steps: int | None = None,
            log_num_flops: bool = False, **kwargs: Any) -> tuple[State, Output | None]:
        wants_flops = (STAT_NUM_FLOPS in self._stat_names or self._model_flops == "xla"
                       ) and getattr(self.step, "num_flops", None) is None
        return super().run(state, dataset, num_steps,
                           log_num_flops=log_num_flops or wants_flops, **kwargs)

    def _stats(self, num_steps: int) -> dict[str, float]:
        loop_secs = time.perf_counter() - self._loop_start
        self.compile_secs = goodput.compile_seconds() - self._compile_mark
        elapsed = loop_secs - self.compile_secs
        steps_per_sec = num_steps / elapsed if elapsed > 0 else 0.0
        stats = {STAT_STEPS_PER_SEC: steps_per_sec, STAT_LOOP_TIME_SECS: loop_secs,
                 STAT_COMPILE_SECS: self.compile_secs, STAT_NUM_STEPS: float(num_steps),
                 STAT_LIFE_TIME_SECS: time.perf_counter() - self._created}
        if self._global_batch_size is not None:
            stats[STAT_EXAMPLES_PER_SEC] = steps_per_sec * self._global_batch_size
        # A plain callable step has neither.
        num_params = getattr(self.step, "num_params", None)
        num_flops = getattr(self.step, "num_flops", None)
        if num_params is not None:
            stats[STAT_NUM_PARAMS] = float(num_params)
        if num_flops is not None:
            stats[STAT_NUM_FLOPS] = float(num_flops)
        tokens_per_sec = None
        if self._tokens_key is not None:
            tokens_per_sec = self._total_tokens() / elapsed if elapsed > 0 else 0.0
            stats[STAT_TOKENS_PER_SEC] = tokens_per_sec
        if (self._model_flops is not None or self._flops_per_token is not None
                or self._recorder is not None):
            stats.update(self._goodput_stats(elapsed, steps_per_sec, tokens_per_sec))
        return stats

    def _flops_per_sec_per_device(self, steps_per_sec: float,
                                  tokens_per_sec: float | None) -> tuple[str, float] | None:
        if self._model_flops == "xla":
            # `num_flops` is per device.
            if self.step.num_flops:
                return STAT_MFU_XLA, self.step.num_flops * steps_per_sec
            return None
        if self._flops_per_token is not None and tokens_per_sec is not None:
            total = self._flops_per_token * tokens_per_sec
        elif self._model_flops is not None and self._global_batch_size is not None:
            total = float(self._model_flops) * self._global_batch_size * steps_per_sec
        else:
            return None
        return STAT_MFU, total / self._num_devices()

    def _goodput_stats(self, elapsed: float, steps_per_sec: float,
                       tokens_per_sec: float | None) -> dict[str, float]:
        stats: dict[str, float] = {}
        flops = self._flops_per_sec_per_device(steps_per_sec, tokens_per_sec)
        if flops is not None:
            name, per_device = flops
            stats[STAT_MODEL_TFLOPS] = per_device / 1e12
            peak = goodput.resolved_peak(self._peak)
            if peak is not None:
                stats[name] = per_device / peak
        if self._recorder is not None:
            self._recorder.train_loop(elapsed + self.compile_secs, self._input_secs,
                                      self.compile_secs)
            split = self._recorder.window()
            stats.update({f"{STAT_TIME_PREFIX}{k}_secs": v for k, v in split.items()})
            if split["wall"] > 0:
                stats[STAT_GOODPUT] = split["compute"] / split["wall"]
        return stats

    def end(self, state: State, outputs: Output | None) -> tuple[State, Output | None]:
        outputs = dict(outputs or {})
        self.stats = self._stats(self.num_steps_run)
        outputs.update({k: v for k, v in self.stats.items()
                        if k in self._stat_names or k not in ALL_STATS})
        return super().end(state, outputs)
