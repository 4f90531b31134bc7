"""Multi-process decisions: made once and taken by every process.

A decision that gates a collective (is a save due, which checkpoints to read) may not come
from one host's clock or listing. `agreed` takes process 0's answer, `gathered` every
process's value, `summed` counts summed over processes. Each is one collective that every
process must call at the same point; with one process, a plain call.

Example::

    due = agreement.agreed(lambda: clock() - last_save >= every_secs)
    positions = agreement.gathered(iterator_state(it))  # one per process, in process order
    tokens, examples = agreement.summed([local_tokens, local_examples])
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

T = TypeVar("T")

# Values travel as JSON bytes padded to a power of two at least this long: each padded
# length is its own compiled gather, so a listing that grows by a step compiles none.
_MIN_BYTES = 64


def gathered(value: Any) -> list[Any]:
    """Every process's `value` (JSON-serialisable; tuples come back as lists), in process
    order, on every process."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils  # noqa: PLC0415

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(data.size))).reshape(-1)
    width = max(_MIN_BYTES, 1 << int(sizes.max() - 1).bit_length())
    padded = np.zeros(width, np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, sizes, strict=True)]


def agreed(decide: Callable[[], T]) -> T:
    """Process 0's ``decide()`` (JSON-serialisable) on every process; others do not call it."""
    return gathered(decide() if jax.process_index() == 0 else None)[0]


def summed(counts: Sequence[float], dtype: Any = np.float64) -> list[Any]:
    """Each of this process's `counts` summed with the same position's count of every
    process (as `dtype`), on every process: one collective; with one process, `counts`."""
    if jax.process_count() == 1:
        return list(counts)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    local = np.asarray(counts, dtype).reshape(-1)
    return np.asarray(multihost_utils.process_allgather(local)).sum(axis=0).tolist()
