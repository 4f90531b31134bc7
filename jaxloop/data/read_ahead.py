"""Batches read ahead in a background thread (`Prefetcher`): a loop's (`Loop.prefetching`)
and a hand-written loop's (`data.prefetch_to_device`), placed there too where the step's
devices are not CPUs (`places_ahead`). Grain loads only at the first read."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

Batch = Any

_BATCH, _END, _ERROR = "batch", "end", "error"
_POLL_SECONDS = 0.5
# What an `OuterLoop` reads ahead by default where batches are placed ahead.
DEFAULT_SIZE = 2


def places_ahead(step: Any) -> bool:
    """Whether a prefetcher places the step's batches ahead: where its mesh has a device
    other than a CPU (on CPUs a device array is host memory)."""
    mesh = getattr(getattr(step, "partitioner", None), "mesh", None)
    devices = mesh.devices.flat if mesh is not None else ()
    return any(d.platform != "cpu" for d in devices)


def default_size(step: Any) -> int:
    """Batches an `OuterLoop` reads ahead unless told: `DEFAULT_SIZE` where they are placed
    ahead, else 0; an explicit ``OuterLoop(..., prefetch=4)`` wins (for a slow pipeline)."""
    return DEFAULT_SIZE if places_ahead(step) else 0


def _iterators() -> Any:
    """`jaxloop.data.iterators`, imported on first use (it loads grain)."""
    from jaxloop.data import iterators  # noqa: PLC0415

    return iterators


def _produce(source: Iterator[Batch], prepare: Callable[[Batch], Batch], items: queue.Queue,
             stop: threading.Event, state_of: Callable[[Any], Any]) -> None:
    # Module-level, holding no reference to the Prefetcher: an abandoned one is collected
    # and its __del__ stops this thread. A put blocked once stopped ends when the stopping
    # consumer drains the queue, which it does again after this thread ends.
    try:
        while not stop.is_set():
            try:
                batch = next(source)
            except StopIteration:
                items.put((_END, None, None))
                return
            items.put((_BATCH, prepare(batch), state_of(source)))
    except BaseException as e:  # re-raised in the consumer thread
        items.put((_ERROR, e, None))


class Prefetcher(Iterator[Batch]):
    """Reads `source` (anything `data.as_iterator` accepts) through a thread that keeps
    `size` batches prepared by `prepare` (such as ``step.prepare_batch``), in order;
    ``size=0``: no thread.

    The thread starts at the first ``next()`` (or `start`), so a loop reading `source`
    itself first loses no batch. An error of the source or `prepare` is raised by
    ``next()`` where its batch would have come. ``get_state()`` (`position`) is just after
    the last batch *returned*, not read ahead, so a checkpoint resumes exactly."""

    def __init__(self, source: Any, prepare: Callable[[Batch], Batch], size: int):
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}.")
        self.source = source
        self._prepare = prepare
        self._size = size
        self._reader: Iterator[Batch] | None = None  # `source` as an iterator, once read
        self._state: Any = None
        self._thread: threading.Thread | None = None
        self._finished = False
        # Items read from the source but not returned, once the thread stopped.
        self._unreturned: list[tuple[str, Any, Any]] = []

    def start(self) -> Prefetcher:
        """Starts reading ahead now, not at the first ``next()``; returns self."""
        if self._reader is None and not self._finished:
            iterators = _iterators()
            self._reader = iterators.as_iterator(self.source)
            self._state_of = iterators.iterator_state
            self._state = self._state_of(self._reader)
            self._start_thread()
        return self

    def _start_thread(self) -> None:
        self._finished = False
        if self._size == 0:
            return
        self._items: queue.Queue = queue.Queue(self._size)
        self._stop = threading.Event()
        self._thread = threading.Thread(  # daemon: a stuck source never blocks exit
            target=_produce,
            args=(self._reader, self._prepare, self._items, self._stop, self._state_of),
            name="jaxloop-device-prefetch", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._items.empty():
            self._unreturned.append(self._items.get_nowait())

    def _shutdown(self, timeout: float | None = None) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        self._drain()  # frees a producer blocked on a full queue
        if thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logging.warning("jaxloop prefetch thread did not stop within %s s.", timeout)
        self._drain()

    def __next__(self) -> Batch:
        self.start()
        if self._finished:
            raise StopIteration
        if self._size == 0:
            try:
                batch = next(self._reader)
            except StopIteration:
                self._finished = True
                raise
            batch = self._prepare(batch)
            self._state = self._state_of(self._reader)
            return batch

        thread = self._thread
        if thread is None:  # closed
            self._finished = True
            raise StopIteration
        while True:
            try:
                kind, value, state = self._items.get(timeout=_POLL_SECONDS)
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

    def get_state(self) -> dict[str, Any] | None:
        """The source's state after the last batch returned (None if it has none)."""
        if self._reader is None:  # nothing read through this prefetcher yet
            return _iterators().iterator_state(self.source)
        return self._state

    def position(self) -> dict[str, Any] | None:
        """The same as `get_state`."""
        return self.get_state()

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Moves the source to `state`, dropping the batches read ahead so far (ValueError if
        the source has no ``set_state``)."""
        iterators = _iterators()
        if self._reader is None:
            iterators.restore_iterator_state(self.source, state)
            return
        if not callable(getattr(self._reader, "set_state", None)):
            iterators.restore_iterator_state(self._reader, state)  # raises, naming its type
        self._shutdown()
        self._unreturned.clear()
        iterators.restore_iterator_state(self._reader, state)
        self._state = iterators.iterator_state(self._reader)
        self._start_thread()

    def close(self, timeout: float | None = None) -> list[tuple[Batch, Any]]:
        """Stops the thread (later ``next()`` calls end iteration). A source that takes a
        position is moved back to just after the last batch returned; from any other, the
        batches read ahead are returned instead, as (prepared batch, the source's position
        before it) pairs, for whoever reads the source next (`Loop.prefetching` keeps them).
        An error read ahead comes last, as (the exception, None)."""
        self._finished = True
        if self._reader is None:  # never read: the source is where it was
            return []
        thread = self._thread
        self._shutdown(timeout)
        stopped = thread is None or not thread.is_alive()
        unreturned, self._unreturned = self._unreturned, []
        if stopped and self._state is not None and callable(
                getattr(self._reader, "set_state", None)):
            _iterators().restore_iterator_state(self._reader, self._state)
            return []
        kept, position = [], self._state
        for kind, value, state in unreturned:
            if kind == _END:
                break
            kept.append((value, position))
            if kind == _ERROR:
                break
            position = state
        return kept

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise from a finaliser
            self._shutdown(timeout=5.0)


def prefetch_to_device(iterator: Any, shard_fn: Callable[[Batch], Batch], size: int = 2
                       ) -> Prefetcher:
    """Shards batches onto devices (`shard_fn`, e.g. ``Partitioner.shard_batch``) in a
    background thread, keeping `size` ready: a `Prefetcher` started at once.

    Example::

        with prefetch_to_device(iter(train_ds), partitioner.shard_batch, size=2) as it:
            for batch in it:
                state, out = step(state, batch)
            data_state = it.get_state()  # position after the last batch used
    """
    return Prefetcher(_iterators().as_iterator(iterator), shard_fn, size).start()
