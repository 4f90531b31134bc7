"""Data layer: one iterator adapter, topology-independent global batching, device prefetch.

The loops accept a dataset in whichever form the user has it and turn it into an iterator
with `as_iterator`. For multi-host training `GlobalBatchDataset` defines the batches
globally, so the data a run sees does not depend on how many processes read it, and its
iterator state (a global batch index) restores under any process count; with
``num_workers`` its per-record work runs in grain worker processes. `prefetch_to_device`
overlaps host-side reading and the host-to-device copy with the step.
`pad_to_global_batches` gives every process the same number of eval steps and a mask that
marks the real examples, so eval covers each example exactly once.

TensorFlow is never imported here: tf.data objects are recognised only when the user has
imported TensorFlow already.
"""

from __future__ import annotations

import collections.abc
import json
import logging
import math
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np
from grain.experimental import ZipMapDataset

__all__ = [
    "ArraySource",
    "DevicePrefetchIterator",
    "GlobalBatchDataset",
    "GlobalBatchIterator",
    "as_iterator",
    "batch_rows",
    "describe_iterator",
    "iterator_state",
    "pad_to_global_batches",
    "prefetch_to_device",
    "restore_iterator_state",
]

Batch = Any
Example = Any


# ----------------------------------------------------------------------------------------
# as_iterator and iterator state
# ----------------------------------------------------------------------------------------


def _tensorflow() -> Any:
    """The TensorFlow module if the user imported it, else None (never imports it)."""
    return sys.modules.get("tensorflow")


def _is_tf_dataset(obj: Any) -> bool:
    tf = _tensorflow()
    return tf is not None and isinstance(obj, tf.data.Dataset)


def _is_tf_iterator(obj: Any) -> bool:
    tf = _tensorflow()
    return tf is not None and isinstance(obj, tf.data.Iterator)


class _TFToNumpyIterator(Iterator[Batch]):
    """Yields the elements of a tf.data iterator with every tf.Tensor leaf made numpy."""

    def __init__(self, iterator: Iterator[Any]):
        self._iterator = iterator

    def __next__(self) -> Batch:
        tf = _tensorflow()
        element = next(self._iterator)
        return jax.tree.map(lambda x: x.numpy() if isinstance(x, tf.Tensor) else x, element)


def _is_random_access_source(obj: Any) -> bool:
    """True for data *sources* (random access to examples), not for plain sequences.

    Lists and tuples are also random access, but users pass them as ready-made lists of
    batches, so they are iterated directly.
    """
    if isinstance(obj, ArraySource):
        return True
    grain_sources = (
        grain.sources.ArrayRecordDataSource,
        grain.sources.RangeDataSource,
        grain.sources.SharedMemoryDataSource,
    )
    if isinstance(obj, grain_sources):
        return True
    # Checked through sys.modules: a tfds source exists only if the user imported tfds.
    tfds_base = sys.modules.get("tensorflow_datasets.core.data_sources.base")
    return tfds_base is not None and isinstance(obj, tfds_base.BaseDataSource)


def as_iterator(dataset: Any) -> Iterator[Batch]:
    """Returns an iterator over `dataset`, whatever kind of dataset it is.

    * iterators and generators (including grain and tf.data iterators) are returned as they
      are (tf.data iterators get their tf.Tensor leaves converted to numpy);
    * grain ``MapDataset``, ``IterDataset`` and ``DataLoader`` give ``iter(dataset)``, which
      is a checkpointable grain iterator;
    * random-access data sources (``tfds.data_source(...)``, grain sources, `ArraySource`)
      are wrapped in ``grain.MapDataset.source`` so the iterator is checkpointable; they yield
      single examples;
    * a ``tf.data.Dataset`` (recognised only when TensorFlow is already imported) gives
      ``dataset.as_numpy_iterator()``;
    * any other iterable (lists of batches, ``tfds.as_numpy(...)``, `GlobalBatchDataset`)
      gives ``iter(dataset)``.

    Example::

        it = as_iterator([{'x': np.ones((8, 2))}, {'x': np.zeros((8, 2))}])
        batch = next(it)

    Raises:
      TypeError: if `dataset` is not iterable.
    """
    if _is_tf_iterator(dataset):
        return _TFToNumpyIterator(dataset)
    if isinstance(dataset, collections.abc.Iterator):
        return dataset
    if _is_tf_dataset(dataset):
        return _TFToNumpyIterator(dataset.as_numpy_iterator())
    if isinstance(dataset, grain.MapDataset | grain.IterDataset | grain.DataLoader):
        return iter(dataset)
    if _is_random_access_source(dataset):
        return iter(grain.MapDataset.source(dataset))
    if isinstance(dataset, Iterable):
        return iter(dataset)
    raise TypeError(
        f"Cannot iterate over a dataset of type {type(dataset).__module__}."
        f"{type(dataset).__qualname__}: expected an iterator, an iterable, a grain dataset, "
        "a random-access data source or a tf.data.Dataset."
    )


