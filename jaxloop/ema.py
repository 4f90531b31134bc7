"""Exponential moving average (EMA) of the parameters, kept in the training state.

`EmaState` is the TrainState with one more field, ``ema_params``; being part of the state,
the average is sharded like the parameters, donated and updated inside the compiled step,
saved in every checkpoint and restored with it (also by an evaluation step, which restores
no optimizer state). `update` is the one call to add to `Step.run`; an `EvalLoop` built with
``use_ema=True`` evaluates the averaged weights (see `swap_in`).

Example::

    class Step(step_lib.Step):
        def run(self, state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
            state = ema.update(state.apply_gradients(grads=grads), decay=0.999)
            return state, {'loss': loss}

    state = ema.init(step.initialize_model(spec))
    eval_loop = EvalLoop(eval_step, use_ema=True)     # evaluates state.ema_params
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxloop import types

__all__ = ["EmaState", "init", "swap_in", "update"]


class EmaState(types.TrainState):
    """A TrainState that also holds ``ema_params``, the moving average of ``params``."""

    ema_params: Any = None


def _copy(x: Any) -> Any:
    # A separate buffer with the same placement: the train step donates the state, and one
    # buffer cannot be donated twice.
    if isinstance(x, jax.Array):
        return jax.device_put(jnp.copy(x), x.sharding)
    return jnp.array(x, copy=True)


def init(state: types.TrainState) -> EmaState:
    """`state` as an `EmaState` whose average starts at the current parameters.

    Fields of `state` are kept; an `EmaState` is returned unchanged.

    Example::

        state = ema.init(step.initialize_model([1, 28, 28, 1]))
    """
    if isinstance(state, EmaState):
        return state
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    return EmaState(**fields, ema_params=jax.tree.map(_copy, state.params))


def update(state: EmaState, decay: float | Callable[[jax.Array], Any]) -> EmaState:
    """Moves ``ema_params`` towards ``params``: ``ema = decay * ema + (1 - decay) * params``.

    Call it in `Step.run` after the optimizer update. `decay` may be a function of the
    step (an optax schedule), e.g. a warm-up ``lambda step: jnp.minimum(0.999, (1 + step)
    / (10 + step))``. The average is kept in the parameters' dtype.

    Raises:
      TypeError: `state` has no ``ema_params`` (it was not made with `init`).
    """
    if not isinstance(state, EmaState) or state.ema_params is None:
        raise TypeError(
            f"ema.update needs an EmaState with ema_params; got {type(state).__name__}. "
            "Create the state with ema.init(step.initialize_model(spec))."
        )
    d = decay(state.step) if callable(decay) else decay
    d = jnp.asarray(d, jnp.float32)
    ema_params = jax.tree.map(
        lambda e, p: (d * e.astype(jnp.float32) + (1 - d) * p.astype(jnp.float32)).astype(
            e.dtype
        ),
        state.ema_params,
        state.params,
    )
    return state.replace(ema_params=ema_params)


def swap_in(state: types.TrainState) -> types.TrainState:
    """The state with ``params`` replaced by ``ema_params``, to evaluate the average.

    Raises:
      TypeError: the state holds no EMA (not an `EmaState`, or ``ema_params`` is None).

    Example::

        _, outputs = eval_loop(ema.swap_in(state), eval_batches)
    """
    if getattr(state, "ema_params", None) is None:
        raise TypeError(
            f"Cannot evaluate EMA weights: the state ({type(state).__name__}) has no "
            "ema_params. Create it with ema.init(...) and update it with ema.update(...)."
        )
    return state.replace(params=state.ema_params)
