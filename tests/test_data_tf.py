"""Tests for jaxloop.data with TensorFlow inputs (tf.data, tfds.as_numpy, tfds with TF)."""

import jax
import numpy as np
import pytest

from jaxloop.data import (
    GlobalBatchDataset,
    as_iterator,
    iterator_state,
    pad_to_global_batches,
    prefetch_to_device,
)

pytestmark = pytest.mark.tf


# TensorFlow and tfds are imported inside fixtures: this module is also collected by the
# TF-free tier (where its tests are deselected), which must not import TensorFlow.
@pytest.fixture(scope="module")
def tf():
    import tensorflow as tf

    return tf


@pytest.fixture(scope="module")
def tfds(tf):
    import tensorflow_datasets as tfds

    return tfds


def make_tf_dataset(tf, n=10, batch=4):
    x = np.arange(n, dtype=np.int64)
    f = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    return tf.data.Dataset.from_tensor_slices({"x": x, "f": f}).batch(batch), x, f


def test_as_iterator_tf_data_dataset(tf):
    ds, x, f = make_tf_dataset(tf)
    batches = list(as_iterator(ds))
    assert len(batches) == 3
    for b in batches:
        assert isinstance(b["x"], np.ndarray) and isinstance(b["f"], np.ndarray)
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), x)
    np.testing.assert_array_equal(np.concatenate([b["f"] for b in batches]), f)
    # Iterated afresh each time, as eval datasets are.
    assert len(list(as_iterator(ds))) == 3
    assert iterator_state(as_iterator(ds)) is None


def test_as_iterator_tf_iterator_converts_tensors(tf):
    ds, x, _ = make_tf_dataset(tf)
    tf_iter = iter(ds)
    assert isinstance(next(iter(ds))["x"], tf.Tensor)
    batches = list(as_iterator(tf_iter))
    assert all(isinstance(b["x"], np.ndarray) for b in batches)
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), x)


def test_as_iterator_tfds_as_numpy(tf, tfds):
    ds, x, _ = make_tf_dataset(tf)
    batches = list(as_iterator(tfds.as_numpy(ds)))
    assert all(isinstance(b["x"], np.ndarray) for b in batches)
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), x)


def test_tfds_load_and_data_source_with_tf(tfds):
    with tfds.testing.mock_data(num_examples=12, policy=tfds.testing.MockPolicy.USE_CODE):
        loaded = tfds.load("mnist", split="train").batch(4)
        batches = list(as_iterator(loaded))
        assert len(batches) == 3
        assert batches[0]["image"].shape == (4, 28, 28, 1)
        assert isinstance(batches[0]["label"], np.ndarray)

        source = tfds.data_source("mnist", split="train")
        eval_ds = pad_to_global_batches(source, 8, process_index=0, process_count=1)
        eval_batches = list(eval_ds)
        assert len(eval_batches) == 2
        assert int(sum(b["mask"].sum() for b in eval_batches)) == 12
        first_example = next(as_iterator(source))
        assert first_example["image"].shape == (28, 28, 1)

        def global_batch(process_count):
            parts = [
                next(
                    iter(
                        GlobalBatchDataset(
                            source, 4, seed=1, process_index=p, process_count=process_count
                        )
                    )
                )
                for p in range(process_count)
            ]
            return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)

        one, two = global_batch(1), global_batch(2)
        assert one["image"].shape == (4, 28, 28, 1)
        np.testing.assert_array_equal(one["image"], two["image"])
        np.testing.assert_array_equal(one["label"], two["label"])


def test_prefetch_tf_data(tf):
    ds, x, _ = make_tf_dataset(tf, n=16, batch=8)
    with prefetch_to_device(as_iterator(ds), jax.device_put, size=2) as it:
        got = [np.asarray(b["x"]) for b in it]
    assert all(isinstance(g, np.ndarray) for g in got)
    np.testing.assert_array_equal(np.concatenate(got), x)


def test_read_ahead_from_a_tf_data_iterator_loses_no_batch_between_calls(tf):
    """With ``prefetch=2`` (a read-ahead thread, forced on CPU), a call of 20 steps then a
    continue call on the same tf.data iterator train on batches 0-29 in order."""
    import optax  # noqa: PLC0415
    from models import ClassifierStep, LinenMLP, toy_data  # noqa: PLC0415

    from jaxloop import outer_loop, train_loop  # noqa: PLC0415

    class IndexStep(ClassifierStep):
        def run(self, state, batch):
            state, out = super().run(state, batch)
            return state, {"loss": out["loss"], "i": batch["i"][0]}

    data = toy_data(16 * 40)
    index = np.repeat(np.arange(40, dtype=np.int32), 16)
    it = iter(tf.data.Dataset.from_tensor_slices({**data, "i": index}).batch(16))
    step = IndexStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(step), prefetch=2)
    state, _ = outer(step.initialize_model([1, 16]), train_dataset=it, train_total_steps=20,
                     train_loop_steps=10)
    outer(state, train_dataset=it, train_total_steps=30, train_loop_steps=10)
    assert [int(v) for v in outer.history["train/i"].values] == list(range(30))
