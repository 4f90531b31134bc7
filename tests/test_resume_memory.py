"""Resuming without doubling memory: restore into an abstract state (`Step.abstract_state`).

Device bytes are the bytes of every addressable shard of every live jax array (8 CPU devices,
FSDP): what the devices hold. A sampler thread records the largest total it sees while a
resume runs (a lower bound of the true peak), and fixed points in the resume (after the
restore, at the first train loop's start) are sampled deterministically.
"""

import gc
import threading

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from models import ClassifierStep

from jaxloop import actions, outer_loop, partition, train_loop
from jaxloop.checkpointing import checkpoint
from jaxloop.diagnostics import memory
from jaxloop.state import model_state

SPEC = [1, 256]


class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(1024)(x))
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(16)(x)


device_bytes = memory.live_device_bytes


def tree_device_bytes(tree) -> int:
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


class PeakSampler:
    """The largest device-byte total seen while active, above the total at entry."""

    def __init__(self):
        self.peak = 0
        self.error = None
        self._stop = threading.Event()

    def sample(self):
        self.peak = max(self.peak, device_bytes() - self.base)

    def _run(self):
        try:
            while not self._stop.is_set():
                self.sample()
                self._stop.wait(0.0005)
        except BaseException as e:  # a sampler that stopped early would under-report
            self.error = e

    def __enter__(self):
        gc.collect()
        self.base = device_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error
        self.sample()


def batches(n=64, seed=0):
    rng = np.random.default_rng(seed)
    while True:
        x = rng.normal(size=(n, 256)).astype(np.float32)
        yield {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}


def make_step():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    part = partition.FSDPPartitioner(mesh, "data", min_weight_size=2**10)
    return ClassifierStep(jax.random.key(0), Wide(), optimizer=optax.adam(1e-3),
                          partitioner=part, train=True)


@pytest.fixture
def checkpointed(tmp_path):
    """A checkpoint after 2 steps; returns (directory, one state's device bytes, params)."""
    step = make_step()
    state = step.initialize_model(SPEC)
    data = batches()
    for _ in range(2):
        state, _ = step(state, next(data))
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    checkpoint.save(manager, int(state.step), state)
    manager.wait_until_finished()
    manager.close()
    nbytes = tree_device_bytes(state)
    params = jax.tree.map(np.asarray, state.params)
    del state, step
    gc.collect()
    return tmp_path / "ckpt", nbytes, params


def test_restore_model_into_an_abstract_state_holds_one_state(checkpointed):
    directory, state_bytes, params = checkpointed
    step = make_step()
    abstract = step.abstract_state(SPEC)
    assert model_state.is_abstract(abstract)
    assert all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None
               for x in jax.tree.leaves(abstract))
    with PeakSampler() as sampler:
        restored = step.restore_model(abstract, directory)
        sampler.sample()  # the caller holds the abstract state and the restored one
    ratio = sampler.peak / state_bytes
    print(f"resume peak device bytes: {sampler.peak} = {ratio:.3f} x one state ({state_bytes})")
    assert ratio <= 1.1
    assert int(restored.step) == 2
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    kernel = restored.params["Dense_0"]["kernel"]  # (256, 1024): split over 8 devices
    assert {s.data.shape for s in kernel.addressable_shards} == {(256, 128)}

    # A concrete initial state kept by the caller is what doubled the memory.
    del restored
    with PeakSampler() as doubled:
        initial = step.initialize_model(SPEC)
        again = step.restore_model(initial, directory)
        doubled.sample()
    assert doubled.peak >= 1.9 * state_bytes
    del initial, again


def test_outer_loop_resumes_from_an_abstract_state(checkpointed):
    directory, state_bytes, _ = checkpointed
    step = make_step()
    at_start = []

    class Measure(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            at_start.append(device_bytes())

    loop = train_loop.TrainLoop(step, begin_actions=[Measure()])
    outer = outer_loop.OuterLoop(
        train_loop=loop, checkpoint_spec=outer_loop.CheckpointSpec(directory), prefetch=0)
    gc.collect()
    base = device_bytes()
    with PeakSampler() as sampler:
        state, _ = outer(step.abstract_state(SPEC), train_dataset=batches(),
                         train_total_steps=3, train_loop_steps=1)
    assert int(state.step) == 3  # resumed at 2, one more step
    assert (at_start[0] - base) <= 1.1 * state_bytes
    # Training itself holds a state, its donated successor and a batch: the resume adds
    # nothing to that.
    print(f"outer loop: start of training {at_start[0] - base} bytes, peak {sampler.peak}")


def test_abstract_state_without_checkpoint_is_initialised(tmp_path):
    step = make_step()
    loop = train_loop.TrainLoop(step)
    outer = outer_loop.OuterLoop(
        train_loop=loop, checkpoint_spec=outer_loop.CheckpointSpec(tmp_path / "none"),
        prefetch=0)
    state, _ = outer(step.abstract_state(SPEC), train_dataset=batches(), train_total_steps=1)
    assert int(state.step) == 1
    fresh = make_step()
    initialised = fresh.restore_model(fresh.abstract_state(SPEC), tmp_path / "none")
    reference = make_step().initialize_model(SPEC)
    for a, b in zip(jax.tree.leaves(initialised), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding


def test_live_device_bytes_reads_beside_steps_that_donate():
    """A sampler thread reads the live arrays while the training thread donates states:
    an array freed under it counts as freed, and no read fails."""
    grow = jax.jit(lambda x: x + 1, donate_argnums=0)
    x = jax.numpy.zeros((256, 1024))
    totals, errors, stop = [], [], threading.Event()

    def read():
        try:
            while not stop.is_set():
                totals.append(device_bytes())
        except BaseException as e:  # noqa: BLE001 (reported by the assertion below)
            errors.append(e)

    # Unpaced, unlike `PeakSampler`: as many reads as it can make land inside donations.
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for _ in range(3000):
            x = grow(x)
        x.block_until_ready()
    finally:  # a failing step must not leave the reader running
        stop.set()
        reader.join(timeout=60)
    assert not reader.is_alive()
    assert errors == []
    assert totals and max(totals) >= x.nbytes
    assert float(x[0, 0]) == 3000
