"""Data layer: any dataset as an iterator (`as_iterator`), global batches that do not depend
on the process count (`GlobalBatchDataset`), exact eval (`pad_to_global_batches`) and device
prefetch. Re-exports the names users write as ``data.<name>``; jaxloop imports the submodules.

Example::

    from jaxloop import data

    ds = data.GlobalBatchDataset(data.ArraySource({'x': x, 'y': y}), global_batch_size=64)
    it = data.as_iterator(ds)
    batch = next(it)
    data.iterator_state(it)  # {'next_batch': 1, ...}
"""

from jaxloop.data.global_batch_iterator import GlobalBatchIterator
from jaxloop.data.global_batches import GlobalBatchDataset, batch_rows
from jaxloop.data.iterators import (
    as_iterator,
    describe_iterator,
    iterator_state,
    restore_iterator_state,
)
from jaxloop.data.padding import pad_to_global_batches
from jaxloop.data.read_ahead import Prefetcher as DevicePrefetchIterator
from jaxloop.data.read_ahead import prefetch_to_device
from jaxloop.data.sources import ArraySource

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
