"""Telemetry outputs: norms and learning rate computed in the step, written by SummaryAction."""

import jax
import numpy as np
import optax
import pytest
from models import LinenMLP, toy_data

from jaxloop import actions, train_loop
from jaxloop import step as step_lib
from jaxloop.metrics import writers
from jaxloop.recipes import telemetry

eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

SCHEDULE = optax.linear_schedule(0.1, 0.01, transition_steps=4)


class TelemetryStep(step_lib.Step):
    def __init__(self, *args, learning_rate=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.learning_rate = learning_rate

    def run(self, state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        new_state = state.apply_gradients(grads=grads)
        return new_state, {
            "loss": loss,
            **telemetry.train_metrics(state, grads, new_state, self.learning_rate),
        }


@pytest.mark.parametrize("how", ["inject_hyperparams", "schedule"])
def test_norms_and_learning_rate_are_right_and_written_as_scalars(tmp_path, how):
    if how == "inject_hyperparams":
        tx, lr = optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE), None
    else:
        tx, lr = optax.sgd(SCHEDULE), SCHEDULE
    step = TelemetryStep(jax.random.key(0), LinenMLP(), optimizer=tx, train=True,
                         learning_rate=lr)
    state = step.initialize_model([1, 16])
    first = toy_data(32, seed=0)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, first["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, first["y"]).mean()

    grads = jax.grad(loss_fn)(state.params)
    expected_grad_norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads)))

    writer = writers.SummaryWriter(str(tmp_path))
    loop = train_loop.TrainLoop(step, end_actions=[actions.SummaryAction(writer)])
    state, outputs = loop(state, iter([toy_data(32, seed=i) for i in range(4)]), num_steps=4)
    writer.close()

    grad_norms = np.array([float(v) for v in outputs[telemetry.GRAD_NORM]])
    update_norms = np.array([float(v) for v in outputs[telemetry.UPDATE_NORM]])
    lrs = np.array([float(v) for v in outputs[telemetry.LEARNING_RATE]])
    np.testing.assert_allclose(grad_norms[0], expected_grad_norm, rtol=1e-5)
    np.testing.assert_allclose(lrs, [SCHEDULE(i) for i in range(4)], rtol=1e-6)
    # Plain SGD moves the parameters by exactly lr * |g|.
    np.testing.assert_allclose(update_norms, lrs * grad_norms, rtol=1e-4)
    param_norm = np.sqrt(sum(np.sum(np.square(p))
                             for p in jax.tree.leaves(jax.device_get(state.params))))
    np.testing.assert_allclose(float(outputs[telemetry.PARAM_NORM][-1]), param_norm, rtol=1e-5)

    acc = eam.EventAccumulator(str(tmp_path), size_guidance={eam.SCALARS: 0})
    acc.Reload()
    for key, values in ((telemetry.LEARNING_RATE, lrs), (telemetry.GRAD_NORM, grad_norms)):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3, 4]
        np.testing.assert_allclose([e.value for e in events], values, rtol=1e-6)


def test_without_new_state_or_learning_rate():
    out = telemetry.train_metrics(
        step_lib.types.TrainState.create(apply_fn=None, params={"w": np.ones(4, np.float32)},
                                         tx=optax.sgd(0.1)),
        {"w": np.full(4, 0.5, np.float32)})
    assert set(out) == {telemetry.GRAD_NORM, telemetry.PARAM_NORM}
    np.testing.assert_allclose(out[telemetry.GRAD_NORM], 1.0)
    np.testing.assert_allclose(out[telemetry.PARAM_NORM], 2.0)
    assert telemetry.injected_hyperparam(optax.sgd(0.1).init({"w": np.ones(2)})) is None
    # Found inside chains and MultiSteps; the first of two injected optimizers wins.
    inject = optax.inject_hyperparams(optax.sgd)
    tx = optax.MultiSteps(optax.chain(optax.clip(1.0), inject(learning_rate=SCHEDULE),
                                      inject(learning_rate=0.5)), 2)
    np.testing.assert_allclose(telemetry.injected_hyperparam(tx.init({"w": np.ones(2)})), 0.1)
