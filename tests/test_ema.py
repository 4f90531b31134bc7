"""EMA of the parameters: updated in the step, checkpointed, evaluated by an eval loop."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import eval_loop, partition, train_loop
from jaxloop import step as step_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.recipes import ema


class EmaStep(ClassifierStep):
    def __init__(self, *args, decay=0.9, **kwargs):
        super().__init__(*args, **kwargs)
        self.decay = decay

    def run(self, state, batch):
        state, outputs = super().run(state, batch)
        if self.train:
            state = ema.update(state, self.decay)
        return state, {k: v for k, v in outputs.items() if k != "logits"}


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_average_follows_the_formula_under_dp_and_is_checkpointed(tmp_path):
    part = partition.DataParallelPartitioner(Mesh(np.array(jax.devices()), ("data",)))
    step = EmaStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True,
                   partitioner=part, decay=0.75)
    state = ema.init(step.initialize_model([1, 16]))
    p0 = leaves(state.params)
    state, _ = step(state, toy_data(64, seed=0))
    for e, a, b in zip(leaves(state.ema_params), p0, leaves(state.params), strict=True):
        np.testing.assert_allclose(e, 0.75 * a + 0.25 * b, rtol=1e-6, atol=1e-7)
    assert state.ema_params["dense1"]["kernel"].sharding == state.params["dense1"][
        "kernel"].sharding
    loop = train_loop.TrainLoop(step)
    state, _ = loop(state, iter([toy_data(64, seed=i) for i in range(3)]), num_steps=3)

    manager = checkpoint.make_manager(tmp_path / "ckpt")
    checkpoint.save(manager, int(state.step), state)
    manager.wait_until_finished()
    manager.close()
    # An eval step restores no optimizer state, but it does restore the average.
    eval_step = EmaStep(jax.random.key(1), LinenMLP(), partitioner=part)
    restored = eval_step.restore_model(ema.init(eval_step.initialize_model([1, 16])),
                                       tmp_path / "ckpt")
    for a, b in zip(leaves(restored.ema_params), leaves(state.ema_params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_eval_loop_evaluates_the_ema_weights():
    # decay 1 keeps the average at the initial parameters while training moves params.
    step = EmaStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-1), train=True,
                   decay=1.0)
    initial = ema.init(step.initialize_model([1, 16]))
    untrained = jax.device_get(initial.params)
    state, _ = train_loop.TrainLoop(step)(
        initial, iter([toy_data(64)] * 5), num_steps=5)
    eval_step = EmaStep(jax.random.key(1), LinenMLP())
    data = [toy_data(64)]
    with_ema = eval_loop.EvalLoop(eval_step, use_ema=True)
    returned, ema_out = with_ema(state, iter(data))
    _, plain_out = eval_loop.EvalLoop(eval_step)(state, iter(data))
    _, untrained_out = eval_loop.EvalLoop(eval_step)(
        state.replace(params=untrained), iter(data))
    assert returned is state  # the loop hands back the state it was given
    np.testing.assert_allclose(float(ema_out["loss"][0]), float(untrained_out["loss"][0]),
                               rtol=1e-6)
    assert float(plain_out["loss"][0]) < float(ema_out["loss"][0])


def test_clear_errors_without_an_ema_state():
    step = EmaStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    plain = step.initialize_model([1, 16])
    with pytest.raises(TypeError, match="ema.init"):
        ema.update(plain, 0.9)
    with pytest.raises(TypeError, match="no ema_params"):
        eval_step = EmaStep(jax.random.key(0), LinenMLP())
        eval_loop.EvalLoop(eval_step, use_ema=True)(plain, iter([toy_data(8)]))


def test_abstract_state_resume_under_fsdp(tmp_path):
    # The memory-safe resume: no state is built before the checkpoint is read into place.
    def fsdp_step():
        mesh = Mesh(np.array(jax.devices()), ("data",))
        return EmaStep(jax.random.key(0), LinenMLP(hidden=64), optimizer=optax.adam(1e-2),
                       train=True, partitioner=partition.FSDPPartitioner(mesh, min_weight_size=64))

    step = fsdp_step()
    state, _ = train_loop.TrainLoop(step)(
        ema.init(step.initialize_model([1, 16])), iter([toy_data(64, seed=i) for i in range(2)]),
        num_steps=2)
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    checkpoint.save(manager, int(state.step), state)
    manager.wait_until_finished()
    manager.close()

    resumed = fsdp_step()
    abstract = ema.init(resumed.abstract_state([1, 16]))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert jax.tree.map(lambda x: x.sharding, abstract.ema_params) == jax.tree.map(
        lambda x: x.sharding, abstract.params)
    restored = resumed.restore_model(abstract, tmp_path / "ckpt")
    for a, b in zip(leaves(restored.ema_params), leaves(state.ema_params), strict=True):
        np.testing.assert_array_equal(a, b)
    kernel = restored.ema_params["dense1"]["kernel"]
    assert kernel.sharding == state.params["dense1"]["kernel"].sharding
    assert kernel.sharding.spec != jax.sharding.PartitionSpec()  # really split
    restored, _ = train_loop.TrainLoop(resumed)(restored, iter([toy_data(64, seed=2)]),
                                                num_steps=1)
    assert int(restored.step) == 3


def test_an_abstract_ema_state_without_a_checkpoint_starts_fresh(tmp_path):
    """The first run of a job that resumes memory-safely: nothing to restore yet, so the
    described EMA state is initialised (an EmaState, its average equal to the params)."""
    step = EmaStep(jax.random.key(0), LinenMLP(hidden=8), optimizer=optax.adam(1e-2), train=True)
    state = step.restore_model(ema.init(step.abstract_state([1, 16])), tmp_path / "none")
    assert isinstance(state, ema.EmaState)
    for a, b in zip(leaves(state.ema_params), leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, b)
    state, _ = train_loop.TrainLoop(step)(state, iter([toy_data(8)]), num_steps=1)
    assert int(state.step) == 1


class Bf16Param(nn.Module):
    @nn.compact
    def __call__(self, x):
        return self.param("w", nn.initializers.ones, (4,), jnp.bfloat16)


class ClimbStep(step_lib.Step):
    """Loss -sum(w): SGD moves every bf16 parameter up by the learning rate each step."""

    def run(self, state, batch):
        def loss_fn(params):
            return -jnp.sum(state.apply_fn({"params": params}, batch).astype(jnp.float32))

        if not self.train:
            return state, {"loss": loss_fn(state.params)}
        grads = jax.grad(loss_fn)(state.params)
        state = ema.update(state.apply_gradients(grads=grads), 0.999)
        return state, {"w": state.params["w"][0]}


def test_bf16_parameters_are_averaged_in_float32():
    step = ClimbStep(jax.random.key(0), Bf16Param(), optimizer=optax.sgd(0.01), train=True)
    state = ema.init(step.initialize_model([1]))
    assert state.params["w"].dtype == jnp.bfloat16
    state, outputs = train_loop.TrainLoop(step)(state, iter([np.zeros(1, np.float32)] * 200),
                                                num_steps=200)
    # The average of the parameters each step had, in float64.
    expected = 1.0
    for w in outputs["w"]:
        expected = 0.999 * expected + 0.001 * float(w)
    assert expected > 1.15  # 0.1% of a step's climb is below bf16's resolution at 1.0
    assert state.ema_params["w"].dtype == jnp.float32
    # XLA may feed the update the sum before its rounding to bfloat16 (excess precision).
    np.testing.assert_allclose(leaves(state.ema_params)[0], expected, rtol=1e-3)
    # Evaluation swaps the average in as the model's bf16 parameters.
    _, out = eval_loop.EvalLoop(ClimbStep(jax.random.key(0), Bf16Param()), use_ema=True)(
        state, iter([np.zeros(1, np.float32)]))
    bf16_average = np.asarray(state.ema_params["w"].astype(jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(float(out["loss"][0]), -bf16_average.sum())
