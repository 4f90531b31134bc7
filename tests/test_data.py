"""Tests for jaxloop.data that need no TensorFlow (run with JAXLOOP_BLOCK_TF=1)."""

import gc
import json
import math
import os
import subprocess
import sys
import threading
import time
import types

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxloop.data import (
    ArraySource,
    GlobalBatchDataset,
    as_iterator,
    iterator_state,
    pad_to_global_batches,
    prefetch_to_device,
    restore_iterator_state,
)

THREAD_NAME = "jaxloop-device-prefetch"


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


def wait_no_prefetch_threads(timeout=5.0):
    deadline = time.monotonic() + timeout
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return prefetch_threads()


def example_arrays(n):
    return {
        "x": np.arange(n, dtype=np.int64),
        "f": np.arange(n * 3, dtype=np.float32).reshape(n, 3),
    }


def assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------------------
# as_iterator / iterator state
# ----------------------------------------------------------------------------------------


def test_as_iterator_list():
    batches = [{"x": np.full((2,), i)} for i in range(3)]
    it = as_iterator(batches)
    assert [int(b["x"][0]) for b in it] == [0, 1, 2]
    assert iterator_state(as_iterator(batches)) is None


def test_as_iterator_returns_iterators_and_generators_as_is():
    gen = ({"x": np.array(i)} for i in range(3))
    assert as_iterator(gen) is gen
    it = iter([1, 2, 3])
    assert as_iterator(it) is it
    assert iterator_state(gen) is None
    with pytest.raises(ValueError, match="set_state"):
        restore_iterator_state(gen, {"next_batch": 0})


@pytest.mark.parametrize("value", [42, 3.5, None, object()])
def test_as_iterator_not_iterable(value):
    with pytest.raises(TypeError, match=type(value).__qualname__):
        as_iterator(value)


def test_as_iterator_grain_map_dataset_batched():
    ds = grain.MapDataset.source(ArraySource(example_arrays(10))).batch(4)
    it = as_iterator(ds)
    first = next(it)
    np.testing.assert_array_equal(first["x"], [0, 1, 2, 3])
    assert first["f"].shape == (4, 3)
    state = iterator_state(it)
    assert json.loads(json.dumps(state)) == state
    rest = [b["x"].tolist() for b in it]
    assert rest == [[4, 5, 6, 7], [8, 9]]
    # A fresh iterator restored to the saved state continues after the first batch.
    it2 = as_iterator(ds)
    restore_iterator_state(it2, state)
    assert [b["x"].tolist() for b in it2] == rest


def test_as_iterator_grain_iter_dataset():
    ds = grain.MapDataset.range(10).to_iter_dataset().batch(5)
    it = as_iterator(ds)
    assert isinstance(it, grain.DatasetIterator)
    assert [b.tolist() for b in it] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_as_iterator_grain_data_loader_state_round_trip():
    def loader():
        return grain.DataLoader(
            data_source=ArraySource(example_arrays(12)),
            sampler=grain.samplers.IndexSampler(
                num_records=12,
                shuffle=True,
                seed=3,
                num_epochs=1,
                shard_options=grain.sharding.NoSharding(),
            ),
            operations=[grain.transforms.Batch(4)],
            worker_count=0,
        )

    it = as_iterator(loader())
    first = next(it)
    assert first["x"].shape == (4,) and first["f"].shape == (4, 3)
    state = iterator_state(it)
    # DataLoader states are JSON bytes; iterator_state makes them a plain dict.
    assert isinstance(state, dict)
    assert json.loads(json.dumps(state)) == state
    rest = [b["x"].tolist() for b in it]
    assert len(rest) == 2
    it2 = as_iterator(loader())
    restore_iterator_state(it2, state)
    assert [b["x"].tolist() for b in it2] == rest
    seen = sorted(first["x"].tolist() + sum(rest, []))
    assert seen == list(range(12))


