"""Multi-process (multi-host) start-up: one call before any other JAX work.

`initialize` joins JAX's distributed runtime; arguments not given come from
``JAXLOOP_COORDINATOR``, ``JAXLOOP_NUM_PROCESSES``, ``JAXLOOP_PROCESS_ID`` and the
``JAXLOOP_*_TIMEOUT`` variables, then from JAX's cluster detection::

    distributed.initialize('127.0.0.1:12345', num_processes=2, process_id=i)  # process i
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


def _setting(name: str, value: Any, env: str, minimum: int, default: int | None = None
             ) -> int | None:
    """`value`, else the integer in environment variable `env`, else `default`; checked."""
    if value is None:
        raw = os.environ.get(env, "").strip()
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise ValueError(f"Environment variable {env}={raw!r} is not an integer.") from None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return value


def _check_address(address: Any) -> str:
    if not isinstance(address, str):
        raise TypeError(f"coordinator_address must be a 'HOST:PORT' string, got {address!r} of "
                        f"type {type(address).__name__}.")
    match = _ADDRESS.match(address.strip())
    if not match or not 1 <= int(match.group(1)) <= 65535:
        raise ValueError("coordinator_address must look like 'HOST:PORT' (e.g. '10.0.0.1:1234' or "
                         f"'[::1]:1234') with a port in 1..65535, got {address!r}.")
    return address.strip()


def is_initialized() -> bool:
    """Whether JAX's distributed runtime is up in this process (by jaxloop or anyone)."""
    return jax.distributed.is_initialized()


def is_main_process() -> bool:
    """True in process 0, the one that logs and writes summaries (call `initialize` first)."""
    return jax.process_index() == 0


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_ids: int | Sequence[int] | None = None,
               initialization_timeout: int | None = None,
               heartbeat_timeout_seconds: int | None = None,
               shutdown_timeout_seconds: int | None = None) -> None:
    """Joins this process to a multi-process JAX job (``coordinator_address``: process 0's
    ``HOST:PORT``); JAX detects what neither the arguments nor the environment give (TPU
    pods, SLURM, Open MPI, Kubernetes). A second call with the same (or no) settings is a
    no-op; with other settings a RuntimeError (a bad setting: ValueError or TypeError)."""
    global _address

    if coordinator_address is None:
        coordinator_address = os.environ.get(ENV_COORDINATOR) or None
    if coordinator_address is not None:
        coordinator_address = _check_address(coordinator_address)
    num_processes = _setting("num_processes", num_processes, ENV_NUM_PROCESSES, 1)
    process_id = _setting("process_id", process_id, ENV_PROCESS_ID, 0)
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(f"process_id must be in 0..{num_processes - 1} for "
                         f"num_processes={num_processes}, got process_id={process_id}.")
    timeouts = {name: _setting(name, value, env, 1, default) for name, value, env, default in (
        ("initialization_timeout", initialization_timeout, ENV_INIT_TIMEOUT,
         DEFAULT_INIT_TIMEOUT),
        ("heartbeat_timeout_seconds", heartbeat_timeout_seconds, ENV_HEARTBEAT_TIMEOUT,
         DEFAULT_HEARTBEAT_TIMEOUT),
        ("shutdown_timeout_seconds", shutdown_timeout_seconds, ENV_SHUTDOWN_TIMEOUT,
         DEFAULT_SHUTDOWN_TIMEOUT),
    )}

    requested = {"coordinator_address": coordinator_address, "num_processes": num_processes,
                 "process_id": process_id}
    if jax.distributed.is_initialized():
        running = {"coordinator_address": _address, "num_processes": jax.process_count(),
                   "process_id": jax.process_index()}
        different = [f"{k}={v!r} (running: {running[k]!r})" for k, v in requested.items()
                     if v is not None and running[k] is not None and v != running[k]]
        if different:
            raise RuntimeError(
                f"jax.distributed is already initialised with other settings: "
                f"{', '.join(different)}. Call jaxloop.launch.distributed.shutdown() first "
                "(before any JAX computation) to change them.")
        return
    if num_processes == 1 and coordinator_address is None and process_id in (None, 0):
        log.info("num_processes=1: running as a single process, nothing to initialise.")
        return

    given = {k: v for k, v in requested.items() if v is not None}
    missing = [k for k in requested if k not in given]
    log.info("Initialising jax.distributed with %s; JAX detects %s.", given, missing or "nothing")
    try:
        jax.distributed.initialize(**given, local_device_ids=local_device_ids, **timeouts)
    except ValueError as e:
        if not missing:
            raise
        raise ValueError(f"distributed.initialize() was not given {', '.join(missing)}, and JAX "
                         f"could not detect them. Pass them, or set {ENV_COORDINATOR}, "
                         f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}. JAX said: {e}") from e
    _address = coordinator_address


def shutdown() -> None:
    """Leaves the distributed job, waiting up to the shutdown timeout for the others."""
    global _address
    jax.distributed.shutdown()
    _address = None
