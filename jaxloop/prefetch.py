"""A loop's batches prepared ahead of the loop that reads them.

`Prefetcher` stands beside the iterator a loop was given: the loop reads its batches
through it, while a background thread (`data.prefetch_to_device`) prepares the next ones
with the step's `prepare_batch`: preprocessed and placed on the devices (global arrays with
several processes), held in a bounded buffer, so the training thread only dispatches steps
and jit copies nothing. The two stages of grain's ``experimental.device_put``: the host
stage is the reading (in this thread, or ahead in grain worker processes with
``GlobalBatchDataset(num_workers=n)`` or a pipeline's ``mp_prefetch``), the device stage this
buffer. The thread starts at the first read, so a loop that reads ``next(dataset)`` itself
never starts it and loses no batch to it. `position` is the iterator's position after the
batches read through the prefetcher, not after those read ahead, so a checkpoint resumes
exactly.

Example::

    ahead = Prefetcher(iterator, step.prepare_batch, size=2)
    batch = next(ahead)      # a PreparedBatch of placed arrays; the thread starts here
    meta = ahead.position()  # for a checkpoint
    ahead.close()            # stops the thread; the iterator goes on after `batch`
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class Prefetcher(Iterator[Any]):
    """Reads `source` through a thread that keeps `size` batches prepared by `prepare`."""

    def __init__(self, source: Iterator[Any], prepare: Callable[[Any], Any], size: int):
        self.source = source
        self._prepare = prepare
        self._size = size
        self._thread_iterator: Any = None

    def __next__(self) -> Any:
        if self._thread_iterator is None:
            from jaxloop import data  # noqa: PLC0415 (grain loads only when asked)

            self._thread_iterator = data.prefetch_to_device(self.source, self._prepare,
                                                            self._size)
        return next(self._thread_iterator)

    def position(self) -> Any:
        """The source's checkpointable position after the batches read through this
        prefetcher (None when the source cannot report one)."""
        from jaxloop import data  # noqa: PLC0415

        if self._thread_iterator is None:
            return data.iterator_state(self.source)
        return self._thread_iterator.get_state()

    def close(self) -> None:
        """Stops the thread (see `data.DevicePrefetchIterator.close`)."""
        if self._thread_iterator is not None:
            self._thread_iterator.close()
