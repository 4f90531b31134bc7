"""Accelerator-first data path: where placing ahead is asked for (the default off CPUs), steps
receive batches already placed on the devices by the prefetch thread; an execution does only
its real steps' data work, and the compiled program is explicit (the state's shardings in
and out, the jit flags given to `Step.compile`)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, outer_loop, partition, train_loop
from jaxloop.engine import program

pytestmark = pytest.mark.timeout(300)


def batches(n, size=16, seed=0):
    data = toy_data(n * size, seed=seed)
    return [{k: v[i * size:(i + 1) * size] for k, v in data.items()} for i in range(n)]


def data_parallel():
    return partition.DataParallelPartitioner(Mesh(np.array(jax.devices()), ("data",)), "data")


class CountingStep(ClassifierStep):
    """Counts the batches it prepares, and the threads that prepare them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prepared = []
        self.preprocessed = []

    def preprocess_batch(self, batch):
        self.preprocessed.append(threading.current_thread().name)
        return batch

    def prepare_batch(self, batch):
        self.prepared.append((threading.current_thread().name, len(batch["x"])))
        return super().prepare_batch(batch)


class SeeingLoop(train_loop.TrainLoop):
    """Records what each step receives from the loop's reads."""

    seen: list

    def _get_next_batch(self, dataset):
        batch = super()._get_next_batch(dataset)
        self.seen.append(batch)
        return batch


class Every(actions.Action):
    def __init__(self):
        super().__init__(interval=1)
        self.calls = 0

    def __call__(self, state, outputs, **kwargs):
        self.calls += 1


def test_the_step_receives_arrays_placed_by_the_prefetch_thread():
    part = data_parallel()
    step = CountingStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1),
                        partitioner=part, train=True)
    loop = SeeingLoop(step)
    loop.seen = []
    state = step.initialize_model([1, 16])
    it = iter(batches(6))
    # The training thread may not copy a host array to the devices: jit gets placed arrays.
    with (loop.prefetching(it, size=2, place=True),
          jax.transfer_guard_host_to_device("disallow")):
        state, outputs = loop(state, it, num_steps=6)
    assert len(outputs["loss"]) == 6 and int(state.step) == 6
    for batch in loop.seen:  # the batches themselves, no wrapper
        assert isinstance(batch, dict)
        for leaf in jax.tree.leaves(batch):
            assert isinstance(leaf, jax.Array)
            assert leaf.sharding.is_equivalent_to(part.batch_sharding, leaf.ndim)
    assert {name for name, _ in step.prepared} == {"jaxloop-device-prefetch"}
    # The loop's override saw the plain batches, and the step did not prepare them again.
    assert step.preprocessed == ["jaxloop-device-prefetch"] * 6


@pytest.mark.parametrize("k", [4, 16])
def test_a_one_step_execution_transfers_one_batch(k):
    every = Every()  # a step's end action every step cuts every execution to one step
    step = CountingStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1),
                        partitioner=data_parallel(), train=True, end_actions=[every])
    loop = train_loop.TrainLoop(step, steps_per_execution=k)
    state = step.initialize_model([1, 16])
    first = iter(batches(2))
    with loop.prefetching(first, place=True):
        state, _ = loop(state, first, num_steps=2)  # compiles: run the cell twice
    step.prepared.clear()
    it = iter(batches(5, seed=1))
    # The batches are placed by the prefetch thread, one batch each (none of them padded to
    # k batches); the training thread sends only each execution's count.
    with loop.prefetching(it, place=True):
        state, outputs = loop(state, it, num_steps=5)
    assert len(outputs["loss"]) == 5 and every.calls == 7
    assert [rows for _, rows in step.prepared] == [16] * 5


def test_a_partial_execution_matches_single_steps_without_host_padding():
    part = data_parallel()
    data = batches(7)

    def train(k):
        step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1),
                              partitioner=part, train=True)
        state = step.initialize_model([1, 16])
        return train_loop.TrainLoop(step, steps_per_execution=k)(state, iter(data))

    (one, out1), (four, out4) = train(1), train(4)  # 4 + 3: the last group is partial
    assert len(out4["loss"]) == 7
    np.testing.assert_array_equal(np.asarray(out1["loss"]), np.asarray(out4["loss"]))
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class RepeatStep(ClassifierStep):
    """A step whose `repeats` keyword is Python control flow: it must be static."""

    def run(self, state, batch, repeats=1):
        for _ in range(repeats):
            state, outputs = super().run(state, batch)
        return state, outputs


