"""How far the host may run ahead of the device.

A loop never waits for a step's result; it only bounds the executions dispatched but not
finished. That keeps the device fed while capping queued work: unbounded dispatch of
sharded steps deadlocked XLA's CPU collectives ("Expected 8 threads to join the
rendezvous"), and queued steps hold their batches in memory.

Example::

    in_flight = InFlight(default_max_steps_in_flight(step))
    for batch in batches:
        state, outputs = step(state, batch)
        in_flight.add(outputs, state)  # waits only when the bound is reached
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


class InFlight:
    """The dispatched executions not known to be finished, at most `bound` of them."""

    def __init__(self, bound: int):
        if bound < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {bound}")
        self.bound = bound
        self._tokens: collections.deque = collections.deque()

    @property
    def last(self) -> jax.Array | None:
        """An array ready once the newest execution has finished (None: none in flight)."""
        return self._tokens[-1] if self._tokens else None

    def add(self, outputs: Any, state: Any) -> None:
        """Records a dispatched execution by its outputs; waits if the bound is reached."""
        # Any output array: ready when its step is, and never donated to a later step.
        token = None
        for leaf in jax.tree.leaves(outputs):
            if isinstance(leaf, jax.Array):
                token = leaf
                break
        if token is None:
            # No array outputs: the state is the only thing to wait on, and the next
            # (donating) step would delete it, so wait now.
            jax.block_until_ready(state)
            return
        tokens = self._tokens
        tokens.append(token)
        if len(tokens) >= self.bound:
            # Wait until half the bound remains, not just one fewer: one wait per bound/2
            # steps. Steps finish in order, so only the newest of those needs a wait.
            for _ in range(len(tokens) - self.bound // 2 - 1):
                tokens.popleft()
            tokens.popleft().block_until_ready()

    def clear(self) -> None:
        self._tokens.clear()
