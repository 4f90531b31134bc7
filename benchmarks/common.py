"""The model, step and synthetic data shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Iterator

import flax.linen as nn
import jax
import numpy as np
import optax

from jaxloop import step


class MLP(nn.Module):
    """784-1024-1024-10 (`hidden` wide): enough work per step that timings are not all
    dispatch."""

    hidden: int = 1024

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(10)(x)


class TrainStep(step.Step):
    """Softmax cross-entropy on batch['x'], batch['y']."""

    def run(self, state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}


def batches(batch_size: int, n: int | None = None, delay: float = 0.0) -> Iterator[dict]:
    """`n` copies of one random batch (forever when None), each after `delay` seconds of
    host work that releases the GIL (as decoding and file reads do)."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(batch_size, 784)).astype(np.float32),
             "y": rng.integers(0, 10, size=(batch_size,)).astype(np.int32)}
    count = 0
    while n is None or count < n:
        if delay:
            time.sleep(delay)
        yield batch
        count += 1
