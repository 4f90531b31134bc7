"""What XLA says about a step's compiled program: its flops and its memory per device.

Both compile the program ahead of time for the arguments given (abstract ones too: a
`jax.ShapeDtypeStruct` state and batch), so nothing runs and no state needs to exist.

Example::

    program = step.compile()
    flops = analysis.flops(program, state, batch)
    print(analysis.memory(program, step.abstract_state(spec), step.abstract_batch(spec)))
"""

from __future__ import annotations

from typing import Any

from jaxloop import memory as memory_lib


def _compiled(program: Any, state: Any, batch: Any, kwargs: dict[str, Any] | None) -> Any:
    return program.lower(state, batch, **(kwargs or {})).compile()


def flops(
    program: Any, state: Any, batch: Any, kwargs: dict[str, Any] | None = None
) -> float | None:
    """Flops of one call of `program` on ONE device: XLA's cost analysis of the compiled
    program, which is the per-device program once it is partitioned (a data-parallel
    step on 8 devices reports about an eighth of its single-device figure).

    None where XLA gives no figure (or a negative one, which some backends report for
    programs they cannot analyse).

    Example::

        analysis.flops(step.compile(), state, placed_batch)
    """
    cost = _compiled(program, state, batch, kwargs).cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    value = (cost or {}).get("flops")
    if value is None or value < 0:
        return None
    return float(value)


def memory(
    program: Any, state: Any, batch: Any, kwargs: dict[str, Any] | None = None,
    devices: Any = None,
) -> memory_lib.MemoryEstimate:
    """What one device needs to run `program` (arguments, outputs, temporaries), from
    XLA's memory analysis of the compiled program.

    Example::

        print(analysis.memory(step.compile(), abstract_state, abstract_batch))
    """
    return memory_lib.MemoryEstimate.from_compiled(
        _compiled(program, state, batch, kwargs), devices
    )
