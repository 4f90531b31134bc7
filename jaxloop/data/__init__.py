"""Data layer: one iterator adapter, topology-independent global batching, device prefetch.

The loops accept a dataset in whichever form the user has it and turn it into an iterator
with `as_iterator` (`iterators`). For multi-host training `GlobalBatchDataset`
(`global_batches`) defines the batches globally, so the data a run sees does not depend on
how many processes read it, and its iterator state (a global batch index) restores under
any process count; with ``num_workers`` its per-record work runs in grain worker processes.
`pad_to_global_batches` (`padding`) gives every process the same number of eval steps and a
mask that marks the real examples, so eval covers each example exactly once.
`prefetch_to_device` (`jaxloop.prefetch`) overlaps host-side reading and the host-to-device
copy with the step.

This package re-exports the names users write as ``data.<name>``; jaxloop's own modules
import from the submodules.

Example::

    from jaxloop import data

    ds = data.GlobalBatchDataset(data.ArraySource({'x': x, 'y': y}), global_batch_size=64)
    it = data.as_iterator(ds)
    batch = next(it)
    data.iterator_state(it)  # {'next_batch': 1, ...}

TensorFlow is never imported here: tf.data objects are recognised only when the user has
imported TensorFlow already.
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
from jaxloop.data.sources import ArraySource
from jaxloop.read_ahead import Prefetcher as DevicePrefetchIterator
from jaxloop.read_ahead import prefetch_to_device

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
