"""The same `Step`, key and data give the numbers google/jaxloop gives: the same initial
parameters (it passes the step's key to ``model.init`` as it is) and the same per-step losses.

The figures below were recorded by running this module's `figures()` with google/jaxloop's
own code, snapshot d1bac45a77c4cf3b852c69ef9fe53e04161b0cbf (fetch ``github:google/jaxloop``
and ``git archive`` it to a directory; it also needs ``jaxtyping``, e.g.
``pip install --target /tmp/site jaxtyping`` and ``PYTHONPATH=/tmp/site``), with 8 forced CPU
devices as the tests run::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        .venv/bin/python tests/test_reference_numbers.py /path/to/google-jaxloop

which puts the snapshot's ``src`` first on the path and prints `figures()`. The test runs
the same function with this package.
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

SEED = 7


class Regressor(nn.Module):
    """A small MLP with dropout in training (none at init, as google/jaxloop calls init)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(16)(x))
        x = nn.Dropout(0.25, deterministic=not train)(x)
        return nn.Dense(1)(x)


class DropoutAtInit(nn.Module):
    """Draws dropout while it is initialised: that stream must not change the parameters."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.Dropout(0.5, deterministic=False)(nn.relu(nn.Dense(16)(x))))


class NnxRegressor(nnx.Module):
    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(din, 8, rngs=rngs)
        self.out = nnx.Linear(8, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(8, 4)).astype(np.float32),
             "y": rng.normal(size=(8, 1)).astype(np.float32)} for _ in range(n)]


def summary(params) -> list[float]:
    """A few parameter values and the sum of every parameter, in flattening order."""
    leaves = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(params)]
    flat = np.concatenate(leaves)
    return [round(float(v), 6) for v in (*flat[-3:], flat.sum())]


def figures() -> dict[str, list[float]]:
    """Initial parameters and per-step losses, written with the API both libraries share."""
    from jaxloop import step as step_lib
    from jaxloop import train_loop

    class MSEStep(step_lib.Step):
        def run(self, state, batch):
            def loss_fn(params):
                pred = state.apply_fn({"params": params}, batch["x"], train=True,
                                      rngs={"dropout": self.prng_key(state.step)})
                return jnp.mean((pred - batch["y"]) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), {"loss": loss}

    step = MSEStep(jax.random.key(SEED), Regressor(), optimizer=optax.sgd(0.05), train=True)
    state = step.initialize_model([8, 4])
    init = summary(state.params)
    state, outputs = train_loop.TrainLoop(step)(state, iter(batches(6)), num_steps=6)
    nnx_step = step_lib.Step(jax.random.key(SEED), NnxRegressor, nnx_model_args=(4, 1))
    dropout_step = step_lib.Step(jax.random.key(SEED), DropoutAtInit())
    keys = {"params": jax.random.key(SEED + 1), "dropout": jax.random.key(SEED + 2)}
    return {"linen_init": init,
            "losses": [round(float(x), 6) for x in outputs["loss"]],
            "nnx_init": summary(nnx_step.initialize_model([8, 4]).params),
            "dropout_at_init": summary(dropout_step.initialize_model([8, 4]).params),
            "dict_of_keys_init": summary(
                step_lib.Step(keys, DropoutAtInit()).initialize_model([8, 4]).params)}


# Recorded from google/jaxloop d1bac45 with the command in the module docstring.
REFERENCE = {
    "linen_init": [0.412575, -0.19879, 0.372512, 3.379394],
    "losses": [0.450602, 1.293724, 0.376788, 2.405782, 0.746456, 2.509645],
    "nnx_init": [0.30603, 0.066013, 0.62802, -0.348371],
    "dropout_at_init": [0.241968, 0.079458, 0.926868, 8.416943],
    "dict_of_keys_init": [0.578911, 0.16013, 0.56877, -5.714727],
}


@pytest.fixture(scope="module")
def ours() -> dict[str, list[float]]:
    return figures()


@pytest.mark.parametrize("key", sorted(REFERENCE))
def test_the_same_step_key_and_data_give_google_jaxloops_numbers(ours, key):
    assert ours[key] == pytest.approx(REFERENCE[key], rel=1e-5, abs=1e-6)


if __name__ == "__main__":
    sys.path.insert(0, f"{sys.argv[1]}/src")
    print(figures())
