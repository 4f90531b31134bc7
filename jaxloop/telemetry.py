"""Training telemetry as step outputs: gradient, parameter and update norms, learning rate.

`train_metrics` is one call inside `Step.run` that returns the numbers a training run is
usually debugged with. They are ordinary scalar outputs, so `SummaryAction` writes them per
step like the loss, and they are computed inside the compiled step (no host round trip).

Example::

    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 10_000)

    class Step(step_lib.Step):
        def run(self, state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
            new_state = state.apply_gradients(grads=grads)
            return new_state, {
                'loss': loss,
                **telemetry.train_metrics(state, grads, new_state, learning_rate=schedule),
            }

With ``optax.inject_hyperparams`` the learning rate is read from the optimizer state and
``learning_rate`` can be left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxloop import types

__all__ = [
    "GRAD_NORM",
    "LEARNING_RATE",
    "PARAM_NORM",
    "UPDATE_NORM",
    "global_norm",
    "injected_hyperparam",
    "train_metrics",
]

GRAD_NORM = "telemetry/grad_norm"
PARAM_NORM = "telemetry/param_norm"
UPDATE_NORM = "telemetry/update_norm"
LEARNING_RATE = "telemetry/learning_rate"


def _float32(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves of `tree` together, in float32 (`optax.tree.norm` of the
    leaves cast to float32, so bfloat16 leaves are summed at float32 precision).

    Example::

        global_norm({'w': jnp.ones(4)})  # 2.0
    """
    return optax.tree.norm(_float32(tree))


def injected_hyperparam(opt_state: Any, name: str = "learning_rate") -> jax.Array | None:
    """The current value of a hyperparameter set by ``optax.inject_hyperparams``, or None.

    Finds the first ``hyperparams[name]`` in the optimizer state, also inside chains,
    `optax.MultiSteps` and the like (`optax.tree_utils.tree_get_all_with_path`; unlike
    `optax.tree_utils.tree_get`, two injected optimizers are not an error).

    Example::

        tx = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
        injected_hyperparam(tx.init(params))  # schedule(0)
    """
    def injected(path: tuple, _: Any) -> bool:
        # hyperparams[name] holds the value; hyperparams_states[name] a schedule's state.
        return len(path) > 1 and getattr(path[-2], "name", None) == "hyperparams"

    found = optax.tree_utils.tree_get_all_with_path(opt_state, name, filtering=injected)
    return jnp.asarray(found[0][1]) if found else None


def train_metrics(
    state: types.TrainState,
    grads: Any,
    new_state: types.TrainState | None = None,
    learning_rate: float | Callable[[jax.Array], Any] | None = None,
) -> dict[str, jax.Array]:
    """Per-step telemetry outputs; call inside `Step.run`.

    Args:
      state: the state before the update (the learning rate of an optax schedule is read at
        its step, as optax's own count is).
      grads: the gradients of this step.
      new_state: the state after the update; gives the update norm (and the learning rate
        an ``inject_hyperparams`` optimizer used for this update).
      learning_rate: an optax schedule (called with the step), a constant, or None to read
        it from ``inject_hyperparams`` state (left out when there is none).

    Returns:
      ``telemetry/grad_norm``, ``telemetry/param_norm`` (after the update when `new_state`
      is given), ``telemetry/update_norm`` (with `new_state`) and
      ``telemetry/learning_rate`` (when known), float32 scalars.
    """
    after = state if new_state is None else new_state
    out = {GRAD_NORM: global_norm(grads), PARAM_NORM: global_norm(after.params)}
    if new_state is not None:
        delta = optax.tree.sub(_float32(new_state.params), _float32(state.params))
        out[UPDATE_NORM] = optax.tree.norm(delta)
    if callable(learning_rate):
        lr = learning_rate(state.step)
    elif learning_rate is not None:
        lr = learning_rate
    else:
        lr = injected_hyperparam(after.opt_state)
    if lr is not None:
        out[LEARNING_RATE] = jnp.asarray(lr, jnp.float32)
    return out
