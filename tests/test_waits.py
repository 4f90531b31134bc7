"""Where the host waits for the device: only to bound the steps in flight, and at a loop
boundary only where an action needs a value. Counted as a user's cell runs them: the same
loop called again on the state it returned."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import io_callback
from models import ClassifierStep, LinenMLP
from test_performance import BATCHES, forever

from jaxloop import actions, eval_loop, outer_loop, partition, stat_loop, train_loop
from jaxloop.engine import program


class SilentStep(ClassifierStep):
    """A training step that returns no outputs at all."""

    def run(self, state, batch):
        state, _ = super().run(state, batch)
        return state, None


@pytest.fixture
def waits(monkeypatch):
    """Counts the host's waits for the device while `waits.counting` is set: every
    `block_until_ready` (the array method and `jax.block_until_ready`) and every read of a
    device value into the host (where float(), int(), np.asarray and jax.device_get meet:
    the array's `_value`; on CPU the transfer guard sees no transfer)."""
    array_type = type(jnp.zeros(()))
    value, block = array_type._value, array_type.block_until_ready
    api_block = jax.block_until_ready

    class Waits:
        counting = False
        blocks = 0
        reads = 0
        waited = 0  # blocks and reads of a value the device had not computed yet

    def unready(tree):
        return any(not x.is_ready() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))

    def read(self):
        if Waits.counting:
            Waits.reads += 1
            Waits.waited += unready(self)
        return value.fget(self)

    def blocked(self):
        if Waits.counting:
            Waits.blocks += 1
            Waits.waited += unready(self)
        return block(self)

    def api_blocked(tree):
        if Waits.counting:
            Waits.blocks += 1
            Waits.waited += unready(tree)
        return api_block(tree)

    monkeypatch.setattr(array_type, "_value", property(read))
    monkeypatch.setattr(array_type, "block_until_ready", blocked)
    monkeypatch.setattr(jax, "block_until_ready", api_blocked)
    return Waits


@pytest.mark.parametrize("spe", [1, 4])
def test_a_step_without_outputs_waits_only_beyond_the_bound(waits, spe):
    step = SilentStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    loop = train_loop.TrainLoop(step, max_steps_in_flight=4, steps_per_execution=spe)
    data = forever()
    state, _ = loop(step.initialize_model([1, 16]), data, num_steps=8)  # compiles
    waits.counting = True
    state, outputs = loop(state, data, num_steps=40)
    waits.counting = False
    executions = 40 // spe
    assert int(state.step) == 48 and "loss" not in outputs
    # Once 4 are in flight the host waits until 2 remain: one wait per two executions,
    # never one per step for want of an output to wait on.
    assert executions // 2 - 1 <= waits.blocks <= executions // 2 + 1 and waits.reads == 0


def test_a_loop_boundary_without_actions_waits_for_nothing(waits):
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          train=True)
    loop = train_loop.TrainLoop(step, max_steps_in_flight=100)
    data = forever()
    state, _ = loop(step.initialize_model([1, 16]), data, num_steps=5)  # compiles
    waits.counting = True
    for _ in range(3):  # a cell run three times on the state it returned
        state, outputs = loop(state, data, num_steps=10)
    waits.counting = False
    assert waits.blocks == 0 and waits.reads == 0
    assert loop.first_step == 25 and int(state.step) == 35
    assert loop.stats[stat_loop.STAT_STEPS_PER_SEC] > 0
    assert stat_loop.STAT_STEPS_PER_SEC not in outputs  # none asked for, as the reference


def test_a_summary_at_the_boundary_reads_only_its_values(waits):
    written = []

    class Writer:
        def write_scalars(self, step, scalars):
            written.append((step, dict(scalars)))

        def flush(self):
            pass

    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          train=True)
    loop = train_loop.TrainLoop(step, max_steps_in_flight=100,
                                end_actions=[actions.SummaryAction(Writer())])
    data = forever()
    state, _ = loop(step.initialize_model([1, 16]), data, num_steps=5)
    written.clear()
    waits.counting = True
    state, _ = loop(state, data, num_steps=10)
    waits.counting = False
    assert [s for s, _ in written] and written[-1][0] == 15
    # The summary's values come over in a few reads; the state is never read.
    assert 0 < waits.reads <= 4 and waits.blocks == 0


def test_donate_argnums_names_runs_own_argument():
    class Scaled(ClassifierStep):
        def run(self, state, batch, scale):
            state, outputs = super().run(state, batch)
            return state, {"loss": outputs["loss"] * scale}

    step = Scaled(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    step.compile(donate_argnums=(2,))
    state = step.initialize_model([1, 16])
    batch = jax.device_put(BATCHES[0])
    scale = jnp.ones(())
    new, outputs = step(state, batch, 1, scale=scale)
    assert scale.is_deleted()  # argument 2 of run, as written
    assert not any(x.is_deleted() for x in jax.tree.leaves(batch))  # the batch is kept
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    assert np.isfinite(float(outputs["loss"])) and int(new.step) == 1

    part = partition.SingleDevicePartitioner()
    fn = program.Program(lambda s, b, extra: (s, {"n": jnp.sum(b["x"]) + extra}), part,
                         donate_argnames=("extra",))
    extra = jnp.ones(())
    fn(state, batch, extra=extra)
    assert extra.is_deleted() and not any(x.is_deleted() for x in jax.tree.leaves(batch))


def test_an_eval_step_follows_the_state_of_a_train_step_built_later():
    """A notebook: the eval step of an earlier cell evaluates the state of a train step
    built in a later cell with a new optimizer (another tree structure)."""
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP(), train=False)
    evaluator = eval_loop.EvalLoop(evaluate)
    for lr in (1e-2, 1e-3):  # the training cell, run twice with a new optax.adam
        step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(lr),
                              train=True)
        state, _ = train_loop.TrainLoop(step)(step.initialize_model([1, 16]), forever(),
                                             num_steps=3)
        _, outputs = evaluator(state, iter(BATCHES[:2]))
        assert len(outputs["loss"]) == 2


class DeviceBoundStep(ClassifierStep):
    """A step whose device time includes a sleep inside the computation. (jaxlib runs a
    program holding a host callback in the thread that dispatches it, so on CPU the host
    waits out each step in its dispatch; the waits counted are the loop's own: blocks and
    reads at its boundaries.)"""

    def run(self, state, batch):
        state, outputs = super().run(state, batch)
        slept = io_callback(lambda x: time.sleep(0.003) or np.float32(0),
                            jax.ShapeDtypeStruct((), np.float32), outputs["loss"])
        return state, dict(outputs, loss=outputs["loss"] + slept)


def test_an_outer_loop_without_actions_waits_for_nothing_between_loops(waits):
    step = DeviceBoundStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                           train=True)
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step, max_steps_in_flight=100),
                                 progress=False)
    data = forever()
    state, _ = outer(step.initialize_model([1, 16]), data, train_total_steps=5,
                     train_loop_steps=5)
    waits.counting = True
    state, outputs = outer(state, data, train_total_steps=35, train_loop_steps=10)
    waits.counting = False
    assert waits.waited == 0 and waits.blocks == 0
    assert len(outputs["loss"]) == 10 and int(state.step) == 35
    assert len(outer.history["train/loss"].steps) == 35  # read once computed, never waited
