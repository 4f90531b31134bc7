"""A loop's batches prepared ahead of the loop that reads them.

`Prefetcher` stands beside the iterator a loop was given: the loop reads its batches
through it, while a background thread (`data.prefetch_to_device`) prepares the next ones
with the step's `prepare_batch` into a bounded queue. Where a host-to-device copy exists
(GPU, TPU) the thread also places them, so the copy overlaps the step; where device arrays
are host memory (CPU) it only reads ahead and the program's jit places each batch
(`places_ahead` decides, in this one place). The thread starts at the first read, so a loop
that reads ``next(dataset)`` itself loses no batch to it; `position` is after the batches
read through the prefetcher, not those read ahead, so a checkpoint resumes exactly.

Example::

    ahead = Prefetcher(iterator, step.prepare_batch, size=2)
    batch = next(ahead)      # a PreparedBatch of placed arrays; the thread starts here
    meta = ahead.position()  # for a checkpoint
    ahead.close()            # stops the thread; the iterator goes on after `batch`
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

# What an `OuterLoop` reads ahead by default where batches are placed ahead (`places_ahead`).
DEFAULT_SIZE = 2


def places_ahead(step: Any) -> bool:
    """Whether a prefetcher places the step's batches on its devices ahead of the step: where
    the step's mesh has a device other than a CPU (a copy to device memory, which the thread
    overlaps with the step). On CPUs a device array is host memory: placing ahead buys
    nothing and takes a core from XLA.

    Example::

        places_ahead(step)  # False for a step on CPU devices
    """
    mesh = getattr(getattr(step, "partitioner", None), "mesh", None)
    devices = mesh.devices.flat if mesh is not None else ()
    return any(d.platform != "cpu" for d in devices)


def default_size(step: Any) -> int:
    """Batches an `OuterLoop` reads ahead unless told: `DEFAULT_SIZE` where they are placed
    ahead (`places_ahead`), else 0 (batches are read in the training thread, as a
    hand-written loop reads them; ask for a read-ahead thread for a slow input pipeline).

    Example::

        OuterLoop(train_loop, prefetch=4)  # an explicit size always wins
    """
    return DEFAULT_SIZE if places_ahead(step) else 0


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
