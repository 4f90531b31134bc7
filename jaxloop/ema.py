"""Exponential moving average (EMA) of the parameters, kept in the training state.

`EmaState` is the TrainState with one more field, ``ema_params``; being part of the state,
the average is sharded like the parameters, donated and updated inside the compiled step,
saved in every checkpoint and restored with it (also by an evaluation step, which restores
no optimizer state). The average of bfloat16 or float16 parameters is kept in float32.
`update` is the one call to add to `Step.run`; an `EvalLoop` built with ``use_ema=True``
evaluates the averaged weights (see `swap_in`).

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
import optax

from jaxloop import types

__all__ = ["EmaState", "init", "swap_in", "update"]


class EmaState(types.TrainState):
    """A TrainState that also holds ``ema_params``, the moving average of ``params``."""

    ema_params: Any = None


def _average_dtype(dtype: Any) -> Any:
    # A 0.999 update moves the average by 0.1% of its gap to the parameters, which rounds
    # away in bfloat16 (spacing 2**-7 at 1.0): narrower floats are averaged in float32.
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.promote_types(dtype, jnp.float32)
    return dtype


def _start(x: Any) -> Any:
    dtype = _average_dtype(x.dtype)
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    # A separate buffer with the same placement: the train step donates the state, and one
    # buffer cannot be donated twice.
    return jax.device_put(jnp.array(x, dtype, copy=True), getattr(x, "sharding", None))


def init(state: types.TrainState) -> EmaState:
    """`state` as an `EmaState` whose average starts at the current parameters.

    Fields of `state` are kept; an `EmaState` is returned unchanged. The average is kept
    in float32 for narrower floating parameters (bfloat16, float16), else in their dtype,
    and placed as the parameters are. An abstract state (`Step.abstract_state`, leaves
    `jax.ShapeDtypeStruct`) gives an abstract `EmaState` that a checkpoint restore fills
    in place.

    Example::

        state = ema.init(step.initialize_model([1, 28, 28, 1]))
        state = step.restore_model(ema.init(step.abstract_state([1, 28, 28, 1])), ckpt_dir)
    """
    if isinstance(state, EmaState):
        return state
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    return EmaState(**fields, ema_params=jax.tree.map(_start, state.params))


def update(state: EmaState, decay: float | Callable[[jax.Array], Any]) -> EmaState:
    """Moves ``ema_params`` towards ``params``: ``ema = decay * ema + (1 - decay) * params``
    (`optax.incremental_update`).

    Call it in `Step.run` after the optimizer update. `decay` may be a function of the
    step (an optax schedule), e.g. a warm-up ``lambda step: jnp.minimum(0.999, (1 + step)
    / (10 + step))``. The average keeps the dtype `init` gave it (float32 for bfloat16
    parameters).

    Raises:
      TypeError: `state` has no ``ema_params`` (it was not made with `init`).
    """
    if not isinstance(state, EmaState) or state.ema_params is None:
        raise TypeError(
            f"ema.update needs an EmaState with ema_params; got {type(state).__name__}. "
            "Create the state with ema.init(step.initialize_model(spec))."
        )
    d = jnp.asarray(decay(state.step) if callable(decay) else decay, jnp.float32)
    # float32 * bfloat16 promotes to float32: the average keeps its (wider) dtype.
    return state.replace(
        ema_params=optax.incremental_update(state.params, state.ema_params, 1 - d))


def swap_in(state: types.TrainState) -> types.TrainState:
    """The state with ``params`` replaced by ``ema_params`` (cast to the parameters'
    dtypes), to evaluate the average.

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
    # The average may be wider than the parameters (float32 for bfloat16): the model gets
    # the dtype it was built for.
    return state.replace(params=jax.tree.map(
        lambda e, p: e.astype(p.dtype), state.ema_params, state.params))
