"""Loops and their data: eval means over examples, data positions restored or refused,
and the warning for iterators that cannot be checkpointed."""

from __future__ import annotations

import logging

import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, data, eval_loop, outer_loop, train_loop
from jaxloop.checkpointing import checkpoint
from jaxloop.metrics import writers

eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
pytestmark = pytest.mark.timeout(300)


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """The scalar events TensorBoard reads back from `logdir`."""
    acc = eam.EventAccumulator(str(logdir), size_guidance={eam.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class MaskedStep(ClassifierStep):
    """Eval step whose outputs are means over the real (masked) examples of its batch."""

    def run(self, state, batch):
        logits = state.apply_fn({"params": state.params}, batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        weights = batch["mask"].astype(np.float32) if "mask" in batch else np.float32(1.0)
        weights = weights * jax.numpy.ones_like(losses)
        return state, {
            "loss": (losses * weights).sum() / weights.sum(),
            "correct": ((jax.numpy.argmax(logits, -1) == batch["y"]) * weights).sum()
            / weights.sum(),
            "per_example_loss": losses,  # per-example: never a summary
        }


def exact(state, x, y):
    logits = state.apply_fn({"params": state.params}, x)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return float(np.mean(np.asarray(losses, np.float64))), float(
        np.mean(np.argmax(logits, -1) == y))


@pytest.mark.parametrize("kind", ["padded-mask", "smaller-last", "prefetched"])
def test_eval_summary_is_the_mean_over_examples(tmp_path, kind):
    evaluate = MaskedStep(jax.random.key(0), LinenMLP())
    state = evaluate.initialize_model([1, 16])
    test = toy_data(40, seed=5)  # batches of 16: 16 + 16 + 8 real examples
    if kind == "smaller-last":
        batches = [{k: v[i:i + 16] for k, v in test.items()} for i in range(0, 40, 16)]
    else:
        batches = list(data.pad_to_global_batches(test, 16))
    if kind == "prefetched":  # what OuterLoop's device prefetcher hands the loop
        batches = [evaluate.prepare_batch(b) for b in batches]
    writer = writers.SummaryWriter(str(tmp_path / "eval"))
    loop = eval_loop.EvalLoop(evaluate, end_actions=[actions.SummaryAction(writer)])
    _, outputs = loop(state, iter(batches))
    writer.close()
    assert [int(c) for c in loop.example_counts] == [16, 16, 8]
    loss, accuracy = exact(state, test["x"], test["y"])
    written = scalars(tmp_path / "eval")
    assert written["loss"] == [(0, pytest.approx(loss, rel=1e-5))]
    assert written["correct"] == [(0, pytest.approx(accuracy, rel=1e-5))]
    assert "per_example_loss" not in written and not any("example" in k for k in written)
    # The mean of batch means differs here: the test would catch the old behaviour.
    batch_means = np.mean([float(x) for x in outputs["loss"]])
    assert abs(batch_means - loss) > 1e-4
    assert actions.scalar_metrics(outputs, loop=loop)["loss"] == pytest.approx(loss, rel=1e-5)


def make_train(tmp_path, manager=None):
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          train=True)
    end = [actions.CheckpointAction(manager)] if manager is not None else []
    return step, train_loop.TrainLoop(step, end_actions=end)


def test_a_restore_given_the_train_iterator_moves_it_to_the_saved_position(tmp_path):
    ds = data.GlobalBatchDataset(toy_data(128), 16, seed=2)
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    step, loop = make_train(tmp_path, manager)
    loop(step.initialize_model([1, 16]), iter(ds), num_steps=3)
    manager.wait_until_finished()

    # Host data travels beside the state: the restore moves the iterator, like OuterLoop.
    it = iter(ds)
    state, _ = checkpoint.restore(step.initialize_model([1, 16]), tmp_path / "ckpt",
                                  dataset=it)
    assert it.get_state()["next_batch"] == 3 and not hasattr(state, "dataset_state")
    state, _ = make_train(tmp_path)[1](state, it, num_steps=1)
    assert int(state.step) == 4 and it.get_state()["next_batch"] == 4

    evaluate = ClassifierStep(jax.random.key(0), LinenMLP())
    _, outputs = eval_loop.EvalLoop(evaluate)(state, [toy_data(16)])
    assert len(outputs["loss"]) == 1
    manager.close()


def test_uncheckpointable_iterator_warns_once_at_first_checkpoint(tmp_path, caplog):
    def generator():
        while True:
            yield toy_data(16)

    manager = checkpoint.make_manager(tmp_path / "ckpt")
    step, loop = make_train(tmp_path, manager)
    outer = outer_loop.OuterLoop(loop)
    with caplog.at_level(logging.WARNING, logger="jaxloop.actions"):
        outer(step.initialize_model([1, 16]), generator(), train_total_steps=6,
              train_loop_steps=2)
    manager.close()
    warnings = [r.getMessage() for r in caplog.records if "replay the data" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "generator" in warnings[0]
    assert checkpoint.all_steps(tmp_path / "ckpt") == [2, 4, 6]


def test_batch_rows_follow_the_partitioner_mesh():
    from jaxloop import partition  # noqa: PLC0415

    devices = np.array(jax.devices()).reshape(2, 4).T  # data=4 x model=2
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    part = partition.DataParallelPartitioner(mesh, "data")
    assert data.batch_rows(mesh, "data", 64) == (0, 64)  # one process holds every row
    ds = data.GlobalBatchDataset(toy_data(128), 64, partitioner=part)
    assert ds.rows == (0, 64) and next(iter(ds))["x"].shape == (64, 16)
    with pytest.raises(ValueError, match=r"global_batch_size=30 does not divide by the 4"):
        data.batch_rows(mesh, "data", 30)
    with pytest.raises(ValueError, match=r"data_axis 'batch' is not an axis"):
        data.batch_rows(mesh, "batch", 64)
