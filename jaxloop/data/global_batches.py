"""Global batches: the data a run sees, independent of how many processes read it. Each
process reads only its rows of each global batch, so the iterator's position (a global batch
index) restores under any process count::

    ds = GlobalBatchDataset(ArraySource({'x': x, 'y': y}), global_batch_size=64, seed=1)
    batch = next(iter(ds))  # this process's rows of global batch 0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np
from grain.experimental import ZipMapDataset

from jaxloop.data.global_batch_iterator import GlobalBatchIterator
from jaxloop.data.sources import ArraySource, Batch, Example


def batch_rows(mesh: jax.sharding.Mesh, data_axis: str | Sequence[str] | None,
               global_batch_size: int, process_index: int | None = None) -> tuple[int, int]:
    """The rows ``[start, stop)`` of each global batch that a process must provide: those of
    the data coordinates its devices hold (ValueError if they are not contiguous)::

        # 2 processes x 4 devices, mesh data=4 x model=2 with 'model' across processes:
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4).T, ('data', 'model'))
        batch_rows(mesh, 'data', 64)  # (0, 64) on both processes
    """
    process_index = jax.process_index() if process_index is None else process_index
    if data_axis is None:
        return 0, global_batch_size
    axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
    for axis in axes:
        if axis not in mesh.axis_names:
            raise ValueError(f"data_axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    positions = [mesh.axis_names.index(a) for a in axes]
    num_shards = math.prod(mesh.devices.shape[i] for i in positions)
    if global_batch_size % num_shards:
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide by the {num_shards} "
            f"shards of mesh axis {data_axis!r} (mesh {dict(mesh.shape)}).")
    # One row of devices per data coordinate (the data axes first, flattened in order).
    rows = np.moveaxis(mesh.devices, positions, list(range(len(axes)))).reshape(num_shards, -1)
    coords = [i for i, row in enumerate(rows) if any(d.process_index == process_index for d in row)]
    if not coords:
        raise ValueError(f"Process {process_index} holds no device of the mesh {mesh}.")
    if coords != list(range(coords[0], coords[-1] + 1)):
        raise ValueError(
            f"Process {process_index} holds data coordinates {coords} of mesh axis "
            f"{data_axis!r}, which are not contiguous: lay the mesh out so each process's "
            "devices hold adjacent data coordinates (jax.devices() in process order).")
    shard = global_batch_size // num_shards
    return coords[0] * shard, (coords[-1] + 1) * shard


class GlobalBatchDataset(Iterable[Batch]):
    """Global batches of a random-access source, the same for any number of processes.

    Global batch ``k`` holds ``order[k*G:(k+1)*G]`` of grain's shuffled, repeated order;
    process ``p`` of ``P`` yields rows ``[p*G/P, (p+1)*G/P)`` of it stacked, or with a
    `partitioner` the rows its devices hold (`batch_rows`). `batches` is this process's grain
    ``MapDataset`` (batch k is ``batches[k]``).

    Args:
      source: ``__len__`` and ``__getitem__(int)`` returning one example (`ArraySource`, a
        grain ``MapDataset``, a tfds source, a list); a dict of arrays becomes an
        `ArraySource`. Every index must hold an example.
      global_batch_size: the batch size summed over all processes (``G``).
      drop_remainder: with finite epochs, drop the last partial global batch; if False, it
        is completed with zeros and every (dict) batch gets a boolean ``batch[mask_key]``
        that is True for real examples.
      num_workers: grain worker processes that read the batches (0: read in the caller).
    """

    def __init__(self, source: Any, global_batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, num_epochs: int | None = None, drop_remainder: bool = True,
                 transform: Callable[[Example], Example] | None = None,
                 process_index: int | None = None, process_count: int | None = None,
                 mask_key: str = "mask", partitioner: Any = None, num_workers: int = 0,
                 worker_buffer_size: int = 2):
        if num_workers < 0 or worker_buffer_size < 1:
            raise ValueError("num_workers must be >= 0 and worker_buffer_size >= 1, got "
                             f"num_workers={num_workers}, worker_buffer_size={worker_buffer_size}.")
        if isinstance(source, Mapping):
            # A dict has __len__ and __getitem__ too, but indexes keys, not examples.
            source = ArraySource(source)
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError("GlobalBatchDataset needs a random-access source (with __len__ and "
                            f"__getitem__), got {type(source).__qualname__}.")
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}.")
        if not 0 <= process_index < process_count:
            raise ValueError(
                f"Invalid process_index={process_index} for process_count={process_count}.")
        if partitioner is None and global_batch_size % process_count:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                             f"process_count={process_count}.")
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f"num_epochs must be None or positive, got {num_epochs}.")
        if len(source) == 0 and num_epochs is None:
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
        self.num_examples = len(source)
        if partitioner is not None:
            self.rows = batch_rows(partitioner.mesh, partitioner.data_axis,
                                   self.global_batch_size, self.process_index)
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
        # Global batch k is blocks [k*m, (k+1)*m) of `unit` positions and this process's rows
        # are n of them from block `first`: slicing blocks keeps grain's per-position work low.
        unit = math.gcd(g, start, stop)
        m, first, n = g // unit, start // unit, (stop - start) // unit
        blocks = order.batch(unit)[: len(order) // g * m]
        return ZipMapDataset([blocks[first + j :: m] for j in range(n)]).map(self._read)

    @property
    def num_batches(self) -> int | None:
        """Number of global batches, or None if the dataset repeats forever."""
        return None if self.num_epochs is None else len(self.batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("len() of a GlobalBatchDataset that repeats forever (num_epochs=None).")
        return self.num_batches

    def __iter__(self) -> GlobalBatchIterator:
        return GlobalBatchIterator(self)

    def __repr__(self) -> str:
        return (f"GlobalBatchDataset(num_examples={self.num_examples}, global_batch_size="
                f"{self.global_batch_size}, seed={self.seed}, shuffle={self.shuffle}, "
                f"num_epochs={self.num_epochs}, drop_remainder={self.drop_remainder}, process="
                f"{self.process_index}/{self.process_count}, rows={self.rows}, "
                f"num_workers={self.num_workers})")

    def _example(self, index: int) -> Example:
        example = self.source[index]
        if example is None:
            raise ValueError(f"Source returned None at index {index}; GlobalBatchDataset needs "
                             "every index to hold an example (filter the data before batching).")
        return example if self.transform is None else self.transform(example)

    def _read(self, parts: tuple[np.ndarray, ...]) -> Batch:
        """The examples at these source indices, stacked; -1 marks a padding row."""
        indices = np.concatenate(parts)
        real = indices >= 0
        # Padding rows read example 0 and are zeroed: every process's batches have the same
        # structure, even one that holds no real row.
        indices = np.where(real, indices, 0)
        if isinstance(self.source, ArraySource) and self.transform is None:
            batch = self.source.gather(indices)
        else:
            # Batched __getitems__ reads are not reliable across sources (tfds mock data).
            batch = jax.tree.map(lambda *xs: np.stack(xs),
                                 *[self._example(int(i)) for i in indices])
        if not self._pad:
            return batch
        if not isinstance(batch, Mapping):
            raise TypeError("drop_remainder=False adds a mask to each batch, so examples must be "
                            f"dicts; got {type(batch).__qualname__}.")
        if self.mask_key in batch:
            raise ValueError(f"Examples already have a {self.mask_key!r} entry.")
        if not real.all():
            batch = jax.tree.map(
                lambda x: np.where(real.reshape(-1, *[1] * (x.ndim - 1)), x, np.zeros_like(x)),
                batch)
        return {**batch, self.mask_key: real}

