"""Non-finite guard: skipped updates agreed across devices, or an error at the loop end that
leaves the last good checkpoint the latest."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from models import LinenMLP, toy_data

from jaxloop import actions, outer_loop, partition, train_loop
from jaxloop import step as step_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.recipes import guard


@jax.custom_vjp
def _scale_grad(x, s):
    return x


_scale_grad.defvjp(lambda x, s: (x, s), lambda s, g: (g * s, None))


class GuardedStep(step_lib.Step):
    """Cross-entropy; batch['poison'] (inf) makes dense2's bias gradient infinite only."""

    def __init__(self, *args, guard_obj, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard = guard_obj

    def run(self, state, batch):
        def loss_fn(params):
            bias = _scale_grad(params["dense2"]["bias"], batch["poison"][0])
            params = {**params, "dense2": {**params["dense2"], "bias": bias}}
            logits = state.apply_fn({"params": params}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state, outs = self.guard.apply_gradients(state, grads, loss)
        return state, {"loss": loss, **outs}


def batch(seed, x_nan=False, poison=False, n=64):
    b = toy_data(n, seed=seed)
    if x_nan:
        b["x"][3, 0] = np.nan  # one example, held by the first device under DP
    b["poison"] = np.full((n,), np.inf if poison else 1.0, np.float32)
    return b


def make_step(mode, part=None):
    return GuardedStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True,
                       partitioner=part, guard_obj=guard.NonFiniteGuard(mode))


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_skip_is_agreed_by_every_device_and_counted(kind):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    part = (partition.DataParallelPartitioner(mesh) if kind == "dp"
            else partition.FSDPPartitioner(mesh, min_weight_size=64))
    step = make_step("skip", part)
    state = step.initialize_model([1, 16])
    state, out = step(state, batch(0))
    assert int(out[guard.SKIPPED]) == 0
    before = jax.device_get(state.params), jax.device_get(state.opt_state)
    state, out = step(state, batch(1, x_nan=True))
    assert int(out[guard.SKIPPED]) == 1
    assert int(state.step) == 2  # the counter advances; nothing else changes
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state)),
                    strict=True):
        for shard in b.addressable_shards:  # every device kept its old values
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(a)[shard.index])
    state, out = step(state, batch(2))
    assert int(out[guard.SKIPPED]) == 0
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


def test_skipped_steps_summed_over_a_loop():
    step = make_step("skip")
    loop = train_loop.TrainLoop(step)
    data = iter([batch(0), batch(1, poison=True), batch(2, x_nan=True), batch(3)])
    state, outputs = loop(step.initialize_model([1, 16]), data, num_steps=4)
    assert [int(v) for v in outputs[guard.SKIPPED]] == [0, 1, 1, 0]
    assert int(state.step) == 4


def test_raise_names_step_and_leaf_and_keeps_last_good_checkpoint(tmp_path):
    step = make_step("raise")
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=5)
    tl = train_loop.TrainLoop(step, end_actions=[step.guard.action(),
                                                 actions.CheckpointAction(manager)])
    outer = outer_loop.OuterLoop(train_loop=tl)
    # Loops of 3 steps: steps 1-3 and 4-6 are good; step 8 (batch 7) has an inf gradient.
    data = iter([batch(i, poison=(i == 7)) for i in range(12)])
    with pytest.raises(guard.NonFiniteError) as err:
        outer(step.initialize_model([1, 16]), data, train_total_steps=12, train_loop_steps=3)
    manager.wait_until_finished()
    assert err.value.step == 8
    assert err.value.leaf == "grads['dense2']['bias']"
    assert "step 8" in str(err.value) and "['dense2']['bias']" in str(err.value)
    assert checkpoint.all_steps(tmp_path / "ckpt") == [3, 6]
    manager.close()


def test_raise_names_the_loss_first_and_bad_mode_is_rejected():
    step = make_step("raise")
    state = step.initialize_model([1, 16])
    state, out = step(state, batch(0, x_nan=True))
    with pytest.raises(guard.NonFiniteError, match="step 1: loss is NaN or Inf"):
        step.guard.check({k: [v] for k, v in out.items()}, int(state.step))
    with pytest.raises(ValueError, match="'skip' or 'raise'"):
        guard.NonFiniteGuard("ignore")
    assert bool(guard.all_finite(1.0, {"a": np.ones(3)}))
    assert not bool(guard.all_finite({"a": np.array([1.0, np.inf])}))
