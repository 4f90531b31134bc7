"""Non-finite guard: a training step skips its update when the loss or a gradient is NaN/Inf.

`NonFiniteGuard.apply_gradients` replaces ``state.apply_gradients`` in `Step.run`; every device
decides alike (global arrays, inside the step). A skipped step advances ``step`` only. Mode
``'raise'`` also makes `action` raise `NonFiniteError` at the loop's end, before a checkpoint.
Unlike `optax.apply_if_finite`, the optimizer state's structure is unchanged::

    guard = NonFiniteGuard(mode='raise')
    state, guard_outputs = guard.apply_gradients(state, grads, loss)    # in Step.run
    train = train_loop.TrainLoop(step, end_actions=[guard.action(), checkpoint_action])
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxloop import types
from jaxloop.hooks.action import Action
from jaxloop.metrics import metric_values

__all__ = ["NonFiniteError", "NonFiniteGuard", "SKIPPED", "FIRST_LEAF", "all_finite"]

SKIPPED = "nonfinite/skipped"
FIRST_LEAF = "nonfinite/first_leaf"


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN/Inf loss or gradient.

    Attributes:
      step: the failed step's ``state.step`` after it (as its summaries would carry).
      leaf: the first non-finite value: ``'loss'`` or a path like ``"grads['w']"``.
    """

    def __init__(self, step: int, leaf: str):
        super().__init__(f"Non-finite value at training step {step}: {leaf} is NaN or Inf. The "
                         "update was not applied and no checkpoint was written after it.")
        self.step, self.leaf = step, leaf


def _finite(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    return jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)


def all_finite(*trees: Any) -> jax.Array:
    """A scalar bool: whether every floating leaf of `trees` is finite (inside jit too)."""
    leaves = jax.tree.leaves(trees)
    return jnp.all(jnp.stack([_finite(x) for x in leaves])) if leaves else jnp.bool_(True)


class NonFiniteGuard:
    """Skips updates whose loss or gradients are not finite; with ``mode='raise'``,
    `action` raises `NonFiniteError` at the loop's end."""

    def __init__(self, mode: Literal["skip", "raise"] = "skip"):
        if mode not in ("skip", "raise"):
            raise ValueError(f"mode must be 'skip' or 'raise', got {mode!r}")
        self.mode = mode
        self._leaf_names: list[str] = []

    def apply_gradients(self, state: types.TrainState, grads: Any, loss: Any = None,
                        **updates: Any) -> tuple[types.TrainState, dict[str, jax.Array]]:
        """(``state.apply_gradients(grads=grads, **updates)`` if `loss` and `grads` are finite,
        else `state` with only its step advanced; the guard's outputs)."""
        named = [("loss", loss)] if loss is not None else []
        named += [("grads" + jax.tree_util.keystr(path), leaf)
                  for path, leaf in jax.tree_util.tree_leaves_with_path(grads)]
        self._leaf_names = [name for name, _ in named]
        flags = jnp.stack([_finite(x) for _, x in named])
        ok = jnp.all(flags)
        updated = state.apply_gradients(grads=grads, **updates)
        new_state = optax.tree.where(ok, updated, state.replace(step=updated.step))
        outputs = {SKIPPED: jnp.logical_not(ok).astype(jnp.int32)}
        if self.mode == "raise":
            outputs[FIRST_LEAF] = jnp.where(ok, -1, jnp.argmin(flags)).astype(jnp.int32)
        return new_state, outputs

    def leaf_name(self, index: int) -> str:
        """The name of the checked value at `index` (from ``nonfinite/first_leaf``)."""
        return self._leaf_names[index] if 0 <= index < len(self._leaf_names) else f"#{index}"

    def check(self, outputs: types.Output | None, last_step: int) -> None:
        """Raises `NonFiniteError` if a step in a train loop's `outputs` was not finite;
        `last_step` is ``state.step`` after the loop, to number the steps."""
        if not outputs or FIRST_LEAF not in outputs:
            return
        value = outputs[FIRST_LEAF]
        per_call = (metric_values.fetch(list(value)) if isinstance(value, list | tuple)
                    else [metric_values.fetch(value)])
        first = np.concatenate([np.ravel(v) for v in per_call] or [np.zeros(0, np.int32)])
        bad = np.flatnonzero(first >= 0)
        if bad.size:
            i = int(bad[0])
            # Skipped steps advance the counter too: step i of n ended at last_step - n + i + 1.
            raise NonFiniteError(last_step - first.size + i + 1, self.leaf_name(int(first[i])))

    def action(self, interval: int = 1) -> Any:
        """An end action for a train loop that calls `check`; list it before checkpoints."""
        guard = self

        class NonFiniteAction(Action):
            def __call__(self, state: Any, outputs: Any, **kwargs: Any) -> None:
                guard.check(outputs, int(state.step))

        return NonFiniteAction(interval)
