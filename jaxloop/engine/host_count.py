"""The train step of a state as the host counts it, so that loops, actions and the history
never wait on the device to read ``state.step`` at a loop boundary.

Example::

    state, _ = train_loop(state, batches, num_steps=10)
    host_step(state)  # 10 more than before, without a device read
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

# id(state) -> (weak reference, train step) for the states loops returned.
_host_steps: dict[int, tuple[weakref.ref, int]] = {}


def host_step(state: Any) -> int:
    """The train step of `state`: counted on the host for a state a training loop returned
    (one step per batch; its last steps may still be running), else read from the device."""
    entry = _host_steps.get(id(state))
    if entry is not None and entry[0]() is state:
        return entry[1]
    return int(state.step)


def remember_step(state: Any, step: int) -> None:
    """Records `state`'s train step for `host_step` (if it takes a weak reference)."""
    key = id(state)
    with contextlib.suppress(TypeError):  # no weak references: not remembered
        _host_steps[key] = (weakref.ref(state, lambda _: _host_steps.pop(key, None)), step)