@pytest.mark.parametrize("k", [1, 3])
def test_compile_static_argnames_reach_the_jit_that_runs(k):
    step = RepeatStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    step.compile(static_argnames=("repeats",))
    state = step.initialize_model([1, 16])
    loop = train_loop.TrainLoop(step, steps_per_execution=k)
    twice, _ = loop(state, iter(batches(3)), repeats=2)
    assert int(twice.step) == 6  # two optimizer updates per batch

    again = RepeatStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    state = again.initialize_model([1, 16])
    for b in batches(3):
        state, _ = again(state, b)
        state, _ = again(state, b)
    for a, b in zip(jax.tree.leaves(twice.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_compile_static_argnums_and_donation_reach_the_jit():
    def scaled(state, batch, factor):
        return state, {"sum": jnp.sum(batch["x"]) * factor}

    part = data_parallel()
    state = ClassifierStep(jax.random.key(0), LinenMLP(), partitioner=part).initialize_model(
        [1, 16])
    fn = program.Program(scaled, part, static_argnums=(2,))
    out = fn(state, part.shard_batch(batches(1)[0]), 3)[1]["sum"]
    assert float(out) == pytest.approx(3 * float(np.sum(batches(1)[0]["x"])), rel=1e-5)
    kept = program.Program(scaled, part, static_argnums=(2,), donate_argnums=())
    kept(state, part.shard_batch(batches(1)[0]), 2)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    with pytest.raises(TypeError, match="in_shardings"):
        program.Program(scaled, part, in_shardings=None)


class DroppingStep(ClassifierStep):
    """A step that drops the optimizer state from the state it returns."""

    def run(self, state, batch):
        state, outputs = super().run(state, batch)
        return state.replace(opt_state=None), outputs


def test_a_run_that_changes_the_state_structure_names_the_leaves():
    step = DroppingStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                        partitioner=data_parallel(), train=True)
    state = step.initialize_model([1, 16])
    with pytest.raises(ValueError, match=r"leaves missing: \[.*opt_state") as error:
        step(state, batches(1)[0])
    assert "tree structure differs" in str(error.value)
    with pytest.raises(ValueError, match=r"leaves missing: \[.*opt_state"):
        train_loop.TrainLoop(step, steps_per_execution=2)(state, iter(batches(2)))


def test_outer_loop_with_prefetch_checkpoints_the_position_of_the_batches_trained_on(tmp_path):
    from jaxloop import data  # noqa: PLC0415
    from jaxloop.checkpointing import checkpoint  # noqa: PLC0415

    ds = data.GlobalBatchDataset(toy_data(256), 16, seed=3)
    step = CountingStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1),
                        partitioner=data_parallel(), train=True)
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    loop = train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)])
    it = iter(ds)
    outer = outer_loop.OuterLoop(loop, prefetch=3)
    state, _ = outer(step.initialize_model([1, 16]), it, train_total_steps=8,
                     train_loop_steps=4)
    manager.wait_until_finished()
    assert int(state.step) == 8 and it.get_state()["next_batch"] == 8
    restored = iter(ds)
    checkpoint.restore(step.initialize_model([1, 16]), tmp_path / "ckpt", dataset=restored)
    assert restored.get_state()["next_batch"] == 8
    manager.close()


class RecordingPartitioner(partition.DataParallelPartitioner):
    """A user's partitioner that records how many batch entries each placement sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent = []

    def shard_batch(self, batch):
        self.sent.append(("batch", len(batch["x"])))
        return super().shard_batch(batch)

    def shard_stacked_batch(self, batch):
        self.sent.append(("stacked", batch["x"].shape[:2]))
        return super().shard_stacked_batch(batch)


def test_a_partial_group_placed_by_the_users_shard_batch_sends_only_its_real_batches():
    part = RecordingPartitioner(Mesh(np.array(jax.devices()), ("data",)), "data")
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1),
                          partitioner=part, train=True)
    loop = train_loop.TrainLoop(step, steps_per_execution=4)
    state, out = loop(step.initialize_model([1, 16]), iter(batches(7)))  # 4 + 3, no prefetch
    assert len(out["loss"]) == 7 and int(state.step) == 7
    # The user's shard_batch places each real batch; the padding of the last execution's
    # fourth entry is made on the devices, never sent.
    assert part.sent == [("batch", 16)] * 7


def test_a_prefetching_loop_called_with_another_iterator_says_so():
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    loop = train_loop.TrainLoop(step)
    state = step.initialize_model([1, 16])
    given, other = iter(batches(4)), iter(batches(4, seed=1))
    with loop.prefetching(given, size=2, place=False):
        # The cell's author typed another iterator: its batches would otherwise be ignored.
        with pytest.raises(ValueError, match="prefetching a list_iterator.*another dataset"):
            loop(state, other, num_steps=2)
        state, outputs = loop(state, given, num_steps=2)
    assert len(outputs["loss"]) == 2
    state, outputs = loop(state, other, num_steps=2)  # outside the block: read directly
    assert len(outputs["loss"]) == 2 and next(other, None) is not None
