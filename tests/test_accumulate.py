"""Gradient accumulation: k microbatches give one optimizer update equal to one big batch."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from models import LinenMLP, toy_data

from jaxloop import partition
from jaxloop import step as step_lib
from jaxloop.recipes import accumulate


class AccumStep(step_lib.Step):
    def __init__(self, *args, num_microbatches=1, **kwargs):
        super().__init__(*args, **kwargs)
        self.k = num_microbatches

    def run(self, state, batch):
        def loss_fn(params, micro):
            logits = state.apply_fn({"params": params}, micro["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, micro["y"]).mean()
            return loss, {"accuracy": (logits.argmax(-1) == micro["y"]).mean()}

        grad_fn = accumulate.value_and_grad(loss_fn, self.k, has_aux=True)
        (loss, aux), grads = grad_fn(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss, **aux}


def _partitioner(kind):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    if kind == "dp":
        return partition.DataParallelPartitioner(mesh, "data")
    return partition.FSDPPartitioner(mesh, "data", min_weight_size=64)


def _train(kind, k, steps=3):
    step = AccumStep(jax.random.key(0), LinenMLP(hidden=64), optimizer=optax.adam(1e-2),
                     partitioner=_partitioner(kind), train=True, num_microbatches=k)
    state = step.initialize_model([1, 16])
    losses = []
    for i in range(steps):
        state, out = step(state, toy_data(64, seed=i))
        losses.append(float(out["loss"]))
        accuracy = float(out["accuracy"])
    return state, losses, accuracy


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_four_microbatches_equal_one_big_batch(kind):
    big_state, big_losses, big_acc = _train(kind, 1)
    acc_state, acc_losses, acc_acc = _train(kind, 4)
    # One optimizer update per step, whatever k is.
    assert int(acc_state.step) == int(big_state.step) == 3
    np.testing.assert_allclose(acc_losses, big_losses, rtol=1e-5)
    np.testing.assert_allclose(acc_acc, big_acc, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(acc_state.params),
                            jax.tree.leaves(big_state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))
    if kind == "fsdp":  # accumulation keeps the state's sharding
        big_kernel = big_state.params["dense1"]["kernel"]
        assert acc_state.params["dense1"]["kernel"].sharding == big_kernel.sharding


def test_microbatches_are_strided_and_aux_can_be_stacked():
    micro = accumulate.split_microbatches({"x": np.arange(8)}, 4)
    np.testing.assert_array_equal(np.asarray(micro["x"]), [[0, 4], [1, 5], [2, 6], [3, 7]])

    def loss_fn(w, mb):
        return (w * mb).mean(), mb.sum()

    (loss, sums), grad = accumulate.value_and_grad(loss_fn, 4, has_aux=True, aux="stack")(
        2.0, np.arange(8, dtype=np.float32))
    np.testing.assert_allclose(loss, 7.0)
    np.testing.assert_allclose(grad, 3.5)
    np.testing.assert_allclose(sums, [4, 6, 8, 10])


def test_indivisible_batch_names_the_leaf():
    grad_fn = accumulate.value_and_grad(lambda p, b: (p * b["x"]).mean(), 3)
    with pytest.raises(ValueError, match=r"\['x'\] of shape \(8,\) into 3 microbatches"):
        grad_fn(1.0, {"x": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="positive int"):
        accumulate.split_microbatches({"x": np.ones(4)}, 0)


def test_accumulation_lowers_the_compiled_steps_temporary_memory():
    def temp_bytes(k):
        step = AccumStep(jax.random.key(0), LinenMLP(hidden=256), optimizer=optax.sgd(0.1),
                         train=True, num_microbatches=k)
        state = step.initialize_model([1, 64])
        batch = step.partitioner.shard_batch(
            {"x": np.zeros((1024, 64), np.float32), "y": np.zeros((1024,), np.int32)})
        return step.compile().lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(4) < 0.8 * temp_bytes(1)


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.Dropout(0.5, deterministic=False)(nn.Dense(32)(x)))


def test_each_microbatch_draws_its_own_dropout_mask():
    model = DropoutMLP()
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                        np.zeros((1, 16), np.float32))["params"]
    # Rows 2i and 2i+1 are equal, so both strided microbatches of 2 hold the same examples.
    x = np.repeat(np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32), 2, axis=0)

    def loss_fn(params, micro, rngs):
        loss = jnp.mean(model.apply({"params": params}, micro, rngs={"dropout": rngs}) ** 2)
        return loss, loss

    grad_fn = jax.jit(accumulate.value_and_grad(loss_fn, 2, has_aux=True, aux="stack"))
    key = jax.random.key(2)
    (_, per_micro), grads = grad_fn(params, x, rngs=key)
    assert float(per_micro[0]) != float(per_micro[1])  # one key each: different masks
    (_, again), grads_again = grad_fn(params, x, rngs=key)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(per_micro))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # One microbatch is plain jax.value_and_grad with the key as given.
    (loss, _), _ = accumulate.value_and_grad(loss_fn, 1, has_aux=True)(params, x, rngs=key)
    np.testing.assert_allclose(float(loss), float(loss_fn(params, x, key)[0]), rtol=1e-6)
    with pytest.raises(TypeError, match=r"argument \[0\].*rngs="):
        grad_fn(params, x, key)


def test_accumulated_gradients_are_placed_as_the_parameters_under_fsdp():
    # min_weight_size 128 splits both kernels and replicates both biases over 8 devices.
    # Left to itself, XLA split the replicated dense1 bias's running sum 8 ways.
    mesh = Mesh(np.array(jax.devices()), ("data",))
    part = partition.FSDPPartitioner(mesh, "data", min_weight_size=128)
    seen = {}

    class InspectingStep(step_lib.Step):
        def run(self, state, batch):
            def loss_fn(params, micro):
                logits = state.apply_fn({"params": params}, micro["x"])
                return optax.softmax_cross_entropy_with_integer_labels(logits, micro["y"]).mean()

            loss, grads = accumulate.value_and_grad(
                loss_fn, 4, sharding=self.partitioner.sharding.params)(state.params, batch)
            # The sum the scan carried, divided by k: placed as the accumulator was.
            for path, g in jax.tree_util.tree_leaves_with_path(grads):
                name = jax.tree_util.keystr(path)
                jax.debug.inspect_array_sharding(
                    g, callback=lambda s, name=name: seen.update({name: s}))
            return state.apply_gradients(grads=grads), {"loss": loss}

    step = InspectingStep(jax.random.key(0), LinenMLP(hidden=64), optimizer=optax.sgd(0.1),
                          partitioner=part, train=True)
    state = step.initialize_model([1, 16])
    specs = jax.tree.map(lambda x: x.sharding.spec, state.params)
    assert specs["dense1"]["kernel"] == jax.sharding.PartitionSpec(None, "data")
    assert specs["dense1"]["bias"] == jax.sharding.PartitionSpec()
    state, _ = step(state, toy_data(64))
    for path, x in jax.tree_util.tree_leaves_with_path(state.params):
        name = jax.tree_util.keystr(path)
        assert seen[name].is_equivalent_to(x.sharding, x.ndim), (name, seen[name], x.sharding)
