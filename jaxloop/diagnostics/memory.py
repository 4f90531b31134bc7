"""Memory estimates before launch: what a compiled step needs on each device.

`estimate(step, spec)` compiles a step for an abstract state and batch (nothing is
allocated) and returns a `MemoryEstimate` from XLA's memory analysis of the per-device
program, so a job that would not fit is found before it is scheduled::

    estimate = memory.estimate(train_step, {'image': [256, 28, 28, 1],
                                            'label': ([256], 'int32')})
    if estimate.fits is False:
        raise SystemExit(str(estimate))
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import numpy as np

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(num: int | float, decimals: int = 2) -> str:
    """Bytes in binary units: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    value = float(num)
    for unit in _UNITS[:-1]:
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.{decimals}f} {unit}"
        value /= 1024
    return f"{value:.{decimals}f} {_UNITS[-1]}"


def live_device_bytes() -> int:
    """The bytes the devices hold in live arrays (`jax.live_arrays`), each buffer once.

    An array donated while it is read (from another thread) counts as freed.
    """
    buffers = {}
    for x in jax.live_arrays():
        with contextlib.suppress(RuntimeError, TypeError):  # deleted or donated meanwhile
            buffers.update({(s.device.id, s.data.unsafe_buffer_pointer()): s.data.nbytes
                            for s in x.addressable_shards})
    return sum(buffers.values())


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of a compiled step, from XLA's memory analysis.

    Attributes:
      alias_bytes: the part of the outputs written into donated argument buffers, counted
        once in `total_bytes`.
      temp_bytes: temporaries XLA allocates while the step runs (activations, gradients).
      peak_bytes: XLA's own peak figure where reported (not shown by `str`: on CPU it
        leaves out the temporaries).
      bytes_limit: memory of one device where the backend reports it (GPU, TPU).
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int = 0
    peak_bytes: int | None = None
    num_devices: int = 1
    device_kind: str = ""
    bytes_limit: int | None = None

    @property
    def total_bytes(self) -> int:
        """Arguments + outputs - aliased outputs + temporaries: an upper bound of what one
        device holds while the step runs."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool | None:
        """Whether `total_bytes` fits in one device's memory; None where it is unknown."""
        return None if self.bytes_limit is None else self.total_bytes <= self.bytes_limit

    @classmethod
    def from_compiled(cls, compiled: Any, devices: Any = None) -> MemoryEstimate:
        """The estimate of a `jax.stages.Compiled` that runs on `devices` (default: all);
        RuntimeError where the backend gives no memory analysis."""
        stats = compiled.memory_analysis()
        if isinstance(stats, list | tuple):
            stats = stats[0] if stats else None
        if stats is None:
            raise RuntimeError(
                f"XLA gives no memory analysis on this backend ({jax.default_backend()}); "
                "estimate on a machine of the target kind")
        devices = jax.devices() if devices is None else list(np.ravel(devices))
        local = [d for d in devices if d.process_index == jax.process_index()] or devices
        try:
            memory = local[0].memory_stats()
        except Exception:  # noqa: BLE001 (backends without memory stats raise)
            memory = None
        limit = memory.get("bytes_limit") if memory else None
        peak = getattr(stats, "peak_memory_in_bytes", 0)
        return cls(
            argument_bytes=int(stats.argument_size_in_bytes),
            output_bytes=int(stats.output_size_in_bytes),
            alias_bytes=int(stats.alias_size_in_bytes), temp_bytes=int(stats.temp_size_in_bytes),
            generated_code_bytes=int(stats.generated_code_size_in_bytes),
            peak_bytes=int(peak) if peak else None, num_devices=len(devices),
            device_kind=local[0].device_kind, bytes_limit=int(limit) if limit else None)

    def __str__(self) -> str:
        rows = [
            ("arguments", self.argument_bytes, ""),
            ("outputs", self.output_bytes,
             f" ({format_bytes(self.alias_bytes)} reuse donated arguments)"
             if self.alias_bytes else ""),
            ("temporaries", self.temp_bytes, ""),
            ("total", self.total_bytes, ""),
        ]
        if self.bytes_limit:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            rows.append(("device memory", self.bytes_limit, f" ({verdict})"))
        kind = f" {self.device_kind}" if self.device_kind else ""
        plural = "" if self.num_devices == 1 else "s"
        lines = [f"Memory per device ({self.num_devices}{kind} device{plural}, XLA estimate):"]
        lines += [f"  {name:<13} {format_bytes(value):>12}{note}" for name, value, note in rows]
        return "\n".join(lines)


def estimate(step: Any, spec: Any, state: Any = None, **kwargs: Any) -> MemoryEstimate:
    """What one device needs to run `step` (a `jaxloop.step.Step`) on a global batch of
    `spec` as a loop runs it; `state` defaults to the abstract state of `spec`, `kwargs` go
    to `run`.

    Example::

        estimate(step, {'image': [256, 28, 28, 1], 'label': ([256], 'int32')},
                 step.abstract_state([1, 28, 28, 1]))
    """
    if state is None:
        state = step.abstract_state(spec, remember=False)
    with step.donating_state():  # as a loop runs it
        program = step.program()
    compiled = program.lower(state, step.abstract_batch(spec), **kwargs).compile()
    return MemoryEstimate.from_compiled(compiled, step.partitioner.mesh.devices)
