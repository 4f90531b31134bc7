"""Exponential moving average (EMA) of the parameters, kept in the training state.

`EmaState` adds ``ema_params`` to the TrainState, so the average is sharded, donated, updated
in the compiled step and checkpointed like the parameters. `EvalLoop(use_ema=True)` evaluates it.

Example::

    state = ema.init(step.initialize_model(spec))
    state = ema.update(state.apply_gradients(grads=grads), decay=0.999)   # in Step.run
    eval_loop = EvalLoop(eval_step, use_ema=True)     # evaluates state.ema_params

An NNX-native ``run`` names ``ema`` instead: `NnxEma`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxloop import types

__all__ = ["EmaState", "NnxEma", "init", "swap_in", "update"]


class EmaState(types.TrainState):
    """A TrainState that also holds ``ema_params``, the moving average of ``params``."""

    ema_params: Any = None

    @classmethod
    def from_state(cls, state: types.TrainState) -> EmaState:
        """`init`: how `Step.materialize` makes the state an abstract `EmaState` describes."""
        return init(state)


def _start(x: Any) -> Any:
    # A 0.999 update (0.1% of the gap) rounds away in bfloat16: average in float32.
    inexact = jnp.issubdtype(x.dtype, jnp.inexact)
    dtype = jnp.promote_types(x.dtype, jnp.float32) if inexact else x.dtype
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    # A separate buffer: the train step donates the state, and no buffer is donated twice.
    return jax.device_put(jnp.array(x, dtype, copy=True), getattr(x, "sharding", None))


def init(state: types.TrainState) -> EmaState:
    """`state` as an `EmaState` whose average starts at the current parameters (an
    `EmaState` is returned unchanged; an abstract state gives one to restore into).

    Example::

        state = step.restore_model(ema.init(step.abstract_state([1, 28, 28, 1])), ckpt_dir)
    """
    if isinstance(state, EmaState):
        return state
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    return EmaState(**fields, ema_params=jax.tree.map(_start, state.params))


def update(state: EmaState, decay: float | Callable[[jax.Array], Any]) -> EmaState:
    """``ema = decay * ema + (1 - decay) * params``, in `Step.run` after the update; `decay`
    may be a function of the step (an optax schedule). TypeError: a state not made by `init`."""
    if not isinstance(state, EmaState) or state.ema_params is None:
        raise TypeError(
            f"ema.update needs an EmaState with ema_params; got {type(state).__name__}. "
            "Create the state with ema.init(step.initialize_model(spec))."
        )
    return state.replace(ema_params=_averaged(state.params, state.ema_params, decay, state.step))


def _averaged(params: Any, ema_params: Any, decay: float | Callable[[jax.Array], Any],
              step: Any) -> Any:
    d = jnp.asarray(decay(step) if callable(decay) else decay, jnp.float32)
    return optax.incremental_update(params, ema_params, 1 - d)


class NnxEma:
    """The moving average an NNX-native `run` receives when it names ``ema`` (the state
    must come from `init`); jaxloop writes it back to ``state.ema_params``.

    Example::

        def run(self, model, optimizer, ema, batch):
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            optimizer.update(model, grads)
            ema.update(model, 0.999)
            return {'loss': loss}
    """

    def __init__(self, state: types.TrainState, step: Callable[[], Any]):
        if not isinstance(state, EmaState) or state.ema_params is None:
            raise TypeError(
                f"run names `ema`, but the state is a {type(state).__name__} without "
                "ema_params: create it with ema.init(step.initialize_model(spec)).")
        self.params = state.ema_params
        self._step = step

    def update(self, model: nnx.Module, decay: float | Callable[[jax.Array], Any]) -> None:
        """``ema = decay * ema + (1 - decay) * params`` of `model`'s ``nnx.Param`` values;
        a callable `decay` gets the step count after this step's optimizer updates."""
        params = nnx.state(model, nnx.Param).to_pure_dict()
        self.params = _averaged(params, self.params, decay, self._step())


def swap_in(state: types.TrainState) -> types.TrainState:
    """The state with ``params`` replaced by ``ema_params`` (in the parameters' dtypes),
    to evaluate the average (``eval_loop(ema.swap_in(state), batches)``); TypeError when
    the state holds none."""
    if getattr(state, "ema_params", None) is None:
        raise TypeError(
            f"Cannot evaluate EMA weights: the state ({type(state).__name__}) has no "
            "ema_params. Create it with ema.init(...) and update it with ema.update(...)."
        )
    return state.replace(params=jax.tree.map(
        lambda e, p: e.astype(p.dtype), state.ema_params, state.params))
