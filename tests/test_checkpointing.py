"""Exact resume (model, optimizer, data position, loop count), preemption, best-k, errors;
checkpoints of the previous release; restores that cannot use the saved data position."""

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import flax.serialization
import grain
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, data, outer_loop
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import train_loop as train_loop_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.launch import preemption

DATA = toy_data(200)


def make_dataset(kind):
    if kind == "global":
        return data.GlobalBatchDataset(data.ArraySource(DATA), 16, seed=3)
    examples = [{k: v[i] for k, v in DATA.items()} for i in range(200)]
    return grain.MapDataset.source(examples).shuffle(seed=3).repeat().batch(16)


def train(workdir, total, dataset_kind="global", loop_steps=4, extra_actions=(), interval=1):
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    manager = checkpoint.make_manager(workdir / "ckpt", max_to_keep=2)
    tl = train_loop_lib.TrainLoop(
        step, end_actions=[actions.CheckpointAction(manager, interval), *extra_actions])
    outer = outer_loop.OuterLoop(
        train_loop=tl, checkpoint_spec=outer_loop.CheckpointSpec(workdir / "ckpt"))
    state, _ = outer(step.initialize_model([1, 16]), iter(make_dataset(dataset_kind)),
                     train_total_steps=total, train_loop_steps=loop_steps)
    manager.close()
    return state, tl, outer


def assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a.params)),
                    jax.tree.leaves(jax.device_get(b.params)), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(jax.device_get(a.opt_state)),
                    jax.tree.leaves(jax.device_get(b.opt_state)), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kind", ["global", "grain"])
def test_resume_is_bit_identical_with_the_same_data_order(tmp_path, kind):
    uninterrupted, _, _ = train(tmp_path / "a", 24, kind)
    first, _, _ = train(tmp_path / "b", 12, kind)
    assert int(first.step) == 12
    resumed, tl, _ = train(tmp_path / "b", 24, kind)
    assert int(resumed.step) == 24
    assert tl.loop_count == 6  # 3 loops before the restart + 3 after
    assert_same_params(resumed, uninterrupted)


def test_loop_count_keeps_the_action_rhythm(tmp_path):
    calls = []

    class Record(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            calls.append(int(state.step))

    train(tmp_path, 8, extra_actions=[Record(interval=3)], loop_steps=2)
    train(tmp_path, 20, extra_actions=[Record(interval=3)], loop_steps=2)
    assert calls == [6, 12, 18]


def test_preemption_saves_at_the_step_boundary_and_resumes_exactly(tmp_path):
    class PreemptAt:
        interval = 1

        def __call__(self, state, outputs, per_loop_step_number, **kwargs):
            if per_loop_step_number == 3 and not preemption.requested():
                preemption.request()  # what the SIGTERM handler does

    uninterrupted, _, _ = train(tmp_path / "a", 16)
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          train=True, end_actions=[PreemptAt()])
    manager = checkpoint.make_manager(tmp_path / "b" / "ckpt", max_to_keep=2)
    tl = train_loop_lib.TrainLoop(step, end_actions=[actions.CheckpointAction(manager, 100)])
    outer = outer_loop.OuterLoop(train_loop=tl,
                                 checkpoint_spec=outer_loop.CheckpointSpec(tmp_path / "b" / "ckpt"))
    with pytest.raises(preemption.Preempted) as stopped:
        outer(step.initialize_model([1, 16]), iter(make_dataset("global")),
              train_total_steps=16, train_loop_steps=4)
    manager.close()
    state = stopped.value.state
    assert outer.preempted and int(state.step) == 3 and stopped.value.saved
    assert checkpoint.all_steps(tmp_path / "b" / "ckpt") == [3]
    assert not outer_loop.stop_marker_path(tmp_path / "b" / "ckpt").exists()
    assert not (tmp_path / "b" / "ckpt" / outer_loop._STOP_FILE_NAME).exists()
    resumed, _, _ = train(tmp_path / "b", 16)
    assert_same_params(resumed, uninterrupted)


def test_best_k_checkpoints_with_scripted_metrics(tmp_path):
    scripted = iter([0.9, 0.5, 0.7, 0.3, 0.8, 0.4])

    class Scripted(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            outputs["score"] = next(scripted)

    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP())
    best = checkpoint.make_best_manager(tmp_path / "best", "score", mode="min", k=2)
    latest = checkpoint.make_manager(tmp_path / "latest", max_to_keep=2)
    outer = outer_loop.OuterLoop(
        train_loop=train_loop_lib.TrainLoop(step, end_actions=[actions.CheckpointAction(latest)]),
        eval_loops=[eval_loop_lib.EvalLoop(
            evaluate, end_actions=[Scripted(), actions.BestCheckpointAction(best)])])
    batches = make_dataset("global")
    final, _ = outer(step.initialize_model([1, 16]), iter(batches), train_total_steps=12,
                     train_loop_steps=2, eval_specs=[outer_loop.EvalSpec([toy_data(16)])])
    best.close()
    latest.close()
    # Evals at steps 2..12 scored 0.9, 0.5, 0.7, 0.3, 0.8, 0.4: best two are steps 8 and 12.
    assert checkpoint.all_steps(tmp_path / "best") == [8, 12]
    assert checkpoint.all_steps(tmp_path / "latest") == [10, 12]
    restored = checkpoint.restore_best(evaluate.initialize_model([1, 16]), tmp_path / "best",
                                       "score", mode="min", skip_optimizer=True)
    assert int(restored.step) == 8
    with pytest.raises(ValueError, match="mode must be"):
        checkpoint.make_best_manager(tmp_path / "x", "score", mode="lowest")


