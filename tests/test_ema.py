"""EMA of the parameters: updated in the step, checkpointed, evaluated by an eval loop."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import checkpoint, ema, eval_loop, partition, train_loop


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
        eval_loop.EvalLoop(step, use_ema=True)(plain, iter([toy_data(8)]))
