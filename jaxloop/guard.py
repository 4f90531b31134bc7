"""Non-finite guard: what a training step does when its loss or a gradient is NaN or Inf.

`NonFiniteGuard.apply_gradients` replaces ``state.apply_gradients`` inside `Step.run`. It
checks the loss and every gradient leaf inside the compiled step; when one is not finite the
update is skipped (parameters, optimizer state and model state stay as they were, the step
counter still advances so the next step gets a fresh batch and PRNG key). The check reduces
over the global (sharded) arrays, so every device and every process takes the same decision
with no host round trip.

Two modes:

* ``'skip'``: train on; each step outputs ``nonfinite/skipped`` (1 when skipped, else 0), so
  a loop's skipped steps are the sum of that output (SummaryAction writes its mean).
* ``'raise'``: also skip inside the step, and output ``nonfinite/first_leaf``; the guard's
  `action`, placed before the checkpoint action in the train loop's ``end_actions``, raises
  `NonFiniteError` naming the first bad step and the first non-finite leaf at the loop's end,
  before a checkpoint is written, so the last good checkpoint stays the latest.

Example::

    guard = NonFiniteGuard(mode='raise')

    class Step(step_lib.Step):
        def run(self, state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
            state, guard_outputs = guard.apply_gradients(state, grads, loss)
            return state, {'loss': loss, **guard_outputs}

    train = train_loop.TrainLoop(step, end_actions=[guard.action(), checkpoint_action])

Why not `optax.apply_if_finite`: it wraps the optimizer, so it changes the optimizer state's
structure (checkpoints written without it no longer restore), checks only the updates (not
the loss), still applies the step's other state changes (``batch_stats``), cannot say which
leaf was not finite, and accepts the update after ``max_consecutive_errors`` bad steps. The
guard keeps the user's optimizer as it is and decides on the whole state.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxloop import metric_values, types

__all__ = ["NonFiniteError", "NonFiniteGuard", "SKIPPED", "FIRST_LEAF", "all_finite"]

SKIPPED = "nonfinite/skipped"
FIRST_LEAF = "nonfinite/first_leaf"


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN/Inf loss or gradient.

    Attributes:
      step: the number of the step that failed, counted from 1: its ``state.step`` after
        it, the step its summaries, history entries and checkpoint would carry.
      leaf: the first non-finite value: ``'loss'`` or a gradient path such as
        ``"grads['dense2']['bias']"``.
    """

    def __init__(self, step: int, leaf: str):
        super().__init__(
            f"Non-finite value at training step {step}: {leaf} is NaN or Inf. The update was "
            "not applied and no checkpoint was written after it."
        )
        self.step = step
        self.leaf = leaf


def _finite(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.bool_(True)
    return jnp.all(jnp.isfinite(x))


def all_finite(*trees: Any) -> jax.Array:
    """A scalar bool: whether every floating leaf of `trees` is finite (inside jit too).

    Example::

        ok = all_finite(loss, grads)
    """
    leaves = jax.tree.leaves(trees)
    return jnp.all(jnp.stack([_finite(x) for x in leaves])) if leaves else jnp.bool_(True)


class NonFiniteGuard:
    """Skips updates whose loss or gradients are not finite; optionally raises at loop end.

    Host-side bookkeeping (the leaf names) lives on this object, beside the jitted state:
    the compiled step only outputs numbers.

    Args:
      mode: ``'skip'`` (count skipped steps in the outputs) or ``'raise'`` (also stop with
        `NonFiniteError` through `action`).
    """

    def __init__(self, mode: Literal["skip", "raise"] = "skip"):
        if mode not in ("skip", "raise"):
            raise ValueError(f"mode must be 'skip' or 'raise', got {mode!r}")
        self.mode = mode
        self._leaf_names: list[str] = []

    def apply_gradients(
        self, state: types.TrainState, grads: Any, loss: Any = None, **updates: Any
    ) -> tuple[types.TrainState, dict[str, jax.Array]]:
        """``state.apply_gradients(grads=grads, **updates)`` when `loss` and `grads` are
        finite, else `state` with only its step advanced; plus the guard's outputs.

        `updates` are other fields to replace on the update (``batch_stats=...``); they
        are dropped on a skipped step too.
        """
        named = [("loss", loss)] if loss is not None else []
        named += [
            ("grads" + jax.tree_util.keystr(path), leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(grads)
        ]
        # Trace-time bookkeeping: the names are static, the flags are computed on device.
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
        """Raises `NonFiniteError` if a step in a loop's `outputs` was not finite.

        Args:
          outputs: a train loop's outputs (per-step lists or stacked arrays).
          last_step: ``state.step`` after the loop, to number the steps.
        """
        if not outputs or FIRST_LEAF not in outputs:
            return
        value = outputs[FIRST_LEAF]
        if isinstance(value, list | tuple):
            # The whole per-step list in one `fetch` (one device_get), not one per step.
            value = [np.atleast_1d(np.asarray(v)) for v in metric_values.fetch(list(value))]
            first = np.concatenate(value) if value else np.zeros(0, np.int32)
        else:
            first = np.atleast_1d(np.asarray(metric_values.fetch(value)))
        bad = np.flatnonzero(first >= 0)
        if bad.size:
            i = int(bad[0])
            # Skipped steps advance the counter too, so step i (from 0) of n ended at
            # last_step - n + i + 1: the number summaries and checkpoints give that step.
            raise NonFiniteError(last_step - first.size + i + 1,
                                 self.leaf_name(int(first[i])))

    def action(self, interval: int = 1) -> Any:
        """An end action for a train loop that calls `check`; list it before checkpoints.

        Example::

            TrainLoop(step, end_actions=[guard.action(), summary_action, checkpoint_action])
        """
        from jaxloop import actions  # noqa: PLC0415 (actions import the loops: only when used)

        guard = self

        class NonFiniteAction(actions.Action):
            def __call__(self, state: Any, outputs: Any, **kwargs: Any) -> None:
                guard.check(outputs, int(state.step))

        return NonFiniteAction(interval)