def test_as_iterator_random_access_source_is_wrapped_by_grain():
    it = as_iterator(ArraySource(example_arrays(5)))
    assert isinstance(it, grain.DatasetIterator)
    assert [int(e["x"]) for e in it] == [0, 1, 2, 3, 4]


def test_as_iterator_global_batch_dataset():
    ds = GlobalBatchDataset(example_arrays(8), 4, num_epochs=1, process_index=0, process_count=1)
    it = as_iterator(ds)
    assert iterator_state(it)["next_batch"] == 0
    assert len(list(it)) == 2


TFDS_WITHOUT_TF = """
import importlib.abc, os, sys


class NoTensorFlow(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "tensorflow" or fullname.startswith("tensorflow."):
            raise ModuleNotFoundError(f"No module named {fullname!r}")


# As if TensorFlow were not installed. epath asks importlib.util.find_spec whether TF is
# there, which this finder makes raise rather than return None, so answer that for it.
sys.meta_path.insert(0, NoTensorFlow())
os.environ["EPATH_USE_TF"] = "false"

import numpy as np
import tensorflow_datasets as tfds

from jaxloop.data import GlobalBatchDataset, as_iterator, iterator_state, restore_iterator_state

with tfds.testing.mock_data(num_examples=20, policy=tfds.testing.MockPolicy.USE_CODE):
    source = tfds.data_source("mnist", split="train")
    assert len(source) == 20

    # as_iterator wraps the source with grain: checkpointable, one example at a time.
    it = as_iterator(source)
    first = [next(it) for _ in range(3)]
    assert first[0]["image"].shape == (28, 28, 1), first[0]["image"].shape
    state = iterator_state(it)
    fourth = next(it)
    it2 = as_iterator(source)
    restore_iterator_state(it2, state)
    again = next(it2)
    assert all(np.array_equal(again[k], fourth[k]) for k in fourth)

    # Global batches over a tfds source: two processes together give the one-process batches.
    def batches(p, count):
        return list(GlobalBatchDataset(source, 8, num_epochs=1, process_index=p,
                                       process_count=count))

    ref = batches(0, 1)
    parts = [batches(p, 2) for p in range(2)]
    assert len(ref) == 2
    for k, batch in enumerate(ref):
        assert batch["image"].shape == (8, 28, 28, 1)
        for key in batch:
            merged = np.concatenate([part[k][key] for part in parts])
            assert np.array_equal(merged, batch[key]), key

assert "tensorflow" not in sys.modules
print("OK")
"""


def test_tfds_data_source_without_tensorflow(tmp_path):
    # In a subprocess: the TF-free tier's conftest makes TensorFlow look imported-but-broken
    # (a None sys.modules entry), which tfds cannot import under; a real TF-less install
    # looks like this script's set-up instead.
    script = tmp_path / "tfds_without_tf.py"
    script.write_text(TFDS_WITHOUT_TF)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK")


def test_import_does_not_import_tensorflow():
    code = "import sys, jaxloop.data; assert 'tensorflow' not in sys.modules, 'TF imported'"
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )


# ----------------------------------------------------------------------------------------
# ArraySource
# ----------------------------------------------------------------------------------------