def test_unreadable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    train(tmp_path, 4)
    step_dir = tmp_path / "ckpt" / "4" / "state"
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "wb") as f:
                f.write(b"not a checkpoint")
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    with pytest.raises(Exception) as err:
        step.restore_model(step.initialize_model([1, 16]), tmp_path / "ckpt")
    assert not isinstance(err.value, AssertionError)


def test_no_pickle_in_checkpoints(tmp_path):
    train(tmp_path, 4)
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "ckpt") for f in fs]
    assert files
    for path in files:
        with open(path, "rb") as f:
            head = f.read(2)
        assert not (len(head) == 2 and head[0] == 0x80 and head[1] <= 5), path


def test_restoring_a_different_structure_names_the_leaf(tmp_path):
    train(tmp_path, 4)
    other = ClassifierStep(jax.random.key(0), LinenMLP(hidden=8), optimizer=optax.adam(1e-2),
                           train=True)
    with pytest.raises(ValueError, match=r"leaf \S*dense1/\S+ has shape"):
        other.restore_model(other.initialize_model([1, 16]), tmp_path / "ckpt")
    sgd = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    with pytest.raises(ValueError, match="does not match the state's structure"):
        sgd.restore_model(sgd.initialize_model([1, 16]), tmp_path / "ckpt")


def test_fsdp_resume_and_restored_state_in_loops(tmp_path):
    from jaxloop import partition

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))

    def run(total):
        part = partition.FSDPPartitioner(mesh, "data", min_weight_size=64)
        step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                              partitioner=part, train=True)
        manager = checkpoint.make_manager(tmp_path / "ckpt")
        outer = outer_loop.OuterLoop(
            train_loop=train_loop_lib.TrainLoop(
                step, end_actions=[actions.CheckpointAction(manager)]),
            checkpoint_spec=outer_loop.CheckpointSpec(tmp_path / "ckpt"))
        state, _ = outer(step.initialize_model([1, 16]), iter(make_dataset("global")),
                         train_total_steps=total, train_loop_steps=4)
        manager.close()
        return state, step

    run(4)
    state, step = run(8)
    assert int(state.step) == 8
    restored, meta = checkpoint.restore(step.initialize_model([1, 16]), tmp_path / "ckpt",
                                        partitioner=step.partitioner)
    assert meta["dataset_state"]["next_batch"] == 8  # the position is there for the user
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP(), partitioner=step.partitioner)
    _, outputs = eval_loop_lib.EvalLoop(evaluate)(restored, [toy_data(16)])
    assert len(outputs["loss"]) == 1


# --- issue 22.3: host data beside the state ---------------------------------------------------


def test_the_train_state_holds_arrays_only():
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    leaves = jax.tree.leaves(step.initialize_model([1, 16]))
    assert leaves and all(isinstance(x, jax.Array) for x in leaves)
    assert "dataset_state" not in flax.serialization.to_state_dict(step.initialize_model([1, 16]))


@pytest.mark.parametrize("kind", ["global", "grain"])
def test_a_train_loop_called_directly_resumes_through_restore(tmp_path, kind):
    """The data position comes back through `checkpoint.restore(..., dataset=it)`: a
    TrainLoop called by hand on the restored state continues exactly."""
    def new_step():
        return ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                              train=True)

    step = new_step()
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    loop = train_loop_lib.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)])
    it = iter(make_dataset(kind))
    state, _ = loop(step.initialize_model([1, 16]), it, num_steps=4)
    uninterrupted, _ = loop(state, it, num_steps=4)
    manager.close()

    step = new_step()
    it = iter(make_dataset(kind))  # a fresh iterator: restore moves it
    state, meta = checkpoint.restore(step.initialize_model([1, 16]), tmp_path / "ckpt",
                                     step=4, dataset=it)
    assert int(state.step) == 4 and meta["loop_count"] == 1
    resumed, _ = train_loop_lib.TrainLoop(step)(state, it, num_steps=4)
    assert_same_params(resumed, uninterrupted)
    with pytest.raises(ValueError, match="no set_state"):
        checkpoint.restore(step.initialize_model([1, 16]), tmp_path / "ckpt",
                           dataset=iter([toy_data(16)]))