def iterator_state(iterator: Any) -> dict[str, Any] | None:
    """Returns the iterator's checkpointable state, or None if it has none.

    Uses ``iterator.get_state()``. grain ``DataLoader`` iterators return their state as
    JSON bytes; it is decoded to a dict so every state is a JSON-serialisable dict.

    Example::

        it = iter(GlobalBatchDataset(ArraySource({'x': x}), 8))
        next(it)
        iterator_state(it)  # {'next_batch': 1, ...}
        iterator_state(iter([1, 2]))  # None
    """
    get_state = getattr(iterator, "get_state", None)
    if not callable(get_state):
        return None
    state = get_state()
    if isinstance(state, bytes | bytearray):
        state = json.loads(state.decode())
    return state


def describe_iterator(iterator: Any) -> str:
    """A short name of an iterator's kind for messages (a prefetcher names its source)."""
    source = getattr(iterator, "source", None)
    if isinstance(iterator, DevicePrefetchIterator) and source is not None:
        return f"{describe_iterator(source)} behind a device prefetcher"
    if isinstance(iterator, _TFToNumpyIterator):
        return "a tf.data iterator"
    kind = type(iterator)
    return f"{kind.__module__}.{kind.__qualname__}"


def restore_iterator_state(iterator: Any, state: Mapping[str, Any]) -> None:
    """Restores a state returned by `iterator_state` into an iterator of the same kind.

    Example::

        state = iterator_state(it)
        ...
        new_it = iter(dataset)
        restore_iterator_state(new_it, state)

    Raises:
      ValueError: if the iterator cannot restore a state (it has no ``set_state``).
    """
    set_state = getattr(iterator, "set_state", None)
    if not callable(set_state):
        raise ValueError(
            f"Cannot restore the data position: iterator of type {type(iterator).__qualname__} "
            "has no set_state(). Use a checkpointable iterator (a grain dataset or "
            "GlobalBatchDataset) to resume training data exactly."
        )
    if isinstance(iterator, grain.DataLoaderIterator) and not isinstance(state, bytes):
        # DataLoaderIterator.set_state wants the JSON bytes that iterator_state decoded.
        state = json.dumps(state).encode()
    set_state(state)


# ----------------------------------------------------------------------------------------
# Random-access sources and global batching
# ----------------------------------------------------------------------------------------


