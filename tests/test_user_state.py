"""The state a user holds is theirs: written as notebook cells would use it.

A notebook keeps the untrained state, trains, then uses both; it runs a cell twice; it sets
its own state class. None of this may delete or replace what the user holds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from flax import struct
from models import ClassifierStep, LinenMLP, toy_data

import jaxloop
from jaxloop import actions, eval_loop, outer_loop, partition, stop_handler, train_loop, types
from jaxloop import step as step_lib
from jaxloop.checkpointing import checkpoint

SPEC = [1, 16]


def _batches(n=8, batch_size=16, seed=0):
    data = toy_data(n * batch_size, seed=seed)
    return [{k: v[i * batch_size:(i + 1) * batch_size] for k, v in data.items()}
            for i in range(n)]


def _fsdp_steps():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    partitioner = partition.FSDPPartitioner(mesh, "data", min_weight_size=2**4)
    train = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                           partitioner=partitioner, train=True)
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP(), partitioner=partitioner)
    return train, evaluate


def _values(state):
    return jax.tree.map(np.asarray, state.params)


def _logits(state, batch):
    return np.asarray(state.apply_fn({"params": state.params}, batch["x"]))


def test_outer_loop_keeps_the_untrained_state_the_notebook_holds():
    train_step, eval_step = _fsdp_steps()
    batches = _batches()
    untrained = train_step.initialize_model(SPEC)           # cell 1: keep it
    before = _values(untrained)
    outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(train_step),
                                 eval_loops=[eval_loop.EvalLoop(eval_step)])
    trained, outputs = outer(untrained, train_dataset=batches * 4, train_total_steps=20,
                             train_loop_steps=5,
                             eval_specs=[outer_loop.EvalSpec(dataset=batches)])
    # cell 2: compare the untrained model with the trained one, side by side
    assert int(untrained.step) == 0 and int(trained.step) == 20
    jax.tree.map(np.testing.assert_array_equal, _values(untrained), before)
    assert not np.allclose(_logits(untrained, batches[0]), _logits(trained, batches[0]))
    # The caller's arrays keep their placement: still split as FSDP put them.
    kernel = untrained.params["dense1"]["kernel"]
    assert kernel.sharding == trained.params["dense1"]["kernel"].sharding
    assert len(outputs["loss"]) == 5


def test_running_the_training_cell_twice_keeps_every_state_the_user_had():
    train_step, _ = _fsdp_steps()
    loop = train_loop.TrainLoop(train_step)
    batches = _batches()
    state0 = train_step.initialize_model(SPEC)
    state1, _ = loop(state0, batches, num_steps=4)        # the cell, run once
    state2, _ = loop(state1, batches, num_steps=4)        # and again, on its result
    assert [int(s.step) for s in (state0, state1, state2)] == [0, 4, 8]
    for s in (state0, state1, state2):                     # none was deleted
        _values(s)
    # Training from the same state twice gives the same result: nothing was consumed.
    again, _ = loop(state1, batches, num_steps=4)
    jax.tree.map(np.testing.assert_array_equal, _values(again), _values(state2))


def test_a_direct_step_call_never_deletes_the_state_passed_in():
    train_step, _ = _fsdp_steps()
    batch = _batches(1)[0]
    state = train_step.initialize_model(SPEC)
    first, _ = train_step(state, batch)
    second, _ = train_step(state, batch)       # the same state again
    jax.tree.map(np.testing.assert_array_equal, _values(first), _values(second))
    assert int(state.step) == 0


def test_donate_input_state_consumes_the_state_passed_in_and_only_then():
    train_step, _ = _fsdp_steps()
    batches = _batches()
    kept = train_step.initialize_model(SPEC)
    consumed = train_step.initialize_model(SPEC)
    opt_in = train_loop.TrainLoop(train_step, donate_input_state=True)
    a, _ = train_loop.TrainLoop(train_step)(kept, batches, num_steps=3)
    b, _ = opt_in(consumed, batches, num_steps=3)
    assert not kept.params["dense1"]["kernel"].is_deleted()
    assert consumed.params["dense1"]["kernel"].is_deleted()
    jax.tree.map(np.testing.assert_array_equal, _values(a), _values(b))


def test_google_jaxloop_compile_donate_argnums_still_consumes():
    train_step, _ = _fsdp_steps()
    train_step.compile(donate_argnums=(0,))
    state = train_step.initialize_model(SPEC)
    new, _ = train_loop.TrainLoop(train_step)(state, _batches(), num_steps=2)
    assert state.params["dense1"]["kernel"].is_deleted()
    assert int(new.step) == 2


def test_a_training_loop_donates_the_states_it_produces():
    """Steady state keeps donation's memory: after the first step (which keeps the caller's
    state), each step is given the previous step's result and consumes it, so its output
    lands in the same buffers (the begin hook reads a buffer's address, keeping nothing)."""
    addresses = []

    class Recording(ClassifierStep):
        def begin(self, state, batch):
            shard = state.params["dense1"]["kernel"].addressable_shards[0]
            addresses.append(shard.data.unsafe_buffer_pointer())
            return state, batch

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    train_step = Recording(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                           partitioner=partition.DataParallelPartitioner(mesh, "data"),
                           train=True)
    state = train_step.initialize_model(SPEC)
    final, _ = train_loop.TrainLoop(train_step)(state, _batches(), num_steps=5)
    assert len(addresses) == 5
    assert len(set(addresses[1:])) == 1, addresses  # consumed: outputs reuse the inputs
    assert not state.params["dense1"]["kernel"].is_deleted()
    assert not final.params["dense1"]["kernel"].is_deleted()


# -- the state class is the user's ---------------------------------------------------------------


@struct.dataclass
class Metrics(clu_metrics.Collection):
    accuracy: clu_metrics.Accuracy
    loss: clu_metrics.Average.from_output("loss")


class MetricsState(types.TrainState):
    metrics: Metrics = Metrics.empty()


class MetricsStep(ClassifierStep):
    """google/jaxloop's notebooks' pattern: the step accumulates clu metrics in the state."""

    def run(self, state, batch):
        state, out = super().run(state, batch)
        update = Metrics.single_from_model_output(
            logits=out["logits"], labels=batch["y"], loss=out["loss"])
        return state.replace(metrics=state.metrics.merge(update)), {"loss": out["loss"]}


def test_initialize_model_builds_the_class_the_notebook_assigned(monkeypatch):
    # As google/jaxloop's notebooks do: assign the class to the modules, then build.
    monkeypatch.setattr(jaxloop.types, "TrainState", MetricsState)
    monkeypatch.setattr(jaxloop.step, "State", MetricsState)
    train = MetricsStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    state = train.initialize_model(SPEC)
    assert type(state) is MetricsState
    state, _ = train_loop.TrainLoop(train)(state, _batches(), num_steps=8)
    assert type(state) is MetricsState
    computed = state.metrics.compute()
    assert set(computed) == {"accuracy", "loss"} and 0.0 <= float(computed["accuracy"]) <= 1


def test_state_class_attribute_chooses_the_class_and_it_survives_resume(tmp_path):
    class MyStep(MetricsStep):
        state_class = MetricsState

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    partitioner = partition.DataParallelPartitioner(mesh, "data")
    train = MyStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1),
                   partitioner=partitioner, train=True)
    assert type(train.abstract_state(SPEC)) is MetricsState
    assert step_lib.State is types.TrainState  # no module was patched

    def outer():
        ckpt = actions.CheckpointAction(checkpoint.make_manager(tmp_path / "ckpt"))
        return outer_loop.OuterLoop(
            train_loop=train_loop.TrainLoop(train, end_actions=[ckpt]),
            checkpoint_spec=outer_loop.CheckpointSpec(tmp_path / "ckpt"))

    state, _ = outer()(train.initialize_model(SPEC), train_dataset=_batches() * 2,
                       train_total_steps=8, train_loop_steps=4)
    counts = state.metrics.accuracy.count
    # A new session: resume from the checkpoint onto an abstract state of the user's class.
    resumed, _ = outer()(train.abstract_state(SPEC), train_dataset=_batches() * 2,
                         train_total_steps=8, train_loop_steps=4)
    assert type(resumed) is MetricsState
    np.testing.assert_array_equal(np.asarray(resumed.metrics.accuracy.count),
                                  np.asarray(counts))
    assert int(np.asarray(counts)) == 8 * 16