FIXTURE = Path(__file__).resolve().parent / "data" / "digits-0d51892"


def test_the_previous_releases_digits_checkpoint_restores_with_its_data_position(tmp_path):
    """The digits job's step-50 checkpoint written by jaxloop 0d51892 (tests/data, see its
    README): arrays into place, the loop count, and the position that release kept in
    TrainState.dataset_state, now given to the iterator."""
    from jaxloop import partition
    from jaxloop.examples import digits

    shutil.copytree(FIXTURE / "checkpoints", tmp_path / "ckpt")
    part = partition.DataParallelPartitioner(
        jax.sharding.Mesh(np.array(jax.devices()), ("data",)), "data")
    step = digits.DigitsStep(jax.random.key(0), digits.CNN(), optimizer=optax.adam(3e-3),
                             partitioner=part, train=True)
    train_data, _ = digits.load_digits()
    dataset = data.GlobalBatchDataset(data.ArraySource(train_data), 64, seed=0)
    it = iter(dataset)
    state, meta = checkpoint.restore(step.abstract_state([1, 8, 8, 1]), tmp_path / "ckpt",
                                     partitioner=part, dataset=it)
    assert int(state.step) == 50 and meta["loop_count"] == 1
    assert step.compute_num_params(state) == 38282
    assert data.iterator_state(it)["next_batch"] == 50
    fresh = iter(dataset)
    for _ in range(50):
        next(fresh)
    np.testing.assert_array_equal(next(it)["image"], next(fresh)["image"])
    _, outputs = train_loop_lib.TrainLoop(step)(state, it, num_steps=2)
    assert np.isfinite(actions.scalar_metrics(outputs)["loss"])


class ReleaseTrainState(train_state.TrainState):
    """jaxloop.types.TrainState as the previous release (0d51892) defined it."""

    batch_stats: Any = None
    dataset_state: Any = None


def test_a_whole_state_of_the_previous_release_saved_the_guide_way_restores(tmp_path):
    """A single-item `args.PyTreeSave(state)` of the old TrainState, with the data position
    inside the state (where that release kept it), restores into today's state."""
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    state, _ = train_loop_lib.TrainLoop(step)(step.initialize_model([1, 16]),
                                              iter(make_dataset("global")), num_steps=3)
    old = ReleaseTrainState(
        step=state.step, apply_fn=state.apply_fn, params=state.params, tx=state.tx,
        opt_state=state.opt_state, batch_stats=None,
        dataset_state={"next_batch": 3, "global_batch_size": 16, "seed": 3},
    )
    manager = ocp.CheckpointManager(tmp_path / "guide",
                                    ocp.Checkpointer(ocp.PyTreeCheckpointHandler()))
    manager.save(3, args=ocp.args.PyTreeSave(old))
    manager.wait_until_finished()
    manager.close()
    fresh = ClassifierStep(jax.random.key(1), LinenMLP(), optimizer=optax.adam(1e-2),
                           train=True)
    restored = fresh.restore_model(fresh.initialize_model([1, 16]), tmp_path / "guide")
    assert int(restored.step) == 3
    assert_same_params(restored, state)


# --- issue 23.13: a restore on another process count says so ---------------------------------


def test_a_restore_on_another_process_count_does_not_drop_the_data_position_silently(
        tmp_path, caplog):
    """A checkpoint of a 2-process job with a per-process pipeline (grain): its positions
    cannot serve this 1-process job. Given the iterator, restore raises; a training
    restore without it (`Step.restore_model`) warns; an evaluation restore needs none."""
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    state = step.initialize_model([1, 16])
    it = iter(make_dataset("grain"))
    positions = []
    for _ in range(2):  # what each process's own grain iterator reports
        next(it)
        positions.append(data.iterator_state(it))
    # The layout a 2-process CheckpointAction writes: the arrays, and the JSON item with
    # each process's position.
    manager = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("state", "meta"))
    manager.save(2, args=ocp.args.Composite(
        state=ocp.args.PyTreeSave(checkpoint.state_arrays(state.replace(step=2))),
        meta=ocp.args.JsonSave({"dataset_state": positions[0], "dataset_states": positions,
                                "process_count": 2, "loop_count": 1})))
    manager.wait_until_finished()
    manager.close()

    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        restored = step.restore_model(state, tmp_path / "ckpt")
    assert int(restored.step) == 2
    (warning,) = [r.getMessage() for r in caplog.records if r.name.startswith("jaxloop")]
    assert "data positions are not restored" in warning
    assert "2 process(es), but this job has 1" in warning
    with pytest.raises(ValueError, match="data positions of 2 process.*this job has 1"):
        checkpoint.restore(state, tmp_path / "ckpt", dataset=iter(make_dataset("grain")))
    caplog.clear()
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP())
    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        evaluate.restore_model(evaluate.initialize_model([1, 16]), tmp_path / "ckpt")
    assert not [r for r in caplog.records if r.name.startswith("jaxloop")]