def test_array_source():
    source = ArraySource(example_arrays(6))
    assert len(source) == 6
    assert_tree_equal(source[2], {"x": np.array(2), "f": np.array([6.0, 7.0, 8.0])})
    assert_tree_equal(source[-1], source[5])
    with pytest.raises(IndexError):
        source[6]
    with pytest.raises(ValueError, match="leading dimension"):
        ArraySource({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(ValueError, match="leading dimension"):
        ArraySource({"a": np.float32(1.0)})


# ----------------------------------------------------------------------------------------
# GlobalBatchDataset: process sharding
# ----------------------------------------------------------------------------------------


def make_source(kind, n):
    arrays = example_arrays(n)
    if kind == "array":
        return ArraySource(arrays)
    if kind == "list":
        return [{"x": arrays["x"][i], "f": arrays["f"][i]} for i in range(n)]
    if kind == "grain":
        return grain.MapDataset.source(ArraySource(arrays))
    raise ValueError(kind)


def global_batches(source, process_count, num_batches=None, start_state=None, **kwargs):
    """The global batches seen by `process_count` simulated processes, merged in order."""
    per_process = []
    for p in range(process_count):
        ds = GlobalBatchDataset(source, process_index=p, process_count=process_count, **kwargs)
        it = iter(ds)
        if start_state is not None:
            it.set_state(start_state)
        if num_batches is None:
            local = list(it)
        else:
            local = [next(it) for _ in range(num_batches)]
        for b in local:
            assert jax.tree.leaves(b)[0].shape[0] == ds.local_batch_size
        per_process.append(local)
    counts = {len(local) for local in per_process}
    assert len(counts) == 1, counts
    return [
        jax.tree.map(lambda *xs: np.concatenate(xs), *(local[k] for local in per_process))
        for k in range(counts.pop())
    ]


@pytest.mark.parametrize("kind", ["array", "list", "grain"])
@pytest.mark.parametrize("n", [24, 20])
def test_global_batches_are_independent_of_process_count(kind, n):
    source = make_source(kind, n)
    kwargs = dict(global_batch_size=8, seed=7, num_epochs=2)
    ref = global_batches(source, 1, **kwargs)
    assert len(ref) == (2 * n) // 8
    for process_count in (2, 4):
        got = global_batches(source, process_count, **kwargs)
        assert len(got) == len(ref)
        for a, b in zip(got, ref, strict=True):
            assert_tree_equal(a, b)
    # The concatenated order is one permutation per epoch: each epoch is covered exactly
    # once, and every row carries its own example (x and f stay together).
    order = np.concatenate([b["x"] for b in ref])
    for e in range(len(order) // n):
        assert sorted(order[e * n : (e + 1) * n].tolist()) == list(range(n))
    np.testing.assert_array_equal(
        np.concatenate([b["f"] for b in ref]), example_arrays(n)["f"][order]
    )


def test_processes_read_disjoint_rows_covering_the_epoch():
    n, g = 32, 8
    source = ArraySource(example_arrays(n))
    for process_count in (1, 2, 4):
        rows = []
        for p in range(process_count):
            ds = GlobalBatchDataset(
                source, g, seed=1, num_epochs=1, process_index=p, process_count=process_count
            )
            rows.append(np.concatenate([b["x"] for b in ds]))
        all_rows = np.concatenate(rows)
        assert len(all_rows) == n
        assert sorted(all_rows.tolist()) == list(range(n))


def test_process_reads_only_its_rows():
    n, g = 16, 8
    reads = []

    class CountingSource:
        def __len__(self):
            return n

        def __getitem__(self, i):
            reads.append(i)
            return {"x": np.array(i)}

    ds = GlobalBatchDataset(
        CountingSource(), g, seed=0, num_epochs=1, process_index=1, process_count=4
    )
    batches = list(ds)
    assert len(reads) == n // 4
    assert sorted(reads) == sorted(np.concatenate([b["x"] for b in batches]).tolist())


def test_state_restores_under_other_process_counts():
    source = ArraySource(example_arrays(20))
    kwargs = dict(global_batch_size=8, seed=3)  # repeats forever
    ref = global_batches(source, 1, num_batches=9, **kwargs)

    states = []
    for p in range(2):
        it = iter(GlobalBatchDataset(source, process_index=p, process_count=2, **kwargs))
        for _ in range(4):
            next(it)
        states.append(it.get_state())
    assert states[0] == states[1]  # the state is global, not per process
    state = json.loads(json.dumps(states[0]))
    assert state["next_batch"] == 4

    for process_count in (4, 1, 2):
        resumed = global_batches(source, process_count, num_batches=5, start_state=state, **kwargs)
        for a, b in zip(resumed, ref[4:], strict=True):
            assert_tree_equal(a, b)


def test_restore_iterator_state_helpers_on_global_batches():
    ds = GlobalBatchDataset(example_arrays(12), 4, num_epochs=1, process_index=0, process_count=1)
    it = iter(ds)
    next(it)
    state = iterator_state(it)
    rest = list(it)
    it2 = iter(ds)
    restore_iterator_state(it2, state)
    for a, b in zip(list(it2), rest, strict=True):
        assert_tree_equal(a, b)


def test_state_mismatch_is_rejected():
    source = ArraySource(example_arrays(12))
    it = iter(GlobalBatchDataset(source, 4, process_index=0, process_count=1))
    next(it)
    state = it.get_state()
    other = iter(GlobalBatchDataset(source, 6, process_index=0, process_count=1))
    with pytest.raises(ValueError, match="global_batch_size"):
        other.set_state(state)
    other_seed = iter(GlobalBatchDataset(source, 4, seed=9, process_index=0, process_count=1))
    with pytest.raises(ValueError, match="seed"):
        other_seed.set_state(state)
    with pytest.raises(ValueError, match="next_batch"):
        it.set_state({"position": 3})
    finite = iter(GlobalBatchDataset(source, 4, num_epochs=1, process_index=0, process_count=1))
    with pytest.raises(ValueError, match=r"next_batch=4 is outside this dataset's 3 batches"):
        finite.set_state({"next_batch": 4})


def test_epochs_reshuffle_deterministically():
    n = 16
    source = ArraySource(example_arrays(n))

    def order(seed, shuffle=True):
        ds = GlobalBatchDataset(
            source, 8, seed=seed, shuffle=shuffle, num_epochs=3, process_index=0, process_count=1
        )
        return np.concatenate([b["x"] for b in ds]).reshape(3, n)

    a = order(seed=5)
    np.testing.assert_array_equal(a, order(seed=5))
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(a[1], a[2])
    assert not np.array_equal(a, order(seed=6))
    # The order is grain's: a user's own grain pipeline over the source reads the same.
    grain_order = grain.MapDataset.range(n).shuffle(seed=5).repeat(3)
    assert a.reshape(-1).tolist() == list(grain_order)
    np.testing.assert_array_equal(order(seed=5, shuffle=False), np.tile(np.arange(n), (3, 1)))


def test_rows_of_an_uneven_mesh_layout():
    # A layout one process cannot build (jax.devices() are all its own): data=4 x model=2
    # over 2 processes where process 0 holds data coordinates 0-2 and process 1 holds 1-3,
    # so each reads 6 of 8 rows, not a whole block of the global batch.
    process_of = {d: d // 4 for d in range(8)}
    devices = np.array([[0, 1], [2, 4], [3, 5], [6, 7]])
    mesh = types.SimpleNamespace(
        axis_names=("data", "model"),
        shape={"data": 4, "model": 2},
        devices=np.vectorize(lambda d: types.SimpleNamespace(process_index=process_of[d]))(
            devices
        ),
    )
    partitioner = types.SimpleNamespace(mesh=mesh, data_axis="data")
    source = ArraySource(example_arrays(40))
    ref = list(GlobalBatchDataset(source, 8, seed=4, num_epochs=1, process_index=0,
                                  process_count=1))
    for p, rows in [(0, (0, 6)), (1, (2, 8))]:
        ds = GlobalBatchDataset(source, 8, seed=4, num_epochs=1, process_index=p,
                                process_count=2, partitioner=partitioner)
        assert ds.rows == rows
        got = list(ds)
        assert len(got) == len(ref) == 5
        for a, b in zip(got, ref, strict=True):
            assert_tree_equal(a, jax.tree.map(lambda x: x[slice(*rows)], b))  # noqa: B023


def test_batch_size_not_divisible_by_process_count():
    with pytest.raises(ValueError, match=r"global_batch_size=10.*process_count=4"):
        GlobalBatchDataset(example_arrays(20), 10, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="process_index"):
        GlobalBatchDataset(example_arrays(20), 8, process_index=2, process_count=2)


def test_lengths_and_infinite_repeat():
    source = example_arrays(10)
    finite = GlobalBatchDataset(source, 4, num_epochs=3, process_index=0, process_count=1)
    assert len(finite) == 7 == len(list(finite))
    padded = GlobalBatchDataset(
        source, 4, num_epochs=3, drop_remainder=False, process_index=0, process_count=1
    )
    assert len(padded) == 8 == len(list(padded))
    infinite = GlobalBatchDataset(source, 4, process_index=0, process_count=1)
    with pytest.raises(TypeError, match="forever"):
        len(infinite)
    it = iter(infinite)
    order = np.concatenate([next(it)["x"] for _ in range(10)])  # 4 epochs' worth
    np.testing.assert_array_equal(infinite.batches[7]["x"], order[28:32])  # random access
    for e in range(4):
        assert sorted(order[e * 10 : (e + 1) * 10].tolist()) == list(range(10))


def test_defaults_use_jax_process_and_transform():
    ds = GlobalBatchDataset(
        example_arrays(8),
        4,
        num_epochs=1,
        shuffle=False,
        transform=lambda ex: {**ex, "x2": ex["x"] * 2},
    )
    assert (ds.process_index, ds.process_count) == (jax.process_index(), jax.process_count())
    batches = list(ds)
    np.testing.assert_array_equal(batches[1]["x2"], [8, 10, 12, 14])


def test_invalid_sources():
    with pytest.raises(TypeError, match="random-access"):
        GlobalBatchDataset(iter([1, 2]), 2, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="empty"):
        GlobalBatchDataset([], 2, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="num_epochs must be None or positive"):
        GlobalBatchDataset([1, 2], 2, num_epochs=0, process_index=0, process_count=1)


# ----------------------------------------------------------------------------------------
# Device prefetch
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharding():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    return NamedSharding(mesh, P("data"))


def numbered_batches(count, batch=8):
    return [{"x": np.arange(batch, dtype=np.float32) + 100 * i} for i in range(count)]


@pytest.mark.parametrize("size", [0, 1, 3])
def test_prefetch_order_and_sharding(sharding, size):
    shard_fn = lambda b: jax.device_put(b, sharding)
    with prefetch_to_device(iter(numbered_batches(10)), shard_fn, size=size) as it:
        got = list(it)
    assert len(got) == 10
    for i, batch in enumerate(got):
        assert isinstance(batch["x"], jax.Array)
        assert batch["x"].sharding == sharding
        assert len(batch["x"].devices()) == len(jax.devices())
        np.testing.assert_array_equal(np.asarray(batch["x"]), numbered_batches(10)[i]["x"])
    assert not wait_no_prefetch_threads()


def test_prefetch_accepts_iterables():
    it = prefetch_to_device(numbered_batches(3), jax.device_put)
    assert len(list(it)) == 3
    assert not wait_no_prefetch_threads()


def failing_source(fail_at):
    for i in range(100):
        if i == fail_at:
            raise KeyError(f"bad record {i}")
        yield {"x": np.full((8,), i, np.float32)}


@pytest.mark.parametrize("size", [0, 2])
def test_prefetch_source_error_raised_at_its_index(size):
    it = prefetch_to_device(failing_source(5), jax.device_put, size=size)
    time.sleep(0.05)  # let the producer reach the error first
    for i in range(5):
        assert float(next(it)["x"][0]) == i
    with pytest.raises(KeyError, match="bad record 5"):
        next(it)
    assert not wait_no_prefetch_threads()
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("size", [0, 2])
def test_prefetch_shard_fn_error(size):
    calls = []

    def shard_fn(batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device full")
        return jax.device_put(batch)

    it = prefetch_to_device(iter(numbered_batches(10)), shard_fn, size=size)
    assert len([next(it) for _ in range(3)]) == 3
    with pytest.raises(RuntimeError, match="device full"):
        next(it)
    assert not wait_no_prefetch_threads()


def test_prefetch_no_thread_after_exhaustion():
    it = prefetch_to_device(iter(numbered_batches(4)), jax.device_put, size=2)
    assert prefetch_threads()
    assert len(list(it)) == 4
    assert not wait_no_prefetch_threads()


def endless():
    i = 0
    while True:
        yield {"x": np.full((8,), i, np.float32)}
        i += 1


def test_prefetch_close_mid_stream():
    it = prefetch_to_device(endless(), jax.device_put, size=2)
    next(it)
    next(it)
    time.sleep(0.05)  # the producer is now blocked on a full queue
    start = time.monotonic()
    it.close()
    assert time.monotonic() - start < 2
    assert not prefetch_threads()
    with pytest.raises(StopIteration):
        next(it)
    it.close()  # idempotent


def test_prefetch_context_manager_stops_thread_on_error():
    with pytest.raises(ZeroDivisionError):
        with prefetch_to_device(endless(), jax.device_put, size=2) as it:
            next(it)
            _ = 1 / 0
    assert not wait_no_prefetch_threads()


def test_prefetch_abandoned_iterator_is_collected():
    it = prefetch_to_device(endless(), jax.device_put, size=2)
    next(it)
    del it
    gc.collect()
    assert not wait_no_prefetch_threads()


@pytest.mark.parametrize("size", [0, 1, 3])
@pytest.mark.parametrize("kind", ["global", "grain"])
def test_prefetch_state_tracks_consumed_batches(kind, size):
    def source():
        if kind == "global":
            return iter(
                GlobalBatchDataset(example_arrays(40), 8, seed=2, process_index=0, process_count=1)
            )
        return iter(grain.MapDataset.source(ArraySource(example_arrays(40))).batch(8).repeat())

    plain = source()
    expected = [iterator_state(plain)]
    for _ in range(6):
        next(plain)
        expected.append(iterator_state(plain))

    it = prefetch_to_device(source(), jax.device_put, size=size)
    assert it.get_state() == expected[0]
    for k in range(1, 5):
        next(it)
        time.sleep(0.02)  # the producer runs ahead; the state must not
        assert it.get_state() == expected[k]
    assert iterator_state(it) == expected[4]

    # Restoring an earlier position drops what was prefetched and resumes there.
    reference = source()
    restore_iterator_state(reference, expected[2])
    want = [next(reference) for _ in range(3)]
    restore_iterator_state(it, expected[2])
    assert it.get_state() == expected[2]
    for w in want:
        assert_tree_equal(next(it), w)
    assert it.get_state() == expected[5]
    it.close()
    assert not wait_no_prefetch_threads()


def test_prefetch_state_of_stateless_source():
    it = prefetch_to_device(iter(numbered_batches(3)), jax.device_put)
    next(it)
    assert it.get_state() is None
    with pytest.raises(ValueError, match="set_state"):
        it.set_state({"next_batch": 0})
    it.close()


def test_a_loops_prefetcher_and_prefetch_to_device_are_one_mechanism():
    from jaxloop import data
    from jaxloop.data import read_ahead

    source = iter(GlobalBatchDataset(example_arrays(40), 8, process_index=0, process_count=1))
    it = data.prefetch_to_device(source, jax.device_put, size=2)
    # One class under one name, reached from `data` and its module alike.
    assert type(it) is data.Prefetcher is read_ahead.Prefetcher
    assert not hasattr(data, "DevicePrefetchIterator")
    assert prefetch_threads()  # prefetch_to_device starts reading at once
    next(it)
    assert data.describe_iterator(it).endswith("GlobalBatchIterator behind a device prefetcher")
    it.close()
    assert not wait_no_prefetch_threads()
    assert iterator_state(source)["next_batch"] == 1


def test_a_loops_prefetcher_starts_at_its_first_read():
    from jaxloop.data import read_ahead

    source = iter(GlobalBatchDataset(example_arrays(40), 8, process_index=0, process_count=1))
    next(source)  # the loop read a batch itself, before the prefetcher's first read
    ahead = read_ahead.Prefetcher(source, jax.device_put, size=2)
    assert not prefetch_threads()
    assert ahead.position()["next_batch"] == 1
    np.testing.assert_array_equal(np.asarray(next(ahead)["x"]), next(iter(
        GlobalBatchDataset(example_arrays(40), 8, process_index=0, process_count=1)
        .batches[1:].to_iter_dataset()))["x"])
    assert prefetch_threads()
    time.sleep(0.02)  # the thread reads ahead; the position must not
    assert ahead.position()["next_batch"] == 2
    ahead.close()
    assert not wait_no_prefetch_threads()
    assert iterator_state(source)["next_batch"] == 2  # the source goes on after that batch


def test_prefetch_size_zero_uses_no_thread():
    it = prefetch_to_device(iter(numbered_batches(3)), jax.device_put, size=0)
    assert not prefetch_threads()
    assert len(list(it)) == 3
    with pytest.raises(ValueError):
        prefetch_to_device(iter([]), jax.device_put, size=-1)


# ----------------------------------------------------------------------------------------
# Padded exact-epoch eval
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("process_count", [1, 2, 8])
@pytest.mark.parametrize("g", [8, 16])
@pytest.mark.parametrize("n_case", ["1", "g-1", "g+1", "37"])
def test_pad_to_global_batches(process_count, g, n_case):
    n = {"1": 1, "g-1": g - 1, "g+1": g + 1, "37": 37}[n_case]
    rng = np.random.default_rng(n)
    labels = rng.integers(0, 3, size=n)
    preds = rng.integers(0, 3, size=n)
    x = rng.normal(size=(n, 2)).astype(np.float32) + 1.0  # no real row is all zeros
    source = {"x": x, "label": labels, "pred": preds}

    per_process = []
    for p in range(process_count):
        ds = pad_to_global_batches(source, g, process_index=p, process_count=process_count)
        batches = list(ds)
        assert len(batches) == len(ds) == math.ceil(n / g)
        assert len(list(ds)) == len(batches)  # iterable again for the next eval
        for b in batches:
            assert b["mask"].dtype == np.bool_ and b["mask"].shape == (g // process_count,)
            assert b["x"].shape == (g // process_count, 2)
            np.testing.assert_array_equal(b["x"][~b["mask"]], 0)
        per_process.append(batches)

    merged = [
        jax.tree.map(lambda *xs: np.concatenate(xs), *(batches[k] for batches in per_process))
        for k in range(math.ceil(n / g))
    ]
    mask = np.concatenate([b["mask"] for b in merged])
    assert mask.sum() == n
    # Real rows are exactly the examples, in order, and the padding comes last.
    assert mask[:n].all() and not mask[n:].any()
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in merged])[mask], x)
    np.testing.assert_array_equal(np.concatenate([b["label"] for b in merged])[mask], labels)

    correct = sum(
        float(np.sum((b["pred"] == b["label"]) & b["mask"]))
        for batches in per_process
        for b in batches
    )
    count = sum(float(b["mask"].sum()) for batches in per_process for b in batches)
    assert correct / count == pytest.approx(np.mean(preds == labels))


def test_pad_generic_source_and_errors():
    examples = [{"x": np.array([i, i])} for i in range(5)]
    ds = pad_to_global_batches(examples, 4, process_index=1, process_count=2)
    batches = list(ds)
    assert [b["mask"].tolist() for b in batches] == [[True, True], [False, False]]
    np.testing.assert_array_equal(batches[0]["x"], [[2, 2], [3, 3]])
    np.testing.assert_array_equal(batches[1]["x"], [[0, 0], [0, 0]])

    with pytest.raises(TypeError, match="dicts"):
        list(pad_to_global_batches([np.array(1.0)] * 3, 4, process_index=0, process_count=1))
    with pytest.raises(ValueError, match="mask"):
        list(pad_to_global_batches({"mask": np.ones(3)}, 4, process_index=0, process_count=1))
    custom = pad_to_global_batches(
        example_arrays(3), 4, mask_key="valid", process_index=0, process_count=1
    )
    assert next(iter(custom))["valid"].tolist() == [True, True, True, False]
