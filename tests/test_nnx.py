"""nnx models through the one linen-style `run`: RNG streams, train/eval modes, resume."""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import toy_data

from jaxloop import step as step_lib
from jaxloop.checkpointing import checkpoint


class DropoutNet(nnx.Module):
    def __init__(self, *, rngs):
        self.dense1 = nnx.Linear(16, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.dense2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.drop(nnx.relu(self.dense1(x))))


class BNNet(nnx.Module):
    def __init__(self, *, rngs):
        self.bn = nnx.BatchNorm(16, momentum=0.5, rngs=rngs)

    def __call__(self, x):
        return self.bn(x)


class ReadmeStep(step_lib.Step):
    """The README's one `run`, for linen and nnx alike."""

    def run(self, state, batch):
        x, y = batch["x"], batch["y"]

        def loss_fn(params):
            logits = state.apply_fn(
                {"params": params}, x, rngs={"dropout": self.prng_key(state.step)}
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

        if self.train:
            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            state = state.apply_gradients(grads=grads)
        else:
            loss, logits = loss_fn(state.params)
        return state, {"loss": loss, "logits": logits}


def _dropout_step(train=True, seed=0):
    return ReadmeStep(jax.random.key(seed), DropoutNet, optimizer=optax.adam(1e-2), train=train,
                      nnx_model_args=())


def _leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                     strict=True))


def test_readme_run_trains_nnx_dropout_with_masks_per_step():
    step = _dropout_step()
    state = step.initialize_model([1, 16])
    assert state.batch_stats is None  # RNG streams are not carried in the state
    data = toy_data(32)
    losses, logits = [], []
    for _ in range(30):
        state, out = step(state, data)
        losses.append(float(out["loss"]))
        logits.append(np.asarray(out["logits"]))
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    # Same data, nearly the same parameters: the masks differ from step to step.
    zero_fraction = [np.mean(np.asarray(x) == 0) for x in logits]
    assert not np.array_equal(logits[0], logits[1])
    assert max(zero_fraction) < 0.5  # logits are not dropped, the hidden layer is

    # The masks are a pure function of (base key, step): the same state and step number
    # give the same outputs in a new Step instance.
    fresh = _dropout_step()
    fresh_state = fresh.initialize_model([1, 16])
    _, again = fresh(fresh_state, data)
    np.testing.assert_array_equal(np.asarray(again["logits"]), logits[0])


def test_nnx_dropout_resume_is_bit_identical(tmp_path):
    data = [toy_data(32, seed=s) for s in range(6)]
    step = _dropout_step()
    state = step.initialize_model([1, 16])
    for batch in data:
        state, _ = step(state, batch)

    first = _dropout_step()
    half = first.initialize_model([1, 16])
    for batch in data[:3]:
        half, _ = first(half, batch)
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    checkpoint.save(manager, int(half.step), half)
    manager.wait_until_finished()
    manager.close()

    second = _dropout_step()  # a restarted job
    resumed = second.restore_model(second.initialize_model([1, 16]), tmp_path / "ckpt")
    assert int(resumed.step) == 3
    for batch in data[3:]:
        resumed, _ = second(resumed, batch)
    assert _leaves_equal(resumed.params, state.params)


def test_drawing_from_a_stream_without_a_key_is_a_clear_error():
    class NoKeyStep(step_lib.Step):
        def run(self, state, batch):
            return state, {"y": state.apply_fn({"params": state.params}, batch["x"])}

    step = NoKeyStep(jax.random.key(0), DropoutNet, train=True, nnx_model_args=())
    state = step.initialize_model([1, 16])
    with pytest.raises(ValueError, match=r"RNG stream\(s\) \['dropout'\].*rngs=\{'dropout'"):
        step(state, toy_data(8))


def test_eval_step_runs_nnx_dropout_in_eval_mode():
    train_step = _dropout_step(train=True)
    eval_step = _dropout_step(train=False)
    state = train_step.initialize_model([1, 16])
    data = toy_data(16)
    _, eval_a = eval_step(state, data)
    _, eval_b = eval_step(state.replace(step=state.step + 1), data)
    # Eval mode: no dropout, so the step's key does not matter ...
    np.testing.assert_array_equal(np.asarray(eval_a["logits"]), np.asarray(eval_b["logits"]))
    # ... and the output is the plain forward pass.
    model = nnx.merge(*nnx.split(DropoutNet(rngs=nnx.Rngs(0))))
    graphdef, _ = nnx.split(model)
    params = state.params
    plain = nnx.merge(graphdef, nnx.State(jax.tree.map(jnp.asarray, {
        "dense1": params["dense1"], "dense2": params["dense2"],
        "drop": {"rngs": {"count": jnp.zeros((), jnp.uint32), "key": jax.random.key(0)}},
    })))
    plain.eval()
    np.testing.assert_allclose(np.asarray(eval_a["logits"]), plain(data["x"]), rtol=1e-5,
                               atol=1e-6)
    # Train mode: dropout is on (outputs differ from eval mode).
    _, train_out = _dropout_step(train=True)(state, data)
    assert not np.allclose(np.asarray(train_out["logits"]), np.asarray(eval_a["logits"]))


