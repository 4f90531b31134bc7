"""ReplicaIntegrityAction in a real train loop: data parallel over the 8 CPU devices that
conftest forces, quiet on consistent replicas, raising when one device's copy differs."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import partition, train_loop
from jaxloop.diagnostics import integrity


def make_loop(interval=1):
    part = partition.DataParallelPartitioner(Mesh(np.array(jax.devices()), ("data",)))
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True,
                          partitioner=part)
    action = integrity.ReplicaIntegrityAction(interval=interval)
    return step, train_loop.TrainLoop(step, end_actions=[action])


def batches(n):
    return iter([toy_data(64, seed=i) for i in range(n)])


def diverged(leaf, device, delta):
    """`leaf` rebuilt from per-device buffers, the copy on `device` shifted by `delta`."""
    buffers = []
    for shard in leaf.addressable_shards:
        value = np.array(shard.data)
        if shard.device == device:
            value += delta
        buffers.append(jax.device_put(value, shard.device))
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, buffers)


def test_consistent_replicas_pass():
    assert len(jax.devices()) == 8
    step, loop = make_loop()
    state, outputs = loop(step.initialize_model([1, 16]), batches(2), num_steps=2)
    assert int(state.step) == 2 and len(outputs["loss"]) == 2
    # The action's own check agrees: every replicated leaf is identical on all devices.
    found = integrity.check_replicas(state)
    assert "params/dense2/bias" in found and set(found.values()) == {0.0}


def test_a_diverged_copy_is_reported_at_the_loop_end():
    step, loop = make_loop()
    state = step.initialize_model([1, 16])
    bias = state.params["dense2"]["bias"]
    assert bias.sharding.is_fully_replicated
    victim = jax.devices()[3]
    state = state.replace(params={**state.params, "dense2": {
        **state.params["dense2"], "bias": diverged(bias, victim, 0.5)}})
    with pytest.raises(integrity.ReplicaMismatchError) as info:
        loop(state, batches(2), num_steps=2)
    message = str(info.value)
    assert "params/dense2/bias" in message and f"{victim} " in message
    assert "dense1" not in message  # only the diverged leaf is named


def test_interval_skips_loops_between_checks():
    step, loop = make_loop(interval=2)
    state = step.initialize_model([1, 16])
    bias = state.params["dense2"]["bias"]
    state = state.replace(params={**state.params, "dense2": {
        **state.params["dense2"], "bias": diverged(bias, jax.devices()[7], 0.5)}})
    # The first loop is not one the interval picks; the second is, and reports.
    state, _ = loop(state, batches(1), num_steps=1)
    with pytest.raises(integrity.ReplicaMismatchError, match="params/dense2/bias"):
        loop(state, batches(1), num_steps=1)