class ArraySource(Sequence[Example]):
    """A random-access source over a pytree of arrays that share their leading dimension.

    Example::

        source = ArraySource({'image': images, 'label': labels})
        len(source)  # images.shape[0]
        source[3]  # {'image': images[3], 'label': labels[3]}
    """

    def __init__(self, arrays: Any):
        leaves = jax.tree.leaves(arrays)
        if not leaves:
            raise ValueError("ArraySource needs at least one array.")
        self._arrays = jax.tree.map(np.asarray, arrays)
        lengths = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(self._arrays)}
        if None in lengths or len(lengths) != 1:
            shapes = jax.tree.map(np.shape, self._arrays)
            raise ValueError(
                f"ArraySource arrays must share a leading dimension; got shapes {shapes}."
            )
        self._length = lengths.pop()

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Example:
        if not isinstance(index, int | np.integer):
            raise TypeError(f"ArraySource index must be an int, got {type(index).__name__}.")
        if not -self._length <= index < self._length:
            raise IndexError(f"index {index} out of range for ArraySource of {self._length}.")
        # np.asarray keeps 0-d leaves as arrays, as a gather of several rows would.
        return jax.tree.map(lambda x: np.asarray(x[index]), self._arrays)

    def gather(self, indices: np.ndarray) -> Batch:
        """The examples at `indices`, stacked (one numpy gather per leaf)."""
        return jax.tree.map(lambda x: x[indices], self._arrays)

    def __repr__(self) -> str:
        shapes = jax.tree.map(np.shape, self._arrays)
        return f"ArraySource({shapes})"


def batch_rows(
    mesh: jax.sharding.Mesh,
    data_axis: str | Sequence[str] | None,
    global_batch_size: int,
    process_index: int | None = None,
) -> tuple[int, int]:
    """The rows ``[start, stop)`` of each global batch that a process must provide.

    A global batch split along `data_axis` gives rows ``[c*G/D, (c+1)*G/D)`` to the devices
    at coordinate ``c`` of that axis (``D`` its size). A process provides the rows of the
    data coordinates its devices hold: with a 1-D data mesh in process order that is its
    ``1/P`` share, but where another axis (say 'model') crosses processes, several
    processes hold the same coordinates and must read the same rows.

    Example::

        # 2 processes x 4 devices, mesh data=4 x model=2 with 'model' across processes:
        devices = np.array(jax.devices()).reshape(2, 4).T  # [[0, 4], [1, 5], ...]
        mesh = Mesh(devices, ('data', 'model'))
        batch_rows(mesh, 'data', 64)  # (0, 64) on both processes

    Raises:
      ValueError: the global batch does not divide by the data axis size, or this
        process's data coordinates are not contiguous (no block of rows is its share).
    """
    if process_index is None:
        process_index = jax.process_index()
    if data_axis is None:
        return 0, global_batch_size
    axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
    for axis in axes:
        if axis not in mesh.axis_names:
            raise ValueError(f"data_axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    positions = [mesh.axis_names.index(a) for a in axes]
    sizes = [mesh.devices.shape[i] for i in positions]
    num_shards = int(np.prod(sizes))
    if global_batch_size % num_shards:
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide by the {num_shards} "
            f"shards of mesh axis {data_axis!r} (mesh {dict(mesh.shape)})."
        )
    coords = sorted({
        int(np.ravel_multi_index(tuple(idx[i] for i in positions), sizes))
        for idx, device in np.ndenumerate(mesh.devices)
        if device.process_index == process_index
    })
    if not coords:
        raise ValueError(f"Process {process_index} holds no device of the mesh {mesh}.")
    if coords != list(range(coords[0], coords[-1] + 1)):
        raise ValueError(
            f"Process {process_index} holds data coordinates {coords} of mesh axis "
            f"{data_axis!r}, which are not contiguous, so no block of rows of a global "
            "batch is its share. Lay the mesh out so each process's devices hold adjacent "
            "data coordinates (e.g. reshape jax.devices() in process order)."
        )
    shard = global_batch_size // num_shards
    return coords[0] * shard, (coords[-1] + 1) * shard


def _stack(examples: Sequence[Example]) -> Batch:
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *examples)


