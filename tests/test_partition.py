"""The four partitioners on 8 CPU devices: placement, batch splitting, training, FSDP memory."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import partition, train_loop, types


class GuideCNN(nn.Module):
    """The CNN of the Jaxloop guide."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        return nn.Dense(features=10)(x)


def mesh1d():
    return Mesh(np.array(jax.devices()), ("data",))


def make(kind):
    if kind == "single":
        return partition.SingleDevicePartitioner()
    if kind == "dp":
        return partition.DataParallelPartitioner(mesh1d(), "data")
    if kind == "fsdp":
        return partition.FSDPPartitioner(mesh1d(), "data", min_weight_size=64)
    return partition.SPMDPartitioner(
        Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model")), "data")


def shard_shapes(x):
    return {tuple(s.data.shape) for s in x.addressable_shards}


@pytest.mark.parametrize("kind", ["single", "dp", "fsdp", "spmd"])
def test_partitioner_places_splits_and_trains(kind):
    part = make(kind)
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          partitioner=part, train=True)
    state = step.initialize_model([1, 16])
    data = toy_data(32)
    sharded = part.shard_batch(data)
    n_data = {"single": 1, "dp": 8, "fsdp": 8, "spmd": 4}[kind]
    assert shard_shapes(sharded["x"]) == {(32 // n_data, 16)}
    assert shard_shapes(sharded["y"]) == {(32 // n_data,)}
    losses = []
    for _ in range(15):
        state, out = step(state, data)
        losses.append(float(out["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    # Per-example outputs keep the batch split; the state keeps its placement.
    assert shard_shapes(out["logits"]) == {(32 // n_data, 10)}
    kernel = state.params["dense1"]["kernel"]
    if kind == "fsdp":
        # (16, 32): split on the larger dimension.
        assert kernel.sharding.spec == P(None, "data")
        assert shard_shapes(kernel) == {(16, 4)}
    else:
        assert shard_shapes(kernel) == {(16, 32)}


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_initialize_with_batch_of_one_on_8_devices(kind):
    step = ClassifierStep(jax.random.key(0), GuideCNN(), optimizer=optax.sgd(0.005, 0.9),
                          partitioner=make(kind), train=True)
    state = step.initialize_model([1, 28, 28, 1])
    assert state.params["Dense_0"]["kernel"].shape == (3136, 256)
    images = np.random.default_rng(0).random((8, 28, 28, 1), np.float32)
    state, out = step(state, {"x": images, "y": np.arange(8) % 10})
    assert np.isfinite(float(out["loss"]))


def test_fsdp_matches_data_parallel():
    data = toy_data(64)
    results = {}
    for kind in ("dp", "fsdp"):
        step = ClassifierStep(jax.random.key(0), LinenMLP(hidden=64),
                              optimizer=optax.adam(1e-2), partitioner=make(kind), train=True)
        state = step.initialize_model([1, 16])
        losses = []
        for i in range(10):
            batch = {k: v[(i % 2) * 32:(i % 2 + 1) * 32] for k, v in data.items()}
            state, out = step(state, batch)
            losses.append(float(out["loss"]))
        results[kind] = losses
    np.testing.assert_allclose(results["fsdp"], results["dp"], rtol=1e-5)


def _bytes_per_device(tree):
    per_device = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def test_fsdp_state_memory_is_split():
    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(1024)(x))
            x = nn.relu(nn.Dense(512)(x))
            return nn.Dense(16)(x)

    totals = {}
    for kind in ("dp", "fsdp"):
        part = (partition.FSDPPartitioner(mesh1d(), "data") if kind == "fsdp"
                else make("dp"))
        step = ClassifierStep(jax.random.key(0), Wide(), optimizer=optax.adam(1e-3),
                              partitioner=part, train=True)
        state = step.initialize_model([1, 512])
        tree = (state.params, state.opt_state)
        total = sum(x.nbytes for x in jax.tree.leaves(tree))
        totals[kind] = (total, _bytes_per_device(tree))
        assert step.num_params > 1_000_000
    total, per_device = totals["fsdp"]
    assert per_device <= 1.15 * total / 8, (per_device, total)
    assert totals["dp"][1] == totals["dp"][0]


def test_spmd_honours_linen_annotations():
    class Annotated(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x.reshape((x.shape[0], -1))
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            x = nn.relu(nn.Dense(32, kernel_init=init, name="dense1")(x))
            return nn.Dense(10, name="dense2")(x)

    step = ClassifierStep(jax.random.key(0), Annotated(), optimizer=optax.adam(1e-2),
                          partitioner=make("spmd"), train=True)
    state = step.initialize_model([1, 16])
    kernel = state.params["dense1"]["kernel"]
    assert kernel.sharding.spec == P(None, "model")
    assert shard_shapes(kernel) == {(16, 16)}
    # Adam's moments follow the parameter's annotation.
    mu = state.opt_state[0].mu["dense1"]["kernel"]
    assert mu.sharding.spec == P(None, "model")
    losses = []
    for _ in range(15):
        state, out = step(state, toy_data(32))
        losses.append(float(out["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    assert state.params["dense1"]["kernel"].sharding.spec == P(None, "model")


def test_spmd_honours_nnx_annotations():
    class Annotated(nnx.Module):
        def __init__(self, *, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.dense1 = nnx.Linear(16, 32, kernel_init=init, rngs=rngs)
            self.dense2 = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.dense2(nnx.relu(self.dense1(x)))

    step = ClassifierStep(jax.random.key(0), Annotated, optimizer=optax.adam(1e-2),
                          partitioner=make("spmd"), train=True, nnx_model_args=())
    state = step.initialize_model([1, 16])
    assert state.params["dense1"]["kernel"].sharding.spec == P(None, "model")
    _, first = step(state, toy_data(32))
    assert np.isfinite(float(first["loss"]))


def test_spmd_unknown_axis_is_an_error():
    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "tensor"))
            return nn.Dense(8, kernel_init=init)(x)

    step = ClassifierStep(jax.random.key(0), Bad(), partitioner=make("spmd"))
    with pytest.raises(ValueError, match="'tensor'"):
        step.initialize_model([1, 16])


def test_bad_mesh_arguments():
    with pytest.raises(ValueError, match="'batch' is not an axis"):
        partition.DataParallelPartitioner(mesh1d(), "batch")
    with pytest.raises(TypeError, match="Mesh"):
        partition.DataParallelPartitioner(jax.devices(), "data")


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_annotated_linen_model_under_dp_and_fsdp(kind):
    class Annotated(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
            x = nn.relu(nn.Dense(64, kernel_init=init, name="dense1")(x))
            return nn.Dense(10, name="dense2")(x)

    # Annotations name axes a 1-D data mesh lacks: DP and FSDP place by their own rule.
    step = ClassifierStep(jax.random.key(0), Annotated(), optimizer=optax.adam(1e-2),
                          partitioner=make(kind), train=True)
    state = step.initialize_model([1, 16])
    kernel = state.params["dense1"]["kernel"]
    assert kernel.shape == (16, 64)
    assert shard_shapes(kernel) == ({(16, 8)} if kind == "fsdp" else {(16, 64)})
    _, out = step(state, toy_data(32))
    assert np.isfinite(float(out["loss"]))


def test_replicated_leaves_report_the_plain_replicated_sharding():
    # The reference's code compares shardings with NamedSharding(mesh, P()); P(None, None)
    # does not compare equal to it.
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    part = partition.SPMDPartitioner(mesh, "data")
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          partitioner=part, train=True)
    state, _ = step(step.initialize_model([1, 16]), toy_data(16))
    replicated = NamedSharding(mesh, P())
    assert all(x.sharding == replicated for x in jax.tree.leaves(state))
    fsdp = partition.FSDPPartitioner(mesh, "data", min_weight_size=1)
    assert fsdp.leaf_spec((8, 3)) == P("data") and fsdp.leaf_spec((3, 5)) == P()


def test_spmd_state_with_params_the_user_placed_and_a_python_int_step_trains_in_place():
    # google's Transformer notebook: the parameters put on 'model' by the user, the state
    # made by flax's TrainState.create (its step the Python int 0, nowhere on the mesh).
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    part = partition.SPMDPartitioner(mesh, "data")
    model = LinenMLP()
    params = model.init(jax.random.key(0), np.zeros((1, 16), np.float32))["params"]
    on_model = jax.tree.map(
        lambda p: NamedSharding(mesh, P(*[None] * (p.ndim - 1), "model")), params)
    params = jax.device_put(params, on_model)
    state = types.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    assert isinstance(state.step, int)

    shardings = part.state_shardings(state)
    assert shardings.params == on_model  # placed leaves keep their placement
    assert shardings.step == NamedSharding(mesh, P())  # the rest follow the rule
    # A policy: another instance gives the same answer for the same state.
    assert partition.SPMDPartitioner(mesh, "data").state_shardings(state) == shardings
    # Host leaves and leaves on other devices get the rule too.
    mixed = part.state_shardings({"host": np.zeros(4), "one_device": jax.device_put(
        np.zeros(4), jax.devices()[0]), "placed": params["dense1"]["bias"]})
    assert mixed == {"host": NamedSharding(mesh, P()), "one_device": NamedSharding(mesh, P()),
                     "placed": on_model["dense1"]["bias"]}

    step = ClassifierStep(jax.random.key(0), model, optimizer=optax.adam(1e-2),
                          partitioner=part, train=True)
    data = toy_data(64)
    batches = [{k: v[i:i + 16] for k, v in data.items()} for i in range(0, 64, 16)]
    state, outputs = train_loop.TrainLoop(step)(state, iter(batches * 2), num_steps=8)
    assert int(state.step) == 8
    assert jax.tree.map(lambda x: x.sharding, state.params) == on_model
    losses = [float(loss) for loss in outputs["loss"]]
    assert losses[-1] < losses[0]



class CountingPartitioner(partition.DataParallelPartitioner):
    """A user's partitioner wrapping every step's jit (google/jaxloop's extension point)."""

    def __init__(self, mesh):
        super().__init__(mesh, "data")
        self.flags, self.calls = [], 0

    def partition(self, fn, **jit_kwargs):
        jitted = super().partition(fn, **jit_kwargs)
        self.flags.append(set(jit_kwargs))

        def counted(*args, **kwargs):
            self.calls += 1
            return jitted(*args, **kwargs)

        return counted


@pytest.mark.parametrize("k", [1, 4])
def test_a_partitioners_own_partition_compiles_every_step(k):
    data = toy_data(64)
    batches = [{n: v[i:i + 8] for n, v in data.items()} for i in range(0, 64, 8)]
    counting = CountingPartitioner(mesh1d())
    states = []
    for part in (counting, partition.DataParallelPartitioner(mesh1d())):
        step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1),
                              partitioner=part, train=True)
        loop = train_loop.TrainLoop(step, steps_per_execution=k)
        # At k=4: an execution of 4 steps, then one of 2 (the same program).
        state, outputs = loop(step.initialize_model([1, 16]), iter(batches), num_steps=6)
        assert len(outputs["loss"]) == 6
        states.append(state)
    # Two programs (the first execution keeps the caller's state, the others consume the
    # loop's own), each made by the user's `partition` with the shardings and the donation,
    # and its wrapper called once per execution.
    assert len(counting.flags) == 2
    assert all({"in_shardings", "out_shardings", "donate_argnums"} <= f for f in counting.flags)
    assert counting.calls == (6 if k == 1 else 2)
    assert jax.tree.all(jax.tree.map(np.array_equal, states[0].params, states[1].params))


def test_compile_out_shardings_places_the_outputs_and_keeps_the_state():
    part = partition.FSDPPartitioner(mesh1d(), "data", min_weight_size=64)
    step = ClassifierStep(jax.random.key(0), LinenMLP(), partitioner=part)
    state = step.initialize_model([1, 16])
    replicated = NamedSharding(part.mesh, P())
    step.compile(out_shardings=replicated)
    new, outputs = step(state, toy_data(16))
    assert outputs["logits"].sharding.is_fully_replicated
    assert not step.compile()(state, part.shard_batch(toy_data(16)))[1][
        "logits"].sharding.is_fully_replicated  # split along the data axis otherwise
    step.compile(out_shardings=(None, {"loss": replicated, "accuracy": replicated,
                                       "logits": replicated}))
    new, outputs = step(state, toy_data(16))
    assert outputs["logits"].sharding.is_fully_replicated
    for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(new), strict=True):
        assert after.sharding == before.sharding  # FSDP's split stays
