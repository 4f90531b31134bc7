"""Multi-process (multi-host) start-up: one call before any other JAX work.

`initialize` connects this process to the others through JAX's distributed runtime (a
coordination service run by process 0). Afterwards ``jax.devices()`` lists the devices of
every process, ``jax.process_index()`` says which process this is, and jaxloop's partitioners,
`data.GlobalBatchDataset` and orbax checkpoints work across processes.

Arguments not given are read from the environment:

- ``JAXLOOP_COORDINATOR``: ``HOST:PORT`` of process 0's coordination service.
- ``JAXLOOP_NUM_PROCESSES``: the number of processes.
- ``JAXLOOP_PROCESS_ID``: this process's index, ``0 .. num_processes - 1``.
- ``JAXLOOP_HEARTBEAT_TIMEOUT``: seconds without a heartbeat after which a process is
  declared dead (default 100, JAX's default).
- ``JAXLOOP_SHUTDOWN_TIMEOUT``: seconds a finishing process waits at exit for the others to
  finish too (default 300, JAX's default).
- ``JAXLOOP_INIT_TIMEOUT``: seconds to keep trying to reach the coordinator (default 300).

Values still missing are left to JAX, which detects them from the cluster (Cloud TPU pods,
SLURM, Open MPI, mpi4py, Kubernetes indexed Jobs and JobSets with the ``kubernetes`` package
installed, see docs/multihost.md); with none of the three given anywhere this is
``jax.distributed.initialize()`` with no address. With ``num_processes=1`` and no coordinator
there is nothing to connect and the call does nothing.

On CPU, JAX's cross-process collectives default to gloo (TCP) since jax 0.5.1, which makes
multi-process CPU training work on one machine or several; a ``jax_cpu_collectives_implementation``
set by the user (e.g. ``'mpi'``) is left alone.

Only JAX's public API is used. What that costs: JAX offers no way to read the coordinator
address of a runtime it is already running, so a repeated call can only be checked against
the address given to this module (not one JAX detected, nor one of a runtime that someone
else started); the process count and id are checked against ``jax.process_count()`` and
``jax.process_index()``.

Failure handling (measured with jax 0.10 on CPU/gloo): every process sends heartbeats to the
coordination service in process 0, and polls it for errors. A dead peer ends the job instead
of leaving the others blocked forever:

- a process other than 0 dies (killed, segfault, machine lost): collectives waiting on it do
  not fail by themselves (gloo keeps waiting), but after ``heartbeat_timeout_seconds`` without
  its heartbeats the service declares it dead and every other process aborts (SIGABRT; a
  shell reports exit status 134) with the log line "Terminating process because the JAX
  distributed service detected fatal errors ... tasks are unhealthy (stopped sending
  heartbeats)";
- process 0 dies: the others' error polling loses its connection and they abort at once
  (0.1 s measured after ``kill -9``; on a cut network, when their heartbeats time out);
- a process ends early but cleanly (a Python exception, ``sys.exit``): at exit it waits at
  JAX's shutdown barrier, which times out after ``shutdown_timeout_seconds`` and aborts the
  others the same way.

So a failure ends every process within about ``heartbeat_timeout_seconds`` (dead process) or
``shutdown_timeout_seconds`` (early exit). The aborting processes run no ``finally`` blocks or
exit handlers; orbax writes checkpoints atomically, so the last finished checkpoint stays
valid and the next run resumes from it. A process that is alive but stuck (deadlocked Python,
a hung filesystem) still sends heartbeats and is not detected; use a job-level timeout for
that. The defaults are JAX's (100 s and 300 s), sized for large clusters where a slow host or
a long checkpoint write must not be mistaken for a dead one; tests and small jobs can use tens
of seconds (``JAXLOOP_HEARTBEAT_TIMEOUT=10`` ends a 2-process CPU job about 10 s after a peer
is killed).

Example::

    from jaxloop import distributed

    # process i of 2, e.g. two terminals on one machine:
    distributed.initialize('127.0.0.1:12345', num_processes=2, process_id=i)
    if distributed.is_main_process():
        print(jax.device_count(), 'devices in', jax.process_count(), 'processes')
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["initialize", "is_initialized", "is_main_process", "shutdown"]

log = logging.getLogger(__name__)

ENV_COORDINATOR = "JAXLOOP_COORDINATOR"
ENV_NUM_PROCESSES = "JAXLOOP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXLOOP_PROCESS_ID"
ENV_HEARTBEAT_TIMEOUT = "JAXLOOP_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "JAXLOOP_SHUTDOWN_TIMEOUT"
ENV_INIT_TIMEOUT = "JAXLOOP_INIT_TIMEOUT"

DEFAULT_HEARTBEAT_TIMEOUT = 100  # JAX's own defaults
DEFAULT_SHUTDOWN_TIMEOUT = 300
DEFAULT_INIT_TIMEOUT = 300

# HOST:PORT, where HOST is a name, an IPv4 address or a bracketed IPv6 address.
_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.%\w]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")

# The coordinator address this module passed to JAX (JAX has no public accessor for it).
_address: str | None = None


def _or_env(value: Any, name: str, default: int | None = None) -> Any:
    """`value`, else the integer in environment variable `name`, else `default`."""
    if value is not None:
        return value
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"Environment variable {name}={raw!r} is not an integer.") from None


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return value


def _check_address(address: Any) -> str:
    if not isinstance(address, str):
        raise TypeError(
            f"coordinator_address must be a 'HOST:PORT' string, got {address!r} of type "
            f"{type(address).__name__}."
        )
    match = _ADDRESS.match(address.strip())
    if not match or not 1 <= int(match.group(1)) <= 65535:
        raise ValueError(
            f"coordinator_address must look like 'HOST:PORT' (e.g. '10.0.0.1:1234' or "
            f"'[::1]:1234') with a port in 1..65535, got {address!r}."
        )
    return address.strip()


def is_initialized() -> bool:
    """Whether JAX's distributed runtime is up in this process (by jaxloop or anyone)."""
    return jax.distributed.is_initialized()


