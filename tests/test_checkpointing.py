"""Exact resume (model, optimizer, data position, loop count), preemption, best-k, errors."""

import os

import grain
import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, checkpoint, data, outer_loop, preemption
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import train_loop as train_loop_lib

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
    state, _ = outer(step.initialize_model([1, 16]), iter(make_dataset("global")),
                     train_total_steps=16, train_loop_steps=4)
    manager.close()
    assert outer.preempted and int(state.step) == 3
    assert checkpoint.all_steps(tmp_path / "b" / "ckpt") == [3]
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
    state, step = run(8)  # resumes; the restored data position must not reach the step
    assert int(state.step) == 8 and state.dataset_state is None
    restored = step.restore_model(step.initialize_model([1, 16]), tmp_path / "ckpt")
    assert restored.dataset_state is not None  # the position is there for the user
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP(), partitioner=step.partitioner)
    _, outputs = eval_loop_lib.EvalLoop(evaluate)(restored, [toy_data(16)])
    assert len(outputs["loss"]) == 1
