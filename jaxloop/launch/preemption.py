"""Preemption: stop at the next step boundary on SIGTERM/SIGINT so a checkpoint can be saved,
then end the run with `Preempted` or `Interrupted`, which carry the live ``state``. With
several processes JAX's preemption sync service owns SIGTERM and picks one step for all (a
save is a collective)::

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
_active = 0  # how many `handling_preemption` blocks are open (nested ones share the flags)
_interrupts = 0  # SIGINTs received while active: the first asks to stop; the third raises

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM
# ``extra=`` of the log records announcing a stop, which a notebook leaves out of the cell.
STOP_NOTICE = {"jaxloop_stop_notice": True}


def _saved_text(saved: bool) -> str:
    return "a checkpoint was saved" if saved else "no checkpoint was saved"


class _OneLine:
    """A stop renders as one line in IPython (``_render_traceback_``); scripts get it whole."""

    def __init__(self, state: Any, step: int | None, saved: bool, *args: Any):
        super().__init__(*args)
        self.state, self.step, self.saved = state, step, saved

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: stopped at step {self.step}; {_saved_text(self.saved)}."
                " The live state is the OuterLoop's `.state` (a bare loop's `.stopped_state`,"
                " this exception's `.state`): continue from it."]


class Interrupted(_OneLine, KeyboardInterrupt):
    """Training stopped at a step boundary because of SIGINT (Ctrl-C, a notebook's Stop);
    ``state`` is the live state at ``step``, ``saved`` whether a checkpoint of it was written::

        except preemption.Interrupted as stop:  # around an OuterLoop call
            state = stop.state  # continue later from here
    """

    def __init__(self, state: Any, step: int | None, saved: bool):
        super().__init__(state, step, saved, f"interrupted at step {step}; {_saved_text(saved)}")


class Preempted(_OneLine, SystemExit):
    """Training stopped at a step boundary because of SIGTERM or `request()`: uncaught, the
    process exits with status 143. Attributes as `Interrupted`'s."""

    def __init__(self, state: Any, step: int | None, saved: bool):
        super().__init__(state, step, saved, PREEMPTED_EXIT_CODE)

    def __str__(self) -> str:
        return f"preempted at step {self.step}; {_saved_text(self.saved)} (exit status {self.code})"


def stopped(state: Any, step: int | None, saved: bool) -> Interrupted | Preempted:
    """The exception that ends a run stopped at `step`: `Interrupted` after SIGINT, else
    `Preempted`."""
    return (Interrupted if _interrupts else Preempted)(state, step, saved)


def interrupted() -> bool:
    """Whether this process got SIGINT in a single-process job (an evaluation may then stop
    at its next batch; with several processes all must run the same batches)."""
    return bool(_interrupts) and jax.process_count() == 1


def _multiprocess_sync() -> bool:
    return (jax.process_count() > 1 and jax.distributed.is_initialized()
            and bool(jax.config.jax_enable_preemption_service))


def active() -> bool:
    """Whether preemption handling is on (loops skip the per-step check otherwise)."""
    return _active > 0


def requested() -> bool:
    """Whether training should stop now (several processes: as `reached_sync_point` agreed)."""
    return (_stop if _multiprocess_sync() else _requested).is_set()


def request() -> None:
    """Asks the running loops to stop at the next step boundary (as SIGTERM does)."""
    first = not _requested.is_set()
    _requested.set()
    if first and _multiprocess_sync():
        # JAX's notifier listens for SIGTERM and propagates the notice to all processes.
        os.kill(os.getpid(), signal.SIGTERM)


def reached_sync_point(step: int) -> bool:
    """True at the step where training should save and stop; `step` is the host-side count
    of the step just completed (multi-process: call it at every step on every process)."""
    if _multiprocess_sync():
        from jax.experimental import multihost_utils  # noqa: PLC0415

        if multihost_utils.reached_preemption_sync_point(step):
            _stop.set()
    return requested()


@contextlib.contextmanager
def handling_preemption(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
                        ) -> Iterator[None]:
    """Installs preemption signal handlers for the block (main thread only), restoring the
    previous ones after; a nested block keeps the outer one's."""
    global _active, _interrupts
    previous: dict[int, Any] = {}
    if not _active:
        _requested.clear()
        _stop.clear()
        _interrupts = 0
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                if sig == signal.SIGTERM and _multiprocess_sync():
                    continue  # JAX's preemption notifier handles it and syncs the step.
                previous[sig] = signal.signal(sig, _on_signal)
    _active += 1
    try:
        yield
    finally:
        _active -= 1
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _on_signal(signum: int, frame: Any) -> None:
    global _interrupts
    if signum == signal.SIGINT:
        _interrupts += 1
        if _interrupts >= 3:
            raise KeyboardInterrupt  # the third Ctrl-C: at once, wherever the program is
        if _interrupts == 2:
            log.warning("Still stopping at the next step boundary (press again to interrupt "
                        "at once; the state may then be lost).")
            return
        log.warning("Interrupted: stopping at the next step boundary.", extra=STOP_NOTICE)
    else:
        log.warning("Received signal %d: stopping at the next step boundary.", signum)
    request()
