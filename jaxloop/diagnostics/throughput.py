"""Throughput accounting beside a loop: tokens/s, model TFLOP/s per device, MFU and the
goodput split, from what the loop tells it (`StatLoop` builds one from its opt-in arguments)::

    meter = Throughput(global_batch_size=64, model_flops_per_example=3.1e9)
    meter.begin()
    for batch in batches:
        meter.read(batch)
    meter.stats(step, elapsed=2.0, steps_per_sec=50.0, compile_secs=0.0)
    # {'jaxloop/model_tflops_per_sec_per_device': ..., 'jaxloop/mfu': ...}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop.diagnostics import goodput
from jaxloop.launch import agreement

STAT_MFU = "jaxloop/mfu"
STAT_MFU_XLA = "jaxloop/mfu_xla_cost_analysis"
STAT_GOODPUT = "jaxloop/goodput"
STAT_TIME_PREFIX = "jaxloop/time/"
STAT_TOKENS_PER_SEC = "jaxloop/tokens_per_sec"
STAT_MODEL_TFLOPS = "jaxloop/model_tflops_per_sec_per_device"


def token_count(batch: Any, key: str | Sequence[str]) -> Any:
    """The sum of ``batch[key]`` (a token mask or count; `key` may be a path): a device scalar
    for a placed batch (no transfer), else a float of this process's rows::

        token_count({'ids': ids, 'mask': np.array([[1, 1, 0], [1, 0, 0]])}, 'mask')  # 3.0
    """
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


@dataclasses.dataclass
class Throughput:
    """The opt-in throughput figures of one loop at a time.

    Args:
      global_batch_size: examples per step across all processes.
      model_flops_per_example: training flops per example, for ``jaxloop/mfu`` and
        ``jaxloop/model_tflops_per_sec_per_device``, or ``'xla'`` for
        ``jaxloop/mfu_xla_cost_analysis`` from the compiled step.
      model_flops_per_token: training flops per token (``6 * num_params`` for a
        transformer), instead of per example; needs `tokens_key`.
      tokens_key: the batch entry (or path) holding a token mask or count.
      recorder: a `goodput.Recorder`, for the wall-time split since the previous loop.
    """

    global_batch_size: int | None = None
    model_flops_per_example: float | str | None = None
    model_flops_per_token: float | None = None
    tokens_key: str | Sequence[str] | None = None
    peak_flops_per_device: float | None = None
    recorder: Any = None
    _tokens: list[Any] = dataclasses.field(default_factory=list, init=False, repr=False)
    _input_secs: float = dataclasses.field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        flops = self.model_flops_per_example
        if isinstance(flops, str) and flops != "xla":
            raise ValueError(f"model_flops_per_example must be a number or 'xla', got {flops!r}")
        if self.model_flops_per_token is not None and (
            flops is not None or self.tokens_key is None
        ):
            raise ValueError("model_flops_per_token needs tokens_key (the batch entry that "
                             "counts tokens) and excludes model_flops_per_example")
        if self.peak_flops_per_device is not None and not self.peak_flops_per_device > 0:
            raise ValueError(
                f"peak_flops_per_device must be positive, got {self.peak_flops_per_device}")

    @property
    def wants_xla_flops(self) -> bool:
        """Whether MFU is taken from XLA's count of the compiled step's flops."""
        return self.model_flops_per_example == "xla"

    def begin(self) -> None:
        """Starts a loop's count."""
        self._tokens, self._input_secs = [], 0.0

    def waited(self, secs: float) -> None:
        """Counts seconds the loop waited for its input (with a `recorder` only)."""
        self._input_secs += secs
        self.recorder.add("input", secs)

    def read(self, batch: Any) -> None:
        """Counts one batch read."""
        if self.tokens_key is not None:
            self._tokens.append(token_count(batch, self.tokens_key))

    def _flops_per_sec_per_device(self, step: Any, steps_per_sec: float,
                                  tokens_per_sec: float | None) -> tuple[str, float] | None:
        if self.model_flops_per_example == "xla":
            num_flops = getattr(step, "num_flops", None)  # per device
            return (STAT_MFU_XLA, num_flops * steps_per_sec) if num_flops else None
        if self.model_flops_per_token is not None and tokens_per_sec is not None:
            total = self.model_flops_per_token * tokens_per_sec
        elif self.model_flops_per_example is not None and self.global_batch_size is not None:
            total = float(self.model_flops_per_example) * self.global_batch_size * steps_per_sec
        else:
            return None
        partitioner = getattr(step, "partitioner", None)
        devices = partitioner.mesh.devices.size if partitioner is not None else jax.device_count()
        return STAT_MFU, total / devices

    def stats(self, step: Any, elapsed: float, steps_per_sec: float,
              compile_secs: float) -> dict[str, float]:
        """The loop's figures: `elapsed` seconds without compilation, `step` the loop's."""
        stats: dict[str, float] = {}
        tokens_per_sec = None
        if self.tokens_key is not None:
            on_device = [c for c in self._tokens if isinstance(c, jax.Array)]
            host = sum(c for c in self._tokens if not isinstance(c, jax.Array))
            if len(on_device) < len(self._tokens):  # host counts: this process's rows only
                host = agreement.summed([host])[0]
            tokens = float(host) + (float(jnp.sum(jnp.stack(on_device))) if on_device else 0.0)
            tokens_per_sec = tokens / elapsed if elapsed > 0 else 0.0
            stats[STAT_TOKENS_PER_SEC] = tokens_per_sec
        flops = self._flops_per_sec_per_device(step, steps_per_sec, tokens_per_sec)
        if flops is not None:
            name, per_device = flops
            stats[STAT_MODEL_TFLOPS] = per_device / 1e12
            peak = goodput.resolved_peak(self.peak_flops_per_device)
            if peak is not None:
                stats[name] = per_device / peak
        if self.recorder is not None:
            self.recorder.train_loop(elapsed + compile_secs, self._input_secs, compile_secs)
            split = self.recorder.window()
            stats.update({f"{STAT_TIME_PREFIX}{k}_secs": v for k, v in split.items()})
            if split["wall"] > 0:
                stats[STAT_GOODPUT] = split["compute"] / split["wall"]
        return stats
