"""`GlobalBatchIterator`: the iterator of a `GlobalBatchDataset`, its position and workers (a
position a few batches back is restored without restarting them)."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from typing import Any

import grain

from jaxloop.data.iterators import Batch, grain_ready

# Read in the caller's thread: jaxloop's prefetch decides what is read ahead, not grain.
_READ_IN_CALLER = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)

# Batches kept to step back without restarting the workers (more than a prefetcher reads).
_REPLAYABLE = 8


class GlobalBatchIterator(Iterator[Batch]):
    """Iterator of a `GlobalBatchDataset`: ``get_state()`` is ``{'next_batch': k, ...}`` with
    the dataset's size, seed and shuffle, which ``set_state`` checks before reading on from k."""

    def __init__(self, dataset: Any):
        self._dataset = dataset
        self._next_batch = 0
        self._iterator: Any = None  # made at the first read: workers start only if used
        # With workers: the last batches returned (to step back to), and those to return again.
        self._recent: collections.deque = collections.deque(
            maxlen=_REPLAYABLE if dataset.num_workers else 0)
        self._replay: collections.deque = collections.deque()

    def _open(self) -> Iterator[Batch]:
        ds = self._dataset
        pipeline = ds.batches[self._next_batch:].to_iter_dataset(_READ_IN_CALLER)
        if ds.num_workers:
            return grain_ready(iter(pipeline.mp_prefetch(grain.MultiprocessingOptions(
                num_workers=ds.num_workers, per_worker_buffer_size=ds.worker_buffer_size))))
        return iter(pipeline)

    def __next__(self) -> Batch:
        if not self._replay and self._iterator is None:
            self._iterator = self._open()
        batch = self._replay.popleft() if self._replay else next(self._iterator)
        self._recent.append(batch)
        self._next_batch += 1
        return batch

    def close(self) -> None:
        """Stops the worker processes (if any); a later read starts them again."""
        iterator, self._iterator = self._iterator, None
        self._recent.clear()
        self._replay.clear()
        if iterator is not None:
            iterator.close()

    def get_state(self) -> dict[str, Any]:
        ds = self._dataset
        return {"next_batch": self._next_batch, "global_batch_size": ds.global_batch_size,
                "num_examples": ds.num_examples, "seed": ds.seed, "shuffle": ds.shuffle}

    def set_state(self, state: Mapping[str, Any]) -> None:
        if "next_batch" not in state:
            raise ValueError(
                f"Not a GlobalBatchDataset iterator state (no 'next_batch'): {state!r}.")
        expected = self.get_state()
        for key in ("global_batch_size", "num_examples", "seed", "shuffle"):
            if key in state and state[key] != expected[key]:
                raise ValueError(
                    f"Iterator state was saved with {key}={state[key]!r} but this dataset has "
                    f"{key}={expected[key]!r}; the saved position would not match.")
        next_batch = int(state["next_batch"])
        if not 0 <= next_batch <= len(self._dataset.batches):
            raise ValueError(f"next_batch={next_batch} is outside this dataset's "
                             f"{len(self._dataset.batches)} batches.")
        back = self._next_batch - next_batch
        if 0 < back <= len(self._recent):
            self._replay.extendleft(self._recent.pop() for _ in range(back))  # workers run on
        elif back:
            self.close()
        self._next_batch = next_batch
