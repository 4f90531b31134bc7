"""Preemption: stop at the next step boundary on SIGTERM/SIGINT so a checkpoint can be saved.

`OuterLoop` installs the handlers while it trains (`handling_preemption`), loops ask
`reached_sync_point(step)` between steps, and the outer loop then saves, flushes and returns
with `OuterLoop.preempted` set.

With several JAX processes, every process must stop at the same step: a checkpoint save is
a collective, so a process that stopped alone would leave the others waiting in their next
step's all-reduce. A notice (SIGTERM, SIGINT or `request()`) may reach any one process, so
the decision is never a local flag: JAX's preemption sync service (started by
`jax.distributed.initialize`) owns SIGTERM, shares a notice with every process through the
coordination service and picks one step for all (the highest step any process has
reported, plus one); `reached_sync_point` is True for exactly that step everywhere. SIGINT
and `request()` are handed to that same service (the process sends itself SIGTERM). With one
process a Python signal handler sets a flag and the next step boundary stops.

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
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import jax

log = logging.getLogger(__name__)

_requested = threading.Event()  # this process received a notice
_stop = threading.Event()  # the decision to stop (multi-process: agreed at the sync point)
_active = False


def _multiprocess_sync() -> bool:
    """Whether JAX's preemption sync service decides (a multi-process job with it on)."""
    return (
        jax.process_count() > 1
        and jax.distributed.is_initialized()
        and bool(jax.config.jax_enable_preemption_service)
    )


def active() -> bool:
    """Whether preemption handling is on (loops skip the per-step check otherwise)."""
    return _active


def requested() -> bool:
    """Whether training should stop now.

    With one process: a preemption signal or `request()` arrived. With several: all
    processes agreed on this step (a notice that reached only this process is not yet a
    decision; `reached_sync_point` turns it into one at the same step everywhere).
    """
    if _multiprocess_sync():
        return _stop.is_set()
    return _requested.is_set()


def request() -> None:
    """Asks the running loops to stop at the next step boundary (as SIGTERM does).

    In a multi-process job every process then stops at the same step, whichever process
    asked.
    """
    _notice()


def _notice() -> None:
    first = not _requested.is_set()
    _requested.set()
    if first and _multiprocess_sync():
        # JAX's notifier listens for SIGTERM and propagates the notice to all processes.
        os.kill(os.getpid(), signal.SIGTERM)


def reached_sync_point(step: int) -> bool:
    """True at the step where training should save and stop.

    `step` is the training step just completed (a host-side count: no device sync). In a
    multi-process job call it at every step with increasing steps, on every process.
    """
    if _multiprocess_sync():
        from jax.experimental import multihost_utils  # noqa: PLC0415

        if multihost_utils.reached_preemption_sync_point(step):
            _stop.set()
        return _stop.is_set()
    return _requested.is_set()


@contextlib.contextmanager
def handling_preemption(
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
) -> Iterator[None]:
    """Installs preemption signal handlers for the duration of the block.

    Handlers can only be installed from the main thread; elsewhere the block runs without
    them, and `request()` still works. In a multi-process job SIGTERM stays with JAX's
    preemption service. Previous handlers are restored on exit.
    """
    global _active
    _requested.clear()
    _stop.clear()
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
    _notice()
