"""`checkpoint.restore` reads every kind of checkpoint restore, and says what it resumed."""

import logging

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, eval_loop, outer_loop, partition, train_loop
from jaxloop.checkpointing import checkpoint

DATA = toy_data(64)
BATCHES = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 64, 16)]


def forever():
    while True:
        yield from BATCHES


def train_step(**kwargs):
    return ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True,
                          **kwargs)


def same(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)),
                    strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Four loops of two steps, the latest checkpoints and the best by a scripted score."""
    workdir = tmp_path_factory.mktemp("run")
    scores = iter([0.9, 0.2, 0.7, 0.5])

    class Score(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            outputs["score"] = next(scores)

    step = train_step()
    latest = checkpoint.make_manager(workdir / "latest", max_to_keep=None)
    best = checkpoint.make_best_manager(workdir / "best", "score", k=2)
    states = {}

    class Keep(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            states[int(state.step)] = jax.device_get(state)

    outer = outer_loop.OuterLoop(
        train_loop=train_loop.TrainLoop(step, end_actions=[
            actions.CheckpointAction(latest), Keep()]),
        eval_loops=[eval_loop.EvalLoop(ClassifierStep(jax.random.key(0), LinenMLP()),
                                       end_actions=[Score(), actions.BestCheckpointAction(best)])])
    outer(step.initialize_model([1, 16]), forever(), train_total_steps=8, train_loop_steps=2,
          eval_specs=[outer_loop.EvalSpec(BATCHES[:1])])
    latest.close()
    best.close()
    return workdir, states


@pytest.mark.slow
def test_one_restore_reads_full_abstract_best_partial_and_guide_checkpoints(run, tmp_path):
    workdir, states = run
    step = train_step()

    # Full: the newest checkpoint, with its metadata.
    state, meta = checkpoint.restore(step.initialize_model([1, 16]), workdir / "latest")
    assert int(state.step) == 8 and meta["loop_count"] == 4
    same(state.params, states[8].params)
    same(state.opt_state, states[8].opt_state)

    # Onto an abstract state, placed by the partitioner.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.FSDPPartitioner(mesh, "data", min_weight_size=64)
    sharded = train_step(partitioner=part)
    state, _ = checkpoint.restore(sharded.abstract_state([1, 16]), workdir / "latest", step=4,
                                  partitioner=part)
    assert int(state.step) == 4 and not state.params["dense1"]["kernel"].is_fully_replicated
    same(state.params, states[4].params)

    # The best by the saved metric (scores 0.9, 0.2, 0.7, 0.5 at steps 2, 4, 6, 8).
    state, _ = checkpoint.restore(step.initialize_model([1, 16]), workdir / "best",
                                  best="score", mode="min")
    assert int(state.step) == 4
    state, _ = checkpoint.restore(step.initialize_model([1, 16]), workdir / "best",
                                  best="score", mode="max")
    assert int(state.step) == 8  # of the two kept (4 and 8)
    with pytest.raises(ValueError, match="No checkpoint with metric 'f1'"):
        checkpoint.restore(step.initialize_model([1, 16]), workdir / "best", best="f1")

    # Partial: only the leaves asked for (one layer's kernel), shaped as the checkpoint's.
    kernel = states[6].params["dense1"]["kernel"]
    part_state, _ = checkpoint.restore(
        {"params": {"dense1": {"kernel": jax.ShapeDtypeStruct(kernel.shape, kernel.dtype)}}},
        workdir / "latest", step=6, partial=True)
    assert jax.tree.structure(part_state) == jax.tree.structure(
        {"params": {"dense1": {"kernel": 0}}})
    same(part_state["params"]["dense1"]["kernel"], kernel)

    # A whole state saved the guide's way (one unnamed item, tuples stored as lists).
    guide = ocp.CheckpointManager(tmp_path / "guide", ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler()), ocp.CheckpointManagerOptions(max_to_keep=3))
    guide.save(6, args=ocp.args.PyTreeSave(states[6]))
    guide.wait_until_finished()
    guide.close()
    state, meta = checkpoint.restore(step.initialize_model([1, 16]), tmp_path / "guide")
    assert int(state.step) == 6 and meta == {}
    same(state.opt_state, states[6].opt_state)


def _records(caplog):
    return [r for r in caplog.records if r.levelno >= logging.INFO]


def _assert_resumed_quietly(caplog, step, directory):
    messages = [r.getMessage() for r in _records(caplog)]
    assert f"Resumed from step {step} of {directory}." in messages, messages
    assert not [m for m in messages if "read only" in m.lower() or "read_only" in m.lower()]


@pytest.mark.slow
def test_resuming_logs_the_step_and_directory_and_no_read_only_warnings(run, caplog):
    workdir, _ = run
    caplog.set_level(logging.INFO)  # every logger, orbax's (absl) included
    step = train_step()
    step.restore_model(step.initialize_model([1, 16]), workdir / "latest")
    _assert_resumed_quietly(caplog, 8, workdir / "latest")

    caplog.clear()
    outer = outer_loop.OuterLoop(
        train_loop=train_loop.TrainLoop(step),
        checkpoint_spec=outer_loop.CheckpointSpec(workdir / "latest"))
    state, _ = outer(step.initialize_model([1, 16]), forever(), train_total_steps=8,
                     train_loop_steps=2)
    assert int(state.step) == 8  # resumed at the end: nothing left to train
    _assert_resumed_quietly(caplog, 8, workdir / "latest")


@pytest.mark.slow
def test_a_jaxloop_manager_continuing_a_guide_way_directory_saves_jaxloop_s_layout(tmp_path):
    """The layout of what `save` writes comes from the manager, not from the checkpoints
    already in its directory: jaxloop's manager keeps the data position and loop count even
    where the guide's single-item checkpoints came first."""
    step = train_step()
    state, _ = train_loop.TrainLoop(step)(step.initialize_model([1, 16]), forever(),
                                          num_steps=2)
    guide = ocp.CheckpointManager(tmp_path, ocp.Checkpointer(ocp.PyTreeCheckpointHandler()))
    guide.save(2, args=ocp.args.PyTreeSave(state))
    guide.wait_until_finished()
    guide.close()
    manager = checkpoint.make_manager(tmp_path, max_to_keep=None)
    outer = outer_loop.OuterLoop(
        train_loop=train_loop.TrainLoop(train_step(), end_actions=[
            actions.CheckpointAction(manager)]),
        checkpoint_spec=outer_loop.CheckpointSpec(tmp_path))
    outer(train_step().initialize_model([1, 16]), forever(), train_total_steps=4,
          train_loop_steps=2)
    manager.close()
    assert checkpoint.all_steps(tmp_path) == [2, 4]
    assert checkpoint.read_meta(tmp_path, 2) == {}
    assert checkpoint.read_meta(tmp_path, 4)["loop_count"] == 2


def test_a_relative_checkpoint_directory_saves_and_restores(tmp_path, monkeypatch):
    # A notebook writes make_manager('ckpt'); orbax's writers need absolute paths.
    monkeypatch.chdir(tmp_path)
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    state = step.initialize_model([1, 16])
    manager = checkpoint.make_manager("ckpt")
    checkpoint.save(manager, 0, state)
    manager.wait_until_finished()
    assert checkpoint.all_steps(tmp_path / "ckpt") == [0]
    restored = step.restore_model(step.abstract_state([1, 16]), "ckpt")
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.params),
                 jax.tree.map(np.asarray, state.params))