# Without workers, batches are read in the caller's thread (the device prefetch thread):
# jaxloop's prefetch decides what is read ahead, where grain's default read options would
# start 16 threads reading 500 batches ahead.
_READ_IN_CALLER = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class GlobalBatchDataset(Iterable[Batch]):
    """Global batches of a random-access source, the same for any number of processes.

    The order of the examples is grain's::

        order = grain.MapDataset.range(len(source)).shuffle(seed=seed).repeat(num_epochs)

    (each epoch a new permutation), and global batch ``k`` holds the examples at
    ``order[k*G:(k+1)*G]``. Process ``p`` of ``P`` reads only rows ``[p*G/P, (p+1)*G/P)`` of
    each global batch and yields them stacked (leading dimension ``G/P``). Given a
    `partitioner`, a process reads instead the rows of the data coordinates its devices
    hold in the partitioner's mesh (`batch_rows`), so processes that share data coordinates
    (a model axis across processes) read the same rows, as `Partitioner.shard_batch`
    expects. So the global batches depend only on the source, `global_batch_size`, `seed`,
    `shuffle` and `num_epochs`, never on the process count, and the iterator's state (the
    next global batch) restores under any process count.

    This process's batches are the grain ``MapDataset`` `batches` (batch ``k`` is
    ``batches[k]``): the positions above, batched and sliced to this process's rows, then
    read with one gather per array for an `ArraySource` (one read per example otherwise).
    Iterating gives grain's iterator over it, whose next index is the next global batch.

    Args:
      source: anything with ``__len__`` and ``__getitem__(int)`` returning one example (a
        pytree of numpy arrays): `ArraySource`, a grain ``MapDataset``, a
        ``tfds.data_source(...)`` split, a list of examples. A dict of arrays is wrapped in
        `ArraySource`. Every index must hold an example (no filtered-out ``None``).
      global_batch_size: the batch size summed over all processes (``G``).
      seed: shuffle seed (grain's: epoch ``e`` is permuted with seed ``seed + e``).
      shuffle: permute each epoch; if False, examples are read in source order.
      num_epochs: number of passes over the source; None repeats forever.
      drop_remainder: with finite epochs, drop the last partial global batch. If False, the
        last batch is completed with zero-filled examples and every batch gets a boolean
        ``batch[mask_key]`` of shape ``[G/P]`` that is True for real examples (examples must
        then be dicts).
      transform: optional function applied to each example after reading it.
      process_index: this process's index (default ``jax.process_index()``).
      process_count: number of processes (default ``jax.process_count()``).
      mask_key: key of the mask added when `drop_remainder` is False.
      partitioner: read the rows this process's devices hold in `partitioner.mesh` along
        `partitioner.data_axis` (instead of by process index). Needed when the data axis
        does not split the devices in process order, e.g. a model axis across processes.
      num_workers: grain worker processes that read and transform the batches (0: read in
        the thread that iterates).
      worker_buffer_size: batches each worker keeps ready.

    Example::

        ds = GlobalBatchDataset(ArraySource({'x': x, 'y': y}), global_batch_size=64, seed=1)
        it = iter(ds)
        batch = next(it)  # {'x': [64 // jax.process_count(), ...], 'y': ...}
        state = it.get_state()  # {'next_batch': 1, ...}

    Raises:
      ValueError: if `global_batch_size` is not divisible by the process count, or other
        arguments are out of range.
    """

    def __init__(
        self,
        source: Any,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        drop_remainder: bool = True,
        transform: Callable[[Example], Example] | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
        mask_key: str = "mask",
        partitioner: Any = None,
        num_workers: int = 0,
        worker_buffer_size: int = 2,
    ):
        if num_workers < 0 or worker_buffer_size < 1:
            raise ValueError(
                f"num_workers must be >= 0 and worker_buffer_size >= 1, got "
                f"num_workers={num_workers}, worker_buffer_size={worker_buffer_size}."
            )
        if isinstance(source, Mapping):
            # A dict has __len__ and __getitem__ too, but indexes keys, not examples.
            source = ArraySource(source)
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError(
                "GlobalBatchDataset needs a random-access source (with __len__ and "
                f"__getitem__), got {type(source).__qualname__}."
            )
        if process_index is None:
            process_index = jax.process_index()
        if process_count is None:
            process_count = jax.process_count()
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}.")
        if process_count <= 0 or not 0 <= process_index < process_count:
            raise ValueError(
                f"Invalid process_index={process_index} for process_count={process_count}."
            )
        if partitioner is None and global_batch_size % process_count:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"process_count={process_count}."
            )
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f"num_epochs must be None or positive, got {num_epochs}.")
        num_examples = len(source)
        if num_examples == 0 and num_epochs is None:
            raise ValueError("Cannot repeat an empty source forever (num_epochs=None).")

        self.source = source
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.num_epochs = num_epochs
        self.drop_remainder = bool(drop_remainder)
        self.transform = transform
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.mask_key = mask_key
        self.num_workers = int(num_workers)
        self.worker_buffer_size = int(worker_buffer_size)
        self.num_examples = int(num_examples)
        if partitioner is not None:
            self.rows = batch_rows(
                partitioner.mesh, partitioner.data_axis, self.global_batch_size,
                self.process_index,
            )
        else:
            share = self.global_batch_size // self.process_count
            self.rows = (self.process_index * share, (self.process_index + 1) * share)
        self.local_batch_size = self.rows[1] - self.rows[0]
        self._pad = num_epochs is not None and not drop_remainder
        self.batches = self._local_batches()

    def _local_batches(self) -> grain.MapDataset:
        g, (start, stop) = self.global_batch_size, self.rows
        order = grain.MapDataset.range(self.num_examples)
        if self.shuffle:
            order = order.shuffle(seed=self.seed)
        order = order.repeat(self.num_epochs)
        if self._pad and len(order) % g:
            padding = grain.MapDataset.range(g - len(order) % g).map(lambda _: -1)
            order = grain.MapDataset.concatenate([order, padding])
        # Global batch k is blocks [k*m, (k+1)*m) of `unit` positions (whole global batches
        # only) and this process's rows are n of them from block `first`: strided slices,
        # zipped. Slicing blocks, not positions, keeps grain's per-position work to a minimum.
        unit = math.gcd(g, start, stop)
        m, first, n = g // unit, start // unit, (stop - start) // unit
        blocks = order.batch(unit)[: len(order) // g * m]
        rows = ZipMapDataset([blocks[first + j :: m] for j in range(n)])
        return rows.map(self._read)

    @property
    def num_batches(self) -> int | None:
        """Number of global batches, or None if the dataset repeats forever."""
        if self.num_epochs is None:
            return None
        return len(self.batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("len() of a GlobalBatchDataset that repeats forever (num_epochs=None).")
        return self.num_batches

    def __iter__(self) -> GlobalBatchIterator:
        return GlobalBatchIterator(self)

    def __repr__(self) -> str:
        return (
            f"GlobalBatchDataset(num_examples={self.num_examples}, "
            f"global_batch_size={self.global_batch_size}, seed={self.seed}, "
            f"shuffle={self.shuffle}, num_epochs={self.num_epochs}, "
            f"drop_remainder={self.drop_remainder}, "
            f"process={self.process_index}/{self.process_count}, rows={self.rows}, "
            f"num_workers={self.num_workers})"
        )

    def _example(self, index: int) -> Example:
        example = self.source[index]
        if example is None:
            raise ValueError(
                f"Source returned None at index {index}; GlobalBatchDataset needs every "
                "index to hold an example (filter the data before batching)."
            )
        if self.transform is not None:
            example = self.transform(example)
        return example

    def _read(self, parts: tuple[np.ndarray, ...]) -> Batch:
        """The examples at these source indices, stacked; -1 marks a padding row."""
        indices = np.concatenate(parts)
        real = indices >= 0
        # Padding rows read example 0 and are zeroed: every process builds batches of the
        # same structure and shapes, even one that holds no real row.
        indices = np.where(real, indices, 0)
        if isinstance(self.source, ArraySource) and self.transform is None:
            batch = self.source.gather(indices)
        else:
            # One read per example: batched __getitems__ reads are not reliable across sources
            # (tfds.testing.mock_data breaks them).
            batch = _stack([self._example(int(i)) for i in indices])
        if not self._pad:
            return batch
        if not isinstance(batch, Mapping):
            raise TypeError(
                "drop_remainder=False adds a mask to each batch, so examples must be "
                f"dicts; got {type(batch).__qualname__}."
            )
        if self.mask_key in batch:
            raise ValueError(f"Examples already have a {self.mask_key!r} entry.")
        if not real.all():
            batch = jax.tree.map(
                lambda x: np.where(real.reshape(-1, *[1] * (x.ndim - 1)), x, np.zeros_like(x)),
                batch,
            )
        return {**batch, self.mask_key: real}


# Batches a GlobalBatchIterator with workers keeps to step back without restarting them:
# more than an OuterLoop prefetcher reads ahead (2 * prefetch + 1 at its default of 2).
_REPLAYABLE = 8


def _absl_flags_usable() -> None:
    """Lets grain's worker processes start where absl never parsed the command line (a
    script or notebook not run by ``absl.app``): grain reads an absl flag of its own when it
    starts workers, which raises until the flags are parsed; they keep their defaults."""
    from absl import flags  # noqa: PLC0415 (a dependency of grain)

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class GlobalBatchIterator(Iterator[Batch]):
    """Iterator of a `GlobalBatchDataset`: grain's iterator over its `batches` from the next
    global batch on (through its worker processes, with ``num_workers``).

    ``get_state()`` returns ``{'next_batch': k, 'global_batch_size': G, 'num_examples': N,
    'seed': s, 'shuffle': b}``, where ``k`` counts the batches returned so far
    (JSON-serialisable, no process or worker count); ``set_state`` checks that the recorded
    global batch size, dataset size, seed and shuffle flag match, and reads on from batch
    ``k`` (workers restart there when next read). `close` stops the workers.
    """

    def __init__(self, dataset: GlobalBatchDataset):
        self._dataset = dataset
        self._next_batch = 0
        self._iterator: Any = None  # made at the first read: workers start only if used
        # With workers, the last batches returned, so that a position a few batches back
        # (where a prefetcher that read ahead hands the iterator back) is restored without
        # restarting the workers; and the batches to return again before reading on.
        self._recent: collections.deque = collections.deque(
            maxlen=_REPLAYABLE if dataset.num_workers else 0)
        self._replay: collections.deque = collections.deque()

    def _open(self) -> Iterator[Batch]:
        ds = self._dataset
        pipeline = ds.batches[self._next_batch:].to_iter_dataset(_READ_IN_CALLER)
        if ds.num_workers:
            _absl_flags_usable()
            pipeline = pipeline.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=ds.num_workers, per_worker_buffer_size=ds.worker_buffer_size))
        return iter(pipeline)

    def __next__(self) -> Batch:
        if self._replay:
            batch = self._replay.popleft()
        else:
            if self._iterator is None:
                self._iterator = self._open()
            batch = next(self._iterator)
        self._recent.append(batch)
        self._next_batch += 1
        return batch

    def close(self) -> None:
        """Stops the worker processes (if any); a later read starts them again."""
        iterator, self._iterator = self._iterator, None
        self._recent.clear()
        self._replay.clear()
        close = getattr(iterator, "close", None)
        if callable(close):
            close()

    def get_state(self) -> dict[str, Any]:
        ds = self._dataset
        return {
            "next_batch": self._next_batch,
            "global_batch_size": ds.global_batch_size,
            "num_examples": ds.num_examples,
            "seed": ds.seed,
            "shuffle": ds.shuffle,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        if "next_batch" not in state:
            raise ValueError(
                f"Not a GlobalBatchDataset iterator state (no 'next_batch'): {state!r}."
            )
        expected = self.get_state()
        for key in ("global_batch_size", "num_examples", "seed", "shuffle"):
            if key in state and state[key] != expected[key]:
                raise ValueError(
                    f"Iterator state was saved with {key}={state[key]!r} but this dataset has "
                    f"{key}={expected[key]!r}; the saved position would not match."
                )
        next_batch = int(state["next_batch"])
        if not 0 <= next_batch <= len(self._dataset.batches):
            raise ValueError(
                f"next_batch={next_batch} is outside this dataset's "
                f"{len(self._dataset.batches)} batches."
            )
        back = self._next_batch - next_batch
        if 0 < back <= len(self._recent):
            for _ in range(back):  # read again, the workers running on
                self._replay.appendleft(self._recent.pop())
        elif back:
            self.close()
        self._next_batch = next_batch


def pad_to_global_batches(
    dataset: Any,
    global_batch_size: int,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    mask_key: str = "mask",
    transform: Callable[[Example], Example] | None = None,
    partitioner: Any = None,
) -> GlobalBatchDataset:
    """One in-order pass over a finite eval source, padded to whole global batches.

    Every process yields ``ceil(N / G)`` batches (``N`` examples, global batch ``G``), so
    all processes run the same number of eval steps. The last global batch is completed
    with zero-filled examples, and each batch has a boolean ``batch[mask_key]`` of shape
    ``[G/P]`` that is True exactly for real examples: weight metrics by it.

    Args:
      dataset: a random-access source of dict examples (see `GlobalBatchDataset`), or a
        dict of arrays.
      global_batch_size: batch size summed over processes.
      process_index: this process (default ``jax.process_index()``).
      process_count: number of processes (default ``jax.process_count()``).
      mask_key: key of the mask in each batch.
      transform: optional per-example function.
      partitioner: read rows by the partitioner's mesh layout (see `GlobalBatchDataset`).

    Example::

        eval_ds = pad_to_global_batches({'x': x_test, 'y': y_test}, global_batch_size=256)
        for batch in eval_ds:  # iterable again for each eval
            correct += np.sum((predict(batch['x']) == batch['y']) & batch['mask'])
    """
    return GlobalBatchDataset(
        dataset,
        global_batch_size,
        shuffle=False,
        num_epochs=1,
        drop_remainder=False,
        transform=transform,
        process_index=process_index,
        process_count=process_count,
        mask_key=mask_key,
        partitioner=partitioner,
    )


# ----------------------------------------------------------------------------------------
# Device prefetch
# ----------------------------------------------------------------------------------------

_BATCH, _END, _ERROR = "batch", "end", "error"
_POLL_SECONDS = 0.05


def _put(items: queue.Queue, stop: threading.Event, item: tuple[str, Any, Any]) -> bool:
    """Puts `item` once there is room; False if stopped first."""
    while not stop.is_set():
        try:
            items.put(item, timeout=_POLL_SECONDS)
            return True
        except queue.Full:
            pass
    return False


def _produce(
    source: Iterator[Batch],
    shard_fn: Callable[[Batch], Batch],
    items: queue.Queue,
    stop: threading.Event,
    track_state: bool,
) -> None:
    # A module-level function holding no reference to the DevicePrefetchIterator, so an
    # abandoned prefetcher can be garbage-collected (and its __del__ stop this thread).
    try:
        while not stop.is_set():
            try:
                batch = next(source)
            except StopIteration:
                _put(items, stop, (_END, None, None))
                return
            state = iterator_state(source) if track_state else None
            if not _put(items, stop, (_BATCH, shard_fn(batch), state)):
                return
    except BaseException as e:  # re-raised in the consumer thread
        _put(items, stop, (_ERROR, e, None))


class DevicePrefetchIterator(Iterator[Batch]):
    """Iterator that shards batches onto devices ahead of the consumer in a thread.

    Created by `prefetch_to_device`. ``get_state()`` reports the source iterator's state
    just after the last batch *returned to the consumer* (not the last batch prefetched),
    so a checkpoint resumes exactly; ``set_state`` discards prefetched batches and restarts.
    """

    def __init__(self, iterator: Any, shard_fn: Callable[[Batch], Batch], size: int = 2):
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}.")
        self._thread: threading.Thread | None = None
        self._source = as_iterator(iterator)
        if isinstance(self._source, grain.DatasetIterator):
            _absl_flags_usable()  # its pipeline may start worker processes (mp_prefetch)
        self._shard_fn = shard_fn
        self._size = size
        self._track_state = callable(getattr(self._source, "get_state", None))
        self._state = iterator_state(self._source) if self._track_state else None
        self._finished = False
        self._start()

    def _start(self) -> None:
        self._finished = False
        if self._size == 0:
            return
        self._items: queue.Queue = queue.Queue(self._size)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce,
            args=(self._source, self._shard_fn, self._items, self._stop, self._track_state),
            name="jaxloop-device-prefetch",
            daemon=True,  # never block interpreter exit on a stuck source
        )
        self._thread.start()

    def _shutdown(self, timeout: float | None = None) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        while not self._items.empty():  # frees a producer blocked on a full queue
            self._items.get_nowait()
        if thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logging.warning("jaxloop prefetch thread did not stop within %s s.", timeout)

    def __iter__(self) -> DevicePrefetchIterator:
        return self

    def __next__(self) -> Batch:
        if self._finished:
            raise StopIteration
        if self._size == 0:
            try:
                batch = next(self._source)
            except StopIteration:
                self._finished = True
                raise
            state = iterator_state(self._source) if self._track_state else None
            batch = self._shard_fn(batch)
            self._state = state
            return batch

        thread = self._thread
        if thread is None:  # closed
            self._finished = True
            raise StopIteration
        while True:
            try:
                kind, value, state = self._items.get(timeout=_POLL_SECONDS * 10)
                break
            except queue.Empty:
                if not thread.is_alive() and self._items.empty():
                    self._finished = True
                    self._shutdown()
                    raise RuntimeError("jaxloop prefetch thread exited unexpectedly.") from None
        if kind == _BATCH:
            self._state = state
            return value
        self._finished = True
        self._shutdown()
        if kind == _ERROR:
            raise value
        raise StopIteration

    @property
    def source(self) -> Iterator[Batch]:
        """The iterator this prefetcher reads from."""
        return self._source

    def get_state(self) -> dict[str, Any] | None:
        """The source iterator's state after the last consumed batch (None if stateless)."""
        return self._state

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Moves the source iterator to `state`, dropping batches prefetched so far."""
        if not callable(getattr(self._source, "set_state", None)):
            restore_iterator_state(self._source, state)  # raises, naming the source's type
        self._shutdown()
        restore_iterator_state(self._source, state)
        self._state = iterator_state(self._source)
        self._start()

    def close(self, timeout: float | None = None) -> None:
        """Stops and joins the prefetch thread; later `next()` calls end iteration.

        A source that can take a position (``set_state``) is moved back to just after the
        last consumed batch, so batches read ahead are not lost to a later user of it (the
        next `OuterLoop` call on the same iterator, say), however far the thread had read.
        """
        self._finished = True
        thread = self._thread
        self._shutdown(timeout)
        stopped = thread is None or not thread.is_alive()
        if stopped and self._state is not None and callable(
            getattr(self._source, "set_state", None)
        ):
            restore_iterator_state(self._source, self._state)

    def __enter__(self) -> DevicePrefetchIterator:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if getattr(self, "_thread", None) is not None:
                self._shutdown(timeout=5.0)
        except Exception:  # never raise from a finaliser
            pass


def prefetch_to_device(
    iterator: Any, shard_fn: Callable[[Batch], Batch], size: int = 2
) -> DevicePrefetchIterator:
    """Shards batches onto devices in a background thread, keeping `size` ready.

    Batches come out in order. An exception raised by the source iterator or `shard_fn`
    is re-raised by ``next()`` at the position where that batch would have come. With
    ``size=0`` there is no thread and each batch is sharded on ``next()``. Close it (or use
    it as a context manager) to stop the thread early; it also stops at the end of the data
    or on an error.

    Example::

        with prefetch_to_device(iter(train_ds), partitioner.shard_batch, size=2) as it:
            for batch in it:
                state, out = step(state, batch)
            data_state = it.get_state()  # position after the last batch used

    Args:
      iterator: source iterator (anything `as_iterator` accepts) of host numpy batches.
      shard_fn: puts a host batch on the devices, e.g. ``Partitioner.shard_batch``.
      size: number of batches kept ready (a bounded queue).
    """
    return DevicePrefetchIterator(iterator, shard_fn, size)
