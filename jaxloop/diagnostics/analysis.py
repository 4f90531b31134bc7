"""What XLA says about a step's compiled program: its flops and its memory per device.

Both compile the program ahead of time for the arguments given (abstract ones too), so
nothing runs.

Example::

    program = step.compile()
    flops = analysis.flops(program, state, batch)
    print(analysis.memory(program, step.abstract_state(spec), step.abstract_batch(spec)))
"""

from __future__ import annotations

from typing import Any

from jaxloop.diagnostics import memory as memory_lib


def _compiled(program: Any, state: Any, batch: Any, kwargs: dict[str, Any] | None) -> Any:
    return program.lower(state, batch, **(kwargs or {})).compile()


def flops(program: Any, state: Any, batch: Any,
          kwargs: dict[str, Any] | None = None) -> float | None:
    """Flops of one call of `program` on ONE device (XLA's cost analysis of the
    partitioned program); None where XLA gives no figure or a negative one."""
    cost = _compiled(program, state, batch, kwargs).cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    value = (cost or {}).get("flops")
    return None if value is None or value < 0 else float(value)


def memory(program: Any, state: Any, batch: Any, kwargs: dict[str, Any] | None = None,
           devices: Any = None) -> memory_lib.MemoryEstimate:
    """What one device needs to run `program`, from XLA's memory analysis."""
    return memory_lib.MemoryEstimate.from_compiled(
        _compiled(program, state, batch, kwargs), devices)