def is_main_process() -> bool:
    """True in process 0, the one that should print, log and write summaries.

    It asks ``jax.process_index()``, which starts JAX's backends: call `initialize` first.
    """
    return jax.process_index() == 0


def _check_same(requested: dict[str, Any]) -> None:
    """Raises if the running job differs from `requested` (None: not requested)."""
    running = {
        "coordinator_address": lambda: _address,
        "num_processes": jax.process_count,
        "process_id": jax.process_index,
    }
    different = {}
    for name, value in requested.items():
        current = running[name]() if value is not None else None
        if current is not None and value != current:
            different[name] = (value, current)
    if different:
        detail = ", ".join(f"{k}={new!r} (running: {old!r})" for k, (new, old) in different.items())
        raise RuntimeError(
            f"jax.distributed is already initialised with other settings: {detail}. Call "
            "jaxloop.distributed.shutdown() first (before any JAX computation) to change them."
        )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    initialization_timeout: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    shutdown_timeout_seconds: int | None = None,
) -> None:
    """Joins this process to a multi-process JAX job. Call it first, before any JAX work.

    Args:
      coordinator_address: ``HOST:PORT`` where process 0 runs the coordination service and
        every process connects (default ``$JAXLOOP_COORDINATOR``). Use an address the other
        hosts can reach; ``127.0.0.1`` only works with all processes on one machine.
      num_processes: number of processes in the job (default ``$JAXLOOP_NUM_PROCESSES``).
      process_id: this process's index in ``0 .. num_processes - 1`` (default
        ``$JAXLOOP_PROCESS_ID``).
      local_device_ids: restrict this process to these local accelerator ids (e.g. one GPU
        per process); default all (JAX also reads ``$JAX_LOCAL_DEVICE_IDS``).
      initialization_timeout: seconds to keep trying to reach the coordinator and the other
        processes (default ``$JAXLOOP_INIT_TIMEOUT`` or 300).
      heartbeat_timeout_seconds: a process silent this long is declared dead and the whole
        job fails (default ``$JAXLOOP_HEARTBEAT_TIMEOUT`` or 100).
      shutdown_timeout_seconds: how long a finishing process waits at exit for the others
        (default ``$JAXLOOP_SHUTDOWN_TIMEOUT`` or 300).

    With none of address, count and id given (arguments or environment), JAX auto-detects
    them (TPU pods, SLURM, Open MPI, mpi4py, Kubernetes). With ``num_processes == 1`` and no
    address, nothing is initialised. A second call with the same (or no) settings is a no-op.

    Example::

        distributed.initialize('10.0.0.1:1234', num_processes=2, process_id=0)  # host 0
        distributed.initialize('10.0.0.1:1234', num_processes=2, process_id=1)  # host 1

    Raises:
      ValueError: a malformed address, a non-positive count, a process id out of range, a
        non-integer environment variable (the message names the value), or settings that
        neither the caller nor the cluster environment provide.
      TypeError: an argument of the wrong type.
      RuntimeError: the runtime is already up with different settings, or (raised by JAX)
        JAX's backends are already initialised because something ran JAX first.
    """
    global _address

    if coordinator_address is None:
        coordinator_address = os.environ.get(ENV_COORDINATOR) or None
    num_processes = _or_env(num_processes, ENV_NUM_PROCESSES)
    process_id = _or_env(process_id, ENV_PROCESS_ID)
    timeouts = {
        "initialization_timeout": _or_env(
            initialization_timeout, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT),
        "heartbeat_timeout_seconds": _or_env(
            heartbeat_timeout_seconds, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT),
        "shutdown_timeout_seconds": _or_env(
            shutdown_timeout_seconds, ENV_SHUTDOWN_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT),
    }

    if coordinator_address is not None:
        coordinator_address = _check_address(coordinator_address)
    if num_processes is not None:
        _check_int("num_processes", num_processes, 1)
    if process_id is not None:
        _check_int("process_id", process_id, 0)
        if num_processes is not None and process_id >= num_processes:
            raise ValueError(
                f"process_id must be in 0..{num_processes - 1} for num_processes="
                f"{num_processes}, got process_id={process_id}."
            )
    for name, value in timeouts.items():
        _check_int(name, value, 1)

    requested = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    if jax.distributed.is_initialized():
        _check_same(requested)
        return
    if num_processes == 1 and coordinator_address is None and process_id in (None, 0):
        log.info("num_processes=1: running as a single process, nothing to initialise.")
        return

    given = {k: v for k, v in requested.items() if v is not None}
    missing = [k for k in requested if k not in given]
    log.info("Initialising jax.distributed with %s; JAX detects %s.", given, missing or "nothing")
    try:
        # Only the given values are passed, so JAX detects the others from the cluster
        # environment (with none given: jax.distributed.initialize() with no address at all).
        jax.distributed.initialize(**given, local_device_ids=local_device_ids, **timeouts)
    except ValueError as e:
        if not missing:
            raise
        raise ValueError(
            f"jaxloop.distributed.initialize() was not given {', '.join(missing)}, and JAX did "
            "not start with what it detected from the environment (it reads Cloud TPU pods, "
            f"SLURM, Open MPI, mpi4py and Kubernetes). Pass them, or set {ENV_COORDINATOR}, "
            f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}. JAX said: {e}"
        ) from e
    _address = coordinator_address


def shutdown() -> None:
    """Leaves the distributed job (waits up to the shutdown timeout for the other processes).

    Does nothing when not initialised. JAX also does this at interpreter exit.
    """
    global _address
    jax.distributed.shutdown()
    _address = None
