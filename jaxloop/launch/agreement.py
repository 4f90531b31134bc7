"""Multi-process decisions: made once and taken by every process, on the host.

A decision that gates a collective (is a save due, which checkpoints to read) may not come
from one host's clock or listing. `agreed` takes process 0's answer, `gathered` every
process's value, `summed` counts summed over processes, each in one host exchange through
JAX's coordination service, not a device collective (docs/multihost.md, "Processes that
disagree"). With one process each is a plain call::

    due = agreement.agreed(lambda: clock() - last_save >= every_secs,
                           phase="checkpoint time policy", step=step)
    positions = agreement.gathered(iterator_state(it))  # one per process, in process order
    tokens, examples = agreement.summed([local_tokens, local_examples])
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

__all__ = ["DEFAULT_EXCHANGE_TIMEOUT", "ENV_EXCHANGE_TIMEOUT", "DisagreementError", "agreed",
           "exchange_count", "exchange_timeout", "gathered", "summed"]

T = TypeVar("T")

ENV_EXCHANGE_TIMEOUT = "JAXLOOP_EXCHANGE_TIMEOUT"
# Seconds a process waits for the others at an exchange: room for host work one process
# does alone between two exchanges (process 0 writing summaries), far below "forever".
DEFAULT_EXCHANGE_TIMEOUT = 300.0

_PREFIX = "jaxloop/agreement"
_count = 0  # exchanges this process took part in; every process counts alike


class DisagreementError(RuntimeError):
    """The processes reached different exchanges, or some did not reach this one in time
    (different code on some processes, or one is stuck)."""


def exchange_timeout() -> float:
    """Seconds an exchange waits: ``JAXLOOP_EXCHANGE_TIMEOUT``, else the default."""
    raw = os.environ.get(ENV_EXCHANGE_TIMEOUT, "").strip() or str(DEFAULT_EXCHANGE_TIMEOUT)
    with contextlib.suppress(ValueError):
        if float(raw) > 0:
            return float(raw)
    raise ValueError(f"Environment variable {ENV_EXCHANGE_TIMEOUT}={raw!r} must be a "
                     "positive number of seconds.")


def exchange_count() -> int:
    """How many host exchanges this process has taken part in (none with one process)."""
    return _count


def gathered(value: Any, *, phase: str = "gathered values", step: int | None = None
             ) -> list[Any]:
    """Every process's `value` (JSON-serialisable), in process order, on every process;
    `phase` and `step` name this place in the error a disagreement raises."""
    global _count
    if jax.process_count() == 1:
        return [value]
    # JAX 0.10 has no public accessor for the coordination service's key-value store: this
    # is the client multihost_utils uses, and the one place that takes it.
    from jax.experimental import multihost_utils  # noqa: PLC0415
    client = multihost_utils.distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"{jax.process_count()} processes but no coordination service: start the job "
            "with jax.distributed.initialize (or jaxloop.launch.distributed.initialize).")
    me, timeout = jax.process_index(), exchange_timeout()
    index, where = _count, phase if step is None else f"{phase} at step {step}"
    _count += 1
    key = f"{_PREFIX}/{index}/"
    client.key_value_set(f"{key}{me}", json.dumps({"at": where, "value": value}))
    try:
        client.wait_at_barrier(f"{_PREFIX}/barrier/{index}", int(timeout * 1000))
    except jax.errors.JaxRuntimeError as e:
        arrived = {int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(key)}
        missing = sorted(set(range(jax.process_count())) - arrived)
        late = (f"process(es) {missing} did not arrive (they run something this process does "
                "not, or are stuck)" if missing else "the others stopped waiting before it came")
        raise DisagreementError(
            f"Process {me} waited {timeout:g} s for the other processes at '{where}' "
            f"(exchange {index}); {late}. See 'What an action may compute' in "
            f"docs/multihost.md; {ENV_EXCHANGE_TIMEOUT} sets the wait.") from e
    entries = {int(k.rsplit("/", 1)[-1]): json.loads(v) for k, v in client.key_value_dir_get(key)}
    if me == 0 and index:
        client.key_value_delete(f"{_PREFIX}/{index - 1}/")  # every process has read it
    if len({entry["at"] for entry in entries.values()}) > 1:
        detail = "; ".join(f"process {p} at '{entries[p]['at']}'" for p in sorted(entries))
        raise DisagreementError(
            f"The processes parted at exchange {index}: {detail}. Every process must run the "
            "same exchanges and collectives (docs/multihost.md, 'What an action may compute').")
    return [entries[p]["value"] for p in sorted(entries)]


def agreed(decide: Callable[[], T], *, phase: str = "agreed decision",
           step: int | None = None) -> T:
    """Process 0's ``decide()`` (JSON-serialisable) on every process; others do not call it."""
    return gathered(decide() if jax.process_index() == 0 else None, phase=phase, step=step)[0]


def summed(counts: Sequence[float], dtype: Any = np.float64, *, phase: str = "summed counts",
           step: int | None = None) -> list[Any]:
    """`counts` summed position-wise over every process (as `dtype`), on every process."""
    rows = gathered(np.asarray(counts, dtype).reshape(-1).tolist(), phase=phase, step=step)
    return np.asarray(rows, dtype).sum(axis=0).tolist()
