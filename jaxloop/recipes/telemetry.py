"""Training telemetry as step outputs: gradient, parameter and update norms, learning rate,
computed in the compiled step (`SummaryAction` writes them like the loss)::

    new_state = state.apply_gradients(grads=grads)
    return new_state, {'loss': loss, **telemetry.train_metrics(
        state, grads, new_state, learning_rate=schedule)}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxloop import types

__all__ = ["GRAD_NORM", "LEARNING_RATE", "PARAM_NORM", "UPDATE_NORM", "global_norm",
           "injected_hyperparam", "train_metrics"]

GRAD_NORM = "telemetry/grad_norm"
PARAM_NORM = "telemetry/param_norm"
UPDATE_NORM = "telemetry/update_norm"
LEARNING_RATE = "telemetry/learning_rate"


def _float32(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves of `tree` together, summed in float32."""
    return optax.tree.norm(_float32(tree))


def injected_hyperparam(opt_state: Any, name: str = "learning_rate") -> jax.Array | None:
    """The first ``hyperparams[name]`` set by ``optax.inject_hyperparams`` (also in chains and
    `optax.MultiSteps`), or None::

        tx = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
        injected_hyperparam(tx.init(params))  # schedule(0)
    """
    def injected(path: tuple, _: Any) -> bool:
        # hyperparams[name] holds the value; hyperparams_states[name] a schedule's state.
        return len(path) > 1 and getattr(path[-2], "name", None) == "hyperparams"

    found = optax.tree_utils.tree_get_all_with_path(opt_state, name, filtering=injected)
    return jnp.asarray(found[0][1]) if found else None


def train_metrics(state: types.TrainState, grads: Any, new_state: types.TrainState | None = None,
                  learning_rate: float | Callable[[jax.Array], Any] | None = None,
                  ) -> dict[str, jax.Array]:
    """Per-step telemetry outputs (float32 scalars) inside `Step.run`: `state` before the
    update, `new_state` after it (for the update norm); `learning_rate` a schedule, a
    constant, or None to read it from ``inject_hyperparams`` state."""
    after = state if new_state is None else new_state
    out = {GRAD_NORM: global_norm(grads), PARAM_NORM: global_norm(after.params)}
    if new_state is not None:
        out[UPDATE_NORM] = global_norm(optax.tree.sub(_float32(new_state.params),
                                                      _float32(state.params)))
    lr = learning_rate(state.step) if callable(learning_rate) else learning_rate
    if lr is None:
        lr = injected_hyperparam(after.opt_state)
    if lr is not None:
        out[LEARNING_RATE] = jnp.asarray(lr, jnp.float32)
    return out
