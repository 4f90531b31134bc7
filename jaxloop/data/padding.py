"""Exact evaluation: one in-order pass over a finite source, padded to whole global batches.

Every process runs the same number of eval steps, and a mask marks the real examples, so
metrics weighted by it count each example exactly once.

Example::

    eval_ds = pad_to_global_batches({'x': x_test, 'y': y_test}, global_batch_size=256)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxloop.data.global_batches import GlobalBatchDataset

Example = Any


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