class BNStep(step_lib.Step):
    def run(self, state, batch):
        if not self.train:
            y = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                               batch["x"])
            return state, {"y": y}

        def loss_fn(params):
            y, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, batch["x"],
                mutable=["batch_stats"],
            )
            return jnp.mean(y**2), (y, updates)

        (_, (y, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
        return state, {"y": y}


def test_batchnorm_uses_batch_statistics_in_train_and_running_averages_in_eval():
    x = (np.random.default_rng(0).normal(size=(32, 16)) * 3 + 5).astype(np.float32)
    train_step = BNStep(jax.random.key(0), BNNet, optimizer=optax.sgd(0.0), train=True,
                        nnx_model_args=())
    eval_step = BNStep(jax.random.key(0), BNNet, nnx_model_args=())
    state = train_step.initialize_model([1, 16])
    state, out = train_step(state, {"x": x})
    # Train mode normalises with the batch's own statistics ...
    np.testing.assert_allclose(np.asarray(out["y"]).mean(0), 0, atol=1e-4)
    # ... and updates the running averages (momentum 0.5 from mean 0, var 1).
    mean = np.asarray(state.batch_stats["bn"]["mean"])
    var = np.asarray(state.batch_stats["bn"]["var"])
    np.testing.assert_allclose(mean, 0.5 * x.mean(0), rtol=1e-4)
    _, eval_out = eval_step(state, {"x": x})
    expected = (x - mean) / np.sqrt(var + 1e-5)
    np.testing.assert_allclose(np.asarray(eval_out["y"]), expected, rtol=1e-4, atol=1e-4)


class WideNet(nnx.Module):
    """Big enough leaves for FSDP to split; one annotated for tensor parallelism."""

    def __init__(self, annotate=False, *, rngs):
        init = nnx.initializers.lecun_normal()
        if annotate:
            init = nnx.with_partitioning(init, (None, "model"))
        self.dense1 = nnx.Linear(64, 128, rngs=rngs, kernel_init=init)
        self.dense2 = nnx.Linear(128, 16, rngs=rngs)

    def __call__(self, x):
        return self.dense2(nnx.relu(self.dense1(x)))


@pytest.mark.parametrize("kind", ["fsdp", "spmd"])
def test_an_nnx_instance_is_placed_leaf_by_leaf_without_copies_on_one_device(kind):
    """An nnx model built by the user (its arrays on the default device) lands where the
    partitioner places the same model built from its class; the initialisation makes no
    single-device copy of any parameter (it is an argument of the init program, not a
    constant baked into it), and the user's instance stays usable."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jaxloop import partition

    if kind == "fsdp":
        mesh = Mesh(np.array(jax.devices()), ("data",))
        part = partition.FSDPPartitioner(mesh, "data", min_weight_size=256)
    else:
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
        part = partition.SPMDPartitioner(mesh, "data", fsdp_min_weight_size=256)
    annotate = kind == "spmd"
    # An annotated nnx variable needs a mesh to be created (flax places it as it builds).
    with jax.set_mesh(mesh) if annotate else contextlib.nullcontext():
        instance = WideNet(annotate, rngs=nnx.Rngs(0))
    expected = ReadmeStep(jax.random.key(0), WideNet, optimizer=optax.adam(1e-3),
                          partitioner=part, train=True, nnx_model_args=(annotate,)
                          ).initialize_model([1, 64])
    split = {x.shape for x in jax.tree.leaves(expected) if not x.sharding.is_fully_replicated}

    def buffers():
        return {s.data.unsafe_buffer_pointer(): s.data.shape
                for a in jax.live_arrays() for s in a.addressable_shards}

    step = ReadmeStep(jax.random.key(0), instance, optimizer=optax.adam(1e-3),
                      partitioner=part, train=True)
    before = buffers()
    # jax warns when a program captures more than this many bytes of constants (public
    # option jax_captured_constants_warn_bytes): the instance's values must be arguments.
    previous = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", 1024)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = step.initialize_model([1, 64])
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", previous)
    assert not [w for w in caught if "constants" in str(w.message)]
    whole = [shape for ptr, shape in buffers().items() if ptr not in before and shape in split]
    assert whole == []
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(state),
                                 jax.tree.leaves(expected), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (
            jax.tree_util.keystr(path), got.sharding, want.sharding)
    kernel = state.params["dense1"]["kernel"]
    assert kernel.sharding.spec == (P("data", "model") if annotate else P(None, "data"))
    np.testing.assert_array_equal(kernel, instance.dense1.kernel[...])
    assert instance(jnp.ones((2, 64))).shape == (2, 16)