# -- the loop's last edges -----------------------------------------------------------------------


class StopAt(actions.Action):
    def __init__(self, step):
        super().__init__(interval=1)
        self.step, self.saw = step, None

    def __call__(self, state, outputs, **kwargs):
        if int(state.step) >= self.step:
            self.saw = _values(state)
            raise stop_handler.StopTrainingError(f"stop at {int(state.step)}")


def test_early_stop_returns_the_live_state_the_action_saw():
    train_step, _ = _fsdp_steps()
    stop = StopAt(10)
    outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(train_step,
                                                                 end_actions=[stop]))
    kept = train_step.initialize_model(SPEC)
    state, outputs = outer(kept, train_dataset=_batches() * 10, train_total_steps=40,
                           train_loop_steps=5)
    assert int(state.step) == 10
    jax.tree.map(np.testing.assert_array_equal, _values(state), stop.saw)
    assert int(kept.step) == 0 and not kept.params["dense1"]["kernel"].is_deleted()
    assert outputs[outer_loop.STOP_LOOP] is True


def test_eval_loop_given_a_training_step_says_what_to_pass_before_any_step():
    train_step, _ = _fsdp_steps()
    with pytest.raises(ValueError, match=r"train=False"):
        eval_loop.EvalLoop(train_step)


def test_eval_only_outer_loop_keeps_the_state_it_is_given():
    train_step, eval_step = _fsdp_steps()
    state = train_step.initialize_model(SPEC)
    outer = outer_loop.OuterLoop(eval_loops=[eval_loop.EvalLoop(eval_step)])
    for _ in range(2):  # the eval cell, run twice
        same, outputs = outer(state, eval_specs=[outer_loop.EvalSpec(dataset=_batches())])
        assert float(jnp.mean(jnp.stack(outputs["loss"]))) > 0
    jax.tree.map(np.testing.assert_array_equal, _values(same), _values(state))
