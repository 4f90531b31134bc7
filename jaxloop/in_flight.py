"""How far the host may run ahead of the device.

A loop never waits for a step's result; it only bounds the executions dispatched but not
finished, waiting once the bound is reached. That keeps the
device fed while capping queued work: unbounded dispatch of sharded steps deadlocked XLA's
CPU collectives ("Expected 8 threads to join the rendezvous"), and queued steps hold their
batches in memory. Each execution is known by a token: an array its program made (a
`Program`'s `last_token`), never a state leaf, which the next step donates.

Example::

    in_flight = InFlight(default_max_steps_in_flight(step))
    for batch in batches:
        state, outputs = step(state, batch)
        in_flight.add(token(step, outputs, state))  # waits only beyond the bound
"""

from __future__ import annotations

import collections
from typing import Any

import jax

# The bound on a mesh of several CPU devices (see `default_max_steps_in_flight`).
DEFAULT_MAX_STEPS_IN_FLIGHT = 2


def default_max_steps_in_flight(step: Any) -> int:
    """2 on a mesh of several CPU devices, for correctness (the collective deadlock above);
    8 elsewhere, so the device finds queued work whenever the host thread is late.

    Example::

        default_max_steps_in_flight(step)  # 8 for a SingleDevicePartitioner's step
    """
    mesh = getattr(getattr(step, "partitioner", None), "mesh", None)
    if mesh is None:
        return DEFAULT_MAX_STEPS_IN_FLIGHT
    cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
    return DEFAULT_MAX_STEPS_IN_FLIGHT if cpu and mesh.size > 1 else 8


def token(step: Any, outputs: Any, state: Any) -> jax.Array | None:
    """The array that is ready once the execution just dispatched has finished: the step's
    `last_token` (a jaxloop `Step`), else an output array. For a plain callable that
    returned no array, None after waiting for its state (the next call may donate it).
    """
    found = getattr(step, "last_token", None)
    if found is not None:
        return found
    for leaf in jax.tree.leaves(outputs):
        if isinstance(leaf, jax.Array):
            return leaf
    jax.block_until_ready(state)
    return None


class InFlight:
    """The dispatched executions not known to be finished, at most `bound` of them."""

    def __init__(self, bound: int):
        if bound < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {bound}")
        self.bound = bound
        self._tokens: collections.deque = collections.deque()

    def add(self, token: jax.Array | None) -> None:
        """Records a dispatched execution by its token; once `bound` are recorded, waits
        until half of them remain unfinished."""
        if token is None:
            return
        tokens = self._tokens
        tokens.append(token)
        if len(tokens) >= self.bound:
            # Down to half the bound: the host sleeps and wakes once per bound/2 executions,
            # not once per execution, and the device keeps bound/2 queued. Executions finish
            # in order: only the newest of those needs a wait.
            for _ in range(len(tokens) - self.bound // 2 - 1):
                tokens.popleft()
            tokens.popleft().block_until_ready()
