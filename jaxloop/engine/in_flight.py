"""How far the host may run ahead of the device: a loop bounds the executions dispatched but
not finished (the device stays fed, queued batches stay few, XLA's CPU collectives do not
deadlock). Each is known by a token its program made (`Program.last_token`), never a state
leaf, which the next step donates: ``in_flight.add(token(step, outputs, state))``.
"""

from __future__ import annotations

from typing import Any

import jax

DEFAULT_MAX_STEPS_IN_FLIGHT = 2  # on a mesh of several CPU devices


def default_max_steps_in_flight(step: Any) -> int:
    """2 on a mesh of several CPU devices (the deadlock above), else 8 (queued for a late host)."""
    mesh = getattr(getattr(step, "partitioner", None), "mesh", None)
    if mesh is None or mesh.size > 1 and all(d.platform == "cpu" for d in mesh.devices.flat):
        return DEFAULT_MAX_STEPS_IN_FLIGHT
    return 8


def token(step: Any, outputs: Any, state: Any) -> jax.Array | None:
    """An array ready once the execution just dispatched has finished: the step's
    `last_token`, else an output array; else None after waiting for `state`."""
    found = getattr(step, "last_token", None)
    if found is None:
        found = next((x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)), None)
    if found is None:
        jax.block_until_ready(state)
    return found


class InFlight:
    """The dispatched executions not known to be finished, at most `bound` of them."""

    def __init__(self, bound: int):
        if bound < 1:
            raise ValueError(f"max_steps_in_flight must be >= 1, got {bound}")
        self.bound = bound
        self._tokens: list[jax.Array] = []

    def add(self, token: jax.Array | None) -> None:
        """Records a dispatched execution's token; at `bound`, waits until half are unfinished."""
        if token is None:
            return
        tokens = self._tokens
        tokens.append(token)
        if len(tokens) >= self.bound:
            # Down to half the bound: one wake-up per bound/2 executions, bound/2 still
            # queued. Executions finish in order, so only the newest dropped needs a wait.
            dropped = len(tokens) - self.bound // 2
            tokens[dropped - 1].block_until_ready()
            del tokens[:dropped]
