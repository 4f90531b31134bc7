"""Tensor parallelism as large models annotate it: logical axis rules, factored optimizer
states, FSDP on top of TP, sharding constraints in `run`, placement that survives restore,
and the partitioner's `sharding` / `partition` as in the Jaxloop reference."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import ClassifierStep, toy_data

from jaxloop import partition
from jaxloop.checkpointing import checkpoint

RULES = [("batch", "data"), ("embed", None), ("mlp", "model"), ("vocab", "model")]


def mesh2d():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


class LogicalMLP(nn.Module):
    """A MaxText-style MLP: kernels annotated with logical names only."""

    hidden: int = 64
    out: int = 10

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        up = nn.Dense(self.hidden, name="up",
                      kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))
        down = nn.Dense(self.out, name="down",
                        kernel_init=nn.with_logical_partitioning(init, ("mlp", "vocab")))
        h = nn.relu(up(x))
        h = nn.with_logical_constraint(h, ("batch", "mlp"))
        return down(h)


def spmd(**kwargs):
    return partition.SPMDPartitioner(mesh2d(), data_axis="data", **kwargs)


def shard_shapes(x):
    return {tuple(s.data.shape) for s in x.addressable_shards}


def test_logical_rules_place_linen_annotations_and_train():
    step = ClassifierStep(jax.random.key(0), LogicalMLP(), optimizer=optax.adam(1e-2),
                          partitioner=spmd(logical_axis_rules=RULES), train=True)
    state = step.initialize_model([1, 16])
    up, down = state.params["up"]["kernel"], state.params["down"]["kernel"]
    # As flax's logical_to_mesh_sharding resolves them.
    expected = nn.logical_to_mesh_sharding(P("embed", "mlp"), mesh2d(), RULES)
    assert up.sharding.spec == expected.spec == P(None, "model")
    assert shard_shapes(up) == {(16, 32)}
    # 'vocab' -> 'model' is already used by 'mlp' in this array: flax leaves it unsplit.
    assert down.sharding.spec == P("model")  # trailing replicated dims are left out
    assert state.opt_state[0].mu["up"]["kernel"].sharding.spec == P(None, "model")
    losses = []
    for _ in range(15):
        state, out = step(state, toy_data(32))
        losses.append(float(out["loss"]))
    assert losses[-1] < 0.5 * losses[0]


def test_logical_name_without_rule_is_a_clear_error():
    step = ClassifierStep(jax.random.key(0), LogicalMLP(),
                          partitioner=spmd(logical_axis_rules=[("embed", None)]))
    expected = r"\['mlp', 'vocab'\].*no logical axis rule.*\('embed', None\)"
    with pytest.raises(ValueError, match=expected):
        step.initialize_model([1, 16])


def test_nnx_logical_annotations_resolve_through_the_rules():
    class Net(nnx.Module):
        def __init__(self, *, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            self.up = nnx.Linear(16, 64, kernel_init=init, rngs=rngs)
            self.down = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    step = ClassifierStep(jax.random.key(0), Net, optimizer=optax.adam(1e-2),
                          partitioner=spmd(logical_axis_rules=RULES), train=True,
                          nnx_model_args=())
    state = step.initialize_model([1, 16])
    assert state.params["up"]["kernel"].sharding.spec == P(None, "model")
    _, out = step(state, toy_data(32))
    assert np.isfinite(float(out["loss"]))


def test_adafactor_factored_moments_get_a_fitting_placement():
    step = ClassifierStep(jax.random.key(0), LogicalMLP(hidden=128),
                          optimizer=optax.adafactor(1e-2, min_dim_size_to_factor=8),
                          partitioner=spmd(logical_axis_rules=RULES), train=True)
    state = step.initialize_model([1, 16])
    for leaf in jax.tree.leaves(state.opt_state):
        assert len(leaf.sharding.spec) <= leaf.ndim  # fits the leaf's own shape
    losses = []
    for _ in range(10):
        state, out = step(state, toy_data(32))
        losses.append(float(out["loss"]))
    assert losses[-1] < losses[0]


def test_fsdp_on_top_of_tensor_parallelism():
    big = 2**10
    model = LogicalMLP(hidden=128, out=16)
    plain = ClassifierStep(jax.random.key(0), model, optimizer=optax.adam(1e-2),
                           partitioner=spmd(logical_axis_rules=RULES), train=True)
    both = ClassifierStep(jax.random.key(0), model, optimizer=optax.adam(1e-2),
                          partitioner=spmd(logical_axis_rules=RULES, fsdp_min_weight_size=big),
                          train=True)
    s_plain, s_both = plain.initialize_model([1, 16]), both.initialize_model([1, 16])
    up = s_both.params["up"]["kernel"]  # (16, 128): 'mlp' on model, 16 split over data
    assert up.sharding.spec == P("data", "model")
    # (128, 16): 'mlp' on model ('vocab' finds 'model' taken), 16 split over data.
    assert s_both.params["down"]["kernel"].sharding.spec == P("model", "data")
    for leaf in jax.tree.leaves(s_both):
        if leaf.size >= big:
            per_device = max(s.data.nbytes for s in leaf.addressable_shards)
            assert per_device == leaf.nbytes // (4 * 2), (leaf.shape, leaf.sharding.spec)
    data = toy_data(32, classes=16)
    for _ in range(5):
        s_plain, o_plain = plain(s_plain, data)
        s_both, o_both = both(s_both, data)
        np.testing.assert_allclose(float(o_both["loss"]), float(o_plain["loss"]), rtol=1e-5)


def test_with_sharding_constraint_works_inside_run():
    class ConstrainedStep(ClassifierStep):
        def run(self, state, batch):
            x = jax.lax.with_sharding_constraint(batch["x"], P("data"))
            return super().run(state, {**batch, "x": x})

    for part in (spmd(logical_axis_rules=RULES), partition.DataParallelPartitioner(
            Mesh(np.array(jax.devices()), ("data",)), "data")):
        step = ConstrainedStep(jax.random.key(0), LogicalMLP(), partitioner=part,
                               optimizer=optax.adam(1e-2), train=True)
        state = step.initialize_model([1, 16])
        _, out = step(state, toy_data(32))
        assert np.isfinite(float(out["loss"]))


def test_restore_through_another_partitioner_keeps_the_target_placement(tmp_path):
    part = spmd(logical_axis_rules=RULES)
    step = ClassifierStep(jax.random.key(0), LogicalMLP(), optimizer=optax.adam(1e-2),
                          partitioner=part, train=True)
    state, _ = step(step.initialize_model([1, 16]), toy_data(32))
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    checkpoint.save(manager, int(state.step), state)
    manager.wait_until_finished()
    manager.close()
    # An eval step with a partitioner instance of its own (no rules known to it), given the
    # training state as the target: each array lands where the target's array is.
    eval_step = ClassifierStep(jax.random.key(0), LogicalMLP(), partitioner=spmd())
    restored = eval_step.restore_model(state, tmp_path / "ckpt")
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params),
                    strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    assert restored.params["up"]["kernel"].sharding.spec == P(None, "model")
    _, out = eval_step(restored, toy_data(32))
    assert np.isfinite(float(out["loss"]))


def test_partitioner_sharding_is_the_states_and_partition_returns_any_pytree():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    dp = partition.DataParallelPartitioner(mesh, "data")
    assert dp.sharding == NamedSharding(mesh, P())
    assert dp.batch_sharding == NamedSharding(mesh, P("data"))
    part = spmd(logical_axis_rules=RULES)
    assert part.sharding is None
    step = ClassifierStep(jax.random.key(0), LogicalMLP(), partitioner=part)
    state = step.initialize_model([1, 16])
    shardings = part.sharding
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
    assert shardings.params["up"]["kernel"].spec == P(None, "model")
    # A second instance of the same policy places a new state identically.
    again = ClassifierStep(jax.random.key(0), LogicalMLP(),
                           partitioner=spmd(logical_axis_rules=RULES)).initialize_model([1, 16])
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state), strict=True):
        assert a.sharding == b.sharding

    def metrics(state, batch):
        logits = state.apply_fn({"params": state.params}, batch["x"])
        return {"mean": logits.mean(), "max": logits.max()}

    out = part.partition(metrics)(state, part.shard_batch(toy_data(32)))
    assert set(out) == {"mean", "max"} and np.isfinite(float(out["mean"]))


def test_a_state_placed_differently_is_an_error_not_a_second_program():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    part = partition.FSDPPartitioner(mesh, "data", min_weight_size=64)
    step = ClassifierStep(jax.random.key(0), LogicalMLP(), optimizer=optax.adam(1e-2),
                          partitioner=part, train=True)
    split = step.initialize_model([1, 16])
    # A copy placed otherwise (the training step donates its input state's buffers).
    replicated = jax.tree.map(
        lambda x: jax.device_put(np.asarray(x), NamedSharding(mesh, P())), split)
    out_split, _ = step(split, toy_data(32))
    assert out_split.params["up"]["kernel"].sharding.spec == P(None, "data")
    with pytest.raises(ValueError, match="does not match the sharding"):
        step(replicated, toy_data(32))
