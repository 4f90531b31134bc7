"""Small models and steps shared by the tests."""

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxloop import step as step_lib


class LinenMLP(nn.Module):
    hidden: int = 32
    out: int = 10

    def setup(self):
        self.dense1 = nn.Dense(self.hidden)
        self.dense2 = nn.Dense(self.out)

    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        return self.dense2(nn.relu(self.dense1(x)))


class NnxMLP(nnx.Module):
    def __init__(self, din, hidden, out, *, rngs):
        self.dense1 = nnx.Linear(din, hidden, rngs=rngs)
        self.dense2 = nnx.Linear(hidden, out, rngs=rngs)

    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        return self.dense2(nnx.relu(self.dense1(x)))


class ClassifierStep(step_lib.Step):
    """Cross-entropy classifier on batch['x'], batch['y'] (the guide's step, generalised)."""

    def run(self, state, batch):
        x, y = batch["x"], batch["y"]

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, logits

        if self.train:
            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            state = state.apply_gradients(grads=grads)
        else:
            loss, logits = loss_fn(state.params)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
        return state, {"loss": loss, "accuracy": accuracy, "logits": logits}


class PlacingClassifierStep(ClassifierStep):
    """A ClassifierStep with its own `prepare_batch`: its batches are placed on the devices
    ahead of the step, so a prefetcher runs its background thread even on CPU."""

    def prepare_batch(self, batch):
        return super().prepare_batch(batch)


class XY(NamedTuple):
    x: np.ndarray
    y: np.ndarray


def toy_data(n=64, din=16, classes=10, seed=0):
    """A linearly separable toy problem: y = argmax(x @ w)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, din)).astype(np.float32)
    w = rng.normal(size=(din, classes)).astype(np.float32)
    return {"x": x, "y": np.argmax(x @ w, -1).astype(np.int32)}
