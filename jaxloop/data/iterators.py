"""Any dataset as an iterator, and an iterator's checkpointable position.

The loops read a dataset in whichever form the user has it through `as_iterator`; a
checkpoint records where it is with `iterator_state` (JSON) and a resumed run puts it back
with `restore_iterator_state`. TensorFlow is never imported here::

    it = as_iterator(grain.MapDataset.source(source).batch(8))
    next(it)
    state = iterator_state(it)      # for a checkpoint
    restore_iterator_state(iter(grain.MapDataset.source(source).batch(8)), state)
"""

from __future__ import annotations

import atexit
import collections.abc
import json
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import grain
import jax

from jaxloop.data.sources import ArraySource, Batch


def _is_tf(obj: Any, kind: str) -> bool:
    """Whether `obj` is a ``tf.data.<kind>`` (``Dataset``, ``Iterator``); never imports TF."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(obj, getattr(tf.data, kind))


class _TFToNumpyIterator(Iterator[Batch]):
    """Yields the elements of a tf.data iterator with every tf.Tensor leaf made numpy."""

    def __init__(self, iterator: Iterator[Any]):
        self._iterator = iterator

    def __next__(self) -> Batch:
        tf = sys.modules["tensorflow"]
        element = next(self._iterator)
        return jax.tree.map(lambda x: x.numpy() if isinstance(x, tf.Tensor) else x, element)


def as_iterator(dataset: Any) -> Iterator[Batch]:
    """An iterator over `dataset`: iterators as they are, grain datasets and random-access
    sources (single examples) as checkpointable grain iterators, a ``tf.data.Dataset`` as its
    numpy iterator, any other iterable as ``iter(dataset)`` (else a TypeError)::

        it = as_iterator([{'x': np.ones((8, 2))}, {'x': np.zeros((8, 2))}])
        batch = next(it)
    """
    if _is_tf(dataset, "Iterator"):
        return _TFToNumpyIterator(dataset)
    if isinstance(dataset, grain.DatasetIterator):
        return grain_ready(dataset)
    if isinstance(dataset, collections.abc.Iterator):
        return dataset
    if _is_tf(dataset, "Dataset"):
        return _TFToNumpyIterator(dataset.as_numpy_iterator())
    if isinstance(dataset, grain.MapDataset | grain.IterDataset):
        return grain_ready(iter(dataset))
    # Sources hold single examples (lists and tuples hold batches); a tfds source exists only
    # if the user imported tfds.
    tfds_base = sys.modules.get("tensorflow_datasets.core.data_sources.base")
    if isinstance(dataset, ArraySource | grain.sources.ArrayRecordDataSource
                  | grain.sources.RangeDataSource | grain.sources.SharedMemoryDataSource) or (
            tfds_base is not None and isinstance(dataset, tfds_base.BaseDataSource)):
        return iter(grain.MapDataset.source(dataset))
    if isinstance(dataset, Iterable):
        return iter(dataset)
    raise TypeError(f"Cannot iterate over a {describe_iterator(dataset)}: expected an iterable, "
                    "a grain dataset or source, or a tf.data.Dataset.")


def iterator_state(iterator: Any) -> dict[str, Any] | None:
    """The iterator's ``get_state()`` as a JSON-serialisable dict (a grain ``DataLoader``'s
    bytes decoded), or None if it has none."""
    get_state = getattr(iterator, "get_state", None)
    if not callable(get_state):
        return None
    state = get_state()
    return json.loads(state) if isinstance(state, bytes | bytearray) else state


def describe_iterator(iterator: Any) -> str:
    """A short name of an iterator's kind for messages (a prefetcher names its source)."""
    # Through sys.modules: importing jaxloop.data.read_ahead from here would point up the layers.
    prefetch = sys.modules.get("jaxloop.data.read_ahead")
    if prefetch is not None and isinstance(iterator, prefetch.Prefetcher):
        return f"{describe_iterator(iterator.source)} behind a device prefetcher"
    if isinstance(iterator, _TFToNumpyIterator):
        return "a tf.data iterator"
    kind = type(iterator)
    return f"{kind.__module__}.{kind.__qualname__}"


def restore_iterator_state(iterator: Any, state: Mapping[str, Any]) -> None:
    """Restores a state returned by `iterator_state` into an iterator of the same kind."""
    set_state = getattr(iterator, "set_state", None)
    if not callable(set_state):
        raise ValueError(f"Cannot restore the data position: a {type(iterator).__qualname__} has "
                         "no set_state() (a grain dataset or GlobalBatchDataset has).")
    if isinstance(iterator, grain.DataLoaderIterator) and not isinstance(state, bytes):
        # DataLoaderIterator.set_state wants the JSON bytes that iterator_state decoded.
        state = json.dumps(state).encode()
    set_state(state)


def absl_flags_usable() -> None:
    """Lets grain's workers start where absl never parsed the command line (flags: defaults)."""
    from absl import flags  # noqa: PLC0415 (a dependency of grain)

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


# grain iterators read through `as_iterator`, closed when the interpreter exits.
_TO_CLOSE: weakref.WeakSet = weakref.WeakSet()
_TO_CLOSE_LOCK = threading.Lock()


def _close_at_exit() -> None:
    with _TO_CLOSE_LOCK:
        iterators = list(_TO_CLOSE)
        _TO_CLOSE.clear()
    for iterator in iterators:
        iterator.close()


def grain_ready(iterator: grain.DatasetIterator) -> grain.DatasetIterator:
    """`iterator`, made safe to read where absl flags were never parsed (`absl_flags_usable`)
    and closed at exit before multiprocessing's clean-up (after it, each worker's queue
    printed an ``OSError: handle is closed`` traceback)."""
    absl_flags_usable()
    with _TO_CLOSE_LOCK:
        if not _TO_CLOSE:
            # atexit runs its functions last-registered first: multiprocessing registered
            # its clean-up when it was imported (grain imports it), before this.
            atexit.unregister(_close_at_exit)
            atexit.register(_close_at_exit)
        _TO_CLOSE.add(iterator)
    return iterator
