"""Preemption: stop at the next step boundary on SIGTERM/SIGINT so a checkpoint can be saved.

`OuterLoop` installs the handlers while it trains (`handling_preemption`), loops ask
`reached_sync_point(step)` between steps, and the outer loop then saves, flushes and returns
with `OuterLoop.preempted` set.

With several JAX processes, every process must save the same step. JAX's distributed runtime
runs a preemption sync service (it owns SIGTERM there): when any process is notified, all
agree on a common step, and `reached_sync_point` is True for exactly that step everywhere.
On one process a Python signal handler sets a flag and the next step boundary stops.

Example::

    with preemption.handling_preemption():
        for step in range(start, total):
            train_one_step()
            if preemption.reached_sync_point(step):
                save(step)
                break
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

import jax

log = logging.getLogger(__name__)

_requested = threading.Event()
_active = False


def _multiprocess_sync() -> bool:
    # The sync manager exists only after jax.distributed.initialize (private to jax; fall
    # back to the local flag if its location ever changes).
    from jax._src import distributed  # noqa: PLC0415

    manager = getattr(distributed.global_state, "preemption_sync_manager", None)
    return manager is not None and jax.process_count() > 1


def active() -> bool:
    """Whether preemption handling is on (loops skip the per-step check otherwise)."""
    return _active


def requested() -> bool:
    """Whether this process received a preemption signal."""
    return _requested.is_set()


def request() -> None:
    """Asks the running loops to stop at the next step boundary (as SIGTERM does)."""
    _requested.set()


def reached_sync_point(step: int) -> bool:
    """True at the step where training should save and stop.

    `step` is the training step just completed (a host-side count: no device sync).
    """
    if _multiprocess_sync():
        from jax.experimental import multihost_utils  # noqa: PLC0415

        return bool(multihost_utils.reached_preemption_sync_point(step)) or _requested.is_set()
    return _requested.is_set()


@contextlib.contextmanager
def handling_preemption(
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
) -> Iterator[None]:
    """Installs preemption signal handlers for the duration of the block.

    Handlers can only be installed from the main thread; elsewhere (or for SIGTERM when JAX's
    multi-process preemption service owns it) the block runs without them, and `request()`
    still works. Previous handlers are restored on exit.
    """
    global _active
    _requested.clear()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            if sig == signal.SIGTERM and _multiprocess_sync():
                continue  # JAX's preemption notifier handles it and syncs the step.
            previous[sig] = signal.signal(sig, _on_signal)
    _active = True
    try:
        yield
    finally:
        _active = False
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _on_signal(signum: int, frame: Any) -> None:
    if _requested.is_set() and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C interrupts at once
    log.warning("Received signal %d: saving a checkpoint at the next step boundary.", signum)
    _requested.set()
