"""Exact evaluation: every process runs the same eval steps; a mask counts each example once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxloop.data.global_batches import Example, GlobalBatchDataset


def pad_to_global_batches(dataset: Any, global_batch_size: int, *,
                          process_index: int | None = None, process_count: int | None = None,
                          mask_key: str = "mask",
                          transform: Callable[[Example], Example] | None = None,
                          partitioner: Any = None) -> GlobalBatchDataset:
    """One in-order pass over a finite eval source, padded with zeros to ``ceil(N / G)`` global
    batches on every process; ``batch[mask_key]`` is True for real examples (weight by it)::

        eval_ds = pad_to_global_batches({'x': x_test, 'y': y_test}, global_batch_size=256)
        for batch in eval_ds:  # iterable again for each eval
            correct += np.sum((predict(batch['x']) == batch['y']) & batch['mask'])
    """
    return GlobalBatchDataset(
        dataset, global_batch_size, shuffle=False, num_epochs=1, drop_remainder=False,
        transform=transform, process_index=process_index, process_count=process_count,
        mask_key=mask_key, partitioner=partitioner)
