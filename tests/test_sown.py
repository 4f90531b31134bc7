"""Sown intermediates: scalars a linen or nnx model sows reach TensorBoard through the
step's outputs and SummaryAction."""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import ClassifierStep, toy_data

from jaxloop import actions, train_loop
from jaxloop import step as step_lib
from jaxloop.metrics import writers

eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

DATA = toy_data(n=16, din=8)


class SowingLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(8, name="hidden")(x))
        self.sow("intermediates", "act_mean", h.mean())
        self.sow("intermediates", "act", h)  # not a scalar: left out by default
        return nn.Dense(10)(h)


class SowingNnx(nnx.Module):
    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(8, 8, rngs=rngs)
        self.out = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.hidden(x))
        self.sow(nnx.Intermediate, "act_mean", h.mean())
        return self.out(h)


def read_scalars(logdir):
    acc = eam.EventAccumulator(str(logdir), size_guidance={eam.SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def expected_act_means(step, state, batch):
    """The hidden activations' mean before each step, computed by hand."""
    means = []
    for _ in range(3):
        params = state.params
        w, b = (params["hidden"]["kernel"], params["hidden"]["bias"])
        means.append(float(jnp.maximum(batch["x"] @ w + b, 0).mean()))
        state, _ = step(state, batch)
    return means


@pytest.mark.parametrize("model, args, key", [
    (SowingLinen(), None, "intermediates/act_mean"),
    (SowingNnx, (), "intermediates/act_mean"),
])
def test_sown_scalar_is_written_to_tensorboard(tmp_path, model, args, key):
    step = ClassifierStep(jax.random.key(0), model, optax.sgd(0.1), train=True,
                          nnx_model_args=args, sown=("intermediates",))
    reference = expected_act_means(step, step.initialize_model([1, 8]), DATA)
    state = step.initialize_model([1, 8])
    writer = writers.SummaryWriter(str(tmp_path))
    loop = train_loop.TrainLoop(step, end_actions=[actions.SummaryAction(writer)])
    state2, outputs = loop(state, itertools.repeat(DATA), num_steps=3)
    writer.close()
    assert key in outputs and "intermediates/act" not in outputs  # scalars only
    assert set(outputs) >= {"loss", "accuracy"}
    written = read_scalars(tmp_path)
    assert sorted(written[key]) == [1, 2, 3]
    np.testing.assert_allclose([written[key][s] for s in (1, 2, 3)], reference, rtol=1e-5)
    # The state keeps its own apply_fn: it feeds the next loop (and a checkpoint) unchanged.
    assert state2.apply_fn is state.apply_fn
    state3, _ = train_loop.TrainLoop(step)(state2, itertools.repeat(DATA), num_steps=1)
    assert int(state3.step) == 4


def test_non_scalars_on_request_and_a_user_mutable_collection_kept():
    class BatchStatsStep(step_lib.Step):
        def run(self, state, batch):
            # The user's own mutable collection comes back as before.
            out, updates = state.apply_fn({"params": state.params}, batch["x"],
                                          mutable=["batch_stats"])
            return state, {"mean": out.mean(), "updates": len(updates)}

    step = BatchStatsStep(jax.random.key(0), SowingLinen(), sown="intermediates",
                          sown_scalars_only=False)
    state = step.initialize_model([1, 8])
    _, outputs = step(state, DATA)
    assert outputs["intermediates/act"].shape == (16, 8)
    assert outputs["intermediates/act_mean"].shape == ()
    assert int(outputs["updates"]) == 0  # batch_stats only: not the recorded collection


def test_sown_inside_vmap_is_a_clear_error():
    class PerExample(step_lib.Step):
        def run(self, state, batch):
            out = jax.vmap(lambda x: state.apply_fn({"params": state.params}, x[None]))(
                batch["x"])
            return state, {"mean": out.mean()}

    step = PerExample(jax.random.key(0), SowingLinen(), sown=("intermediates",))
    state = step.initialize_model([1, 8])
    with pytest.raises(ValueError, match="intermediates/act_mean.*inside a transformation"):
        step(state, DATA)
