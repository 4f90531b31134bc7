"""Replica integrity: copies of replicated leaves compared on the devices."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxloop import partition
from jaxloop.diagnostics import integrity
from jaxloop.examples import transformer


def fsdp_tp_state():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    part = partition.SPMDPartitioner(mesh, "data", fsdp_min_weight_size=2**10)
    model = transformer.TransformerLM(transformer.LMConfig(d_model=32, num_heads=2,
                                                           num_layers=1), model_axis="model")
    step = transformer.LMStep(jax.random.key(0), model,
                              optimizer=transformer.make_optimizer(1e-2, 10),
                              partitioner=part, train=True)
    return step, step.initialize_model(([1, 64], "int32"))


def perturbed(leaf: jax.Array, device: jax.Device, delta: float) -> jax.Array:
    """`leaf` rebuilt from its shards, with `delta` added to the first entry of the copy on
    `device`."""
    shards = []
    for shard in leaf.addressable_shards:
        value = np.array(shard.data)
        if shard.device == device:
            value.flat[0] += delta
        shards.append(jax.device_put(value, shard.device))
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)


def test_healthy_fsdp_tp_state_passes_and_reports_each_replicated_leaf():
    _, state = fsdp_tp_state()
    found = integrity.check_replicas(state)
    # Leaves split over both axes have no copies; the rest are checked, and equal.
    assert found and set(found.values()) == {0.0}
    assert "params/ln_final/scale" in found  # norms: fully replicated
    # FSDP x TP kernels are split over both axes: no copies to compare.
    kernel = state.params["block0"]["mlp"]["up"]["kernel"]
    assert set(kernel.sharding.spec) == {"data", "model"}
    assert "params/block0/mlp/up/kernel" not in found
    assert "params/embed/embedding" in found  # split over 'data' only: copies along 'model'


def test_one_perturbed_copy_is_named_with_its_leaf_and_device():
    _, state = fsdp_tp_state()
    scale = state.params["ln_final"]["scale"]
    victim = jax.devices()[5]
    broken = jax.tree.map(lambda x: x, state)
    broken.params["ln_final"]["scale"] = perturbed(scale, victim, 0.25)
    with pytest.raises(integrity.ReplicaMismatchError) as info:
        integrity.check_replicas(broken, atol=1e-3)
    message = str(info.value)
    assert "params/ln_final/scale" in message and "0.25" in message
    assert f"{victim} " in message and "block0" not in message
    # Within tolerance it passes; the caller's state is untouched.
    assert integrity.check_replicas(broken, atol=0.5)["params/ln_final/scale"] == 0.25
    assert integrity.check_replicas(state)["params/ln_final/scale"] == 0.0


def test_partly_replicated_leaf_mismatch_names_the_devices():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    leaf = jax.device_put(value, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(None, "model")))  # copies along 'data'
    victim = mesh.devices[2, 1]
    with pytest.raises(integrity.ReplicaMismatchError, match=r"w: the copies on .*replicated"):
        integrity.check_replicas({"w": perturbed(leaf, victim, -3.0)})
    try:
        integrity.check_replicas({"w": perturbed(leaf, victim, -3.0)})
    except integrity.ReplicaMismatchError as e:
        assert f"{victim} (process 0)" in str(e) and "by up to 3" in str(e)
        assert str(mesh.devices[0, 1]) + " " not in str(e)  # the first copy is the reference


def test_cost_against_a_train_step():
    """Prints what a check costs next to one train step of the same state (no assertion on
    time: the figure is reported, not tested)."""
    step, state = fsdp_tp_state()
    batch = {"tokens": np.zeros((32, 65), np.int32)}
    state, _ = step(state, batch)
    integrity.check_replicas(state)

    def best(fn, n=5):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t)
        return min(times)

    holder = [state]

    def train():
        holder[0], out = step(holder[0], batch)
        return out

    step_secs = best(train)
    check_secs = best(lambda: integrity.check_replicas(holder[0]))
    print(f"replica check {check_secs * 1e3:.2f} ms, train step {step_secs * 1e3:.2f} ms, "
          f"ratio {check_secs / step_secs:.2f}")
    assert check_secs > 0


JOB = Path(__file__).resolve().parent / "sched_job.py"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_integrity_across_two_processes(tmp_path):
    from test_multiprocess import run_job  # noqa: PLC0415

    results = run_job("integrity", tmp_path, job=JOB)
    for r in results:
        assert r["healthy"] == {"b": 0.0, "w": 0.0}
        assert r["perturbed"] is not None and "b: the copies on" in r["perturbed"]
        assert "(process 1)" in r["perturbed"] and "0.5" in r["perturbed"]
        assert "(process 0)" not in r["perturbed"] and "w:" not in r["perturbed"]
