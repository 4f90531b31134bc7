"""Batches made ready for a step's program: of one layout, stacked for fused steps (`stack`,
placed by `jaxloop.sharding.batches`) and padded to the program's size (`padded`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop import types
from jaxloop.sharding import batches as batches_lib

Batch = types.Batch


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """A batch already preprocessed and placed (`Step.prepare_batch`): the step skips both."""

    batch: Batch


class BatchLayoutError(ValueError):
    """Batches meant for one execution differ in tree structure or leaf shapes."""


def batch_layout(batch: Batch | PreparedBatch) -> tuple:
    """The tree structure and leaf shapes of a batch: batches of one layout can be stacked."""
    batch = batch.batch if isinstance(batch, PreparedBatch) else batch
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return treedef, tuple(map(np.shape, leaves))


@functools.lru_cache(maxsize=64)
def _device_stacker(treedef: Any, shardings: tuple) -> Any:
    """One jitted stack of placed batches per layout and size (not a dispatch per leaf)."""
    return jax.jit(lambda batches: jax.tree.map(lambda *xs: jnp.stack(xs), *batches),
                   out_shardings=jax.tree_util.tree_unflatten(treedef, list(shardings)))


def padded(batches: Sequence[Batch], size: int, moved_once: bool = False
           ) -> tuple[Batch, ...]:
    """`batches` and repeats of the last, `size` in all (``padded([b1, b2], 3) == (b1, b2,
    b2)``); BatchLayoutError unless of one layout. With `moved_once`, a last host batch that
    repeats is moved to the devices once: the padding moves nothing more."""
    if not 0 < len(batches) <= size:
        raise ValueError(f"an execution takes 1 to {size} batches, got {len(batches)}")
    layouts = {batch_layout(b) for b in batches}
    if len(layouts) > 1:
        raise BatchLayoutError(
            f"Batches run in one execution must share one layout (tree structure and "
            f"leaf shapes); got {len(layouts)} layouts: {sorted(map(str, layouts))}")
    last = batches[-1]
    if moved_once and len(batches) < size and not all(
            isinstance(x, jax.Array) for x in jax.tree.leaves(last)):
        # Uncommitted (no sharding given): jit then places it as it places a host batch,
        # in the same program; a committed array would make jit compile another.
        last = jax.device_put(last)
    return (*batches[:-1], *[last] * (size - len(batches) + 1))


def stack(batches: Sequence[Batch], size: int, partitioner: Any, place_it: bool = False
          ) -> Batch:
    """Stacks `batches` (preprocessed, of one layout) on a new leading axis of `size`, the
    last repeated: on the host (placed with `place_it`), or on the devices where some are
    placed or, with `place_it`, fewer than `size` (each moved once, the padding not)."""
    if len(batches) == size or not place_it:
        full = padded(batches, size)
        if not any(isinstance(x, jax.Array) for x in jax.tree.leaves(full[0])):
            stacked = jax.tree.map(lambda *xs: np.stack(xs), *full)
            return partitioner.shard_stacked_batch(stacked) if place_it else stacked
    full = padded(batches, size, moved_once=True)
    rule, treedef = jax.tree.flatten(batches_lib.batch_shardings(partitioner, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((size, *np.shape(x)), x.dtype), full[0]), stacked=True))
    return _device_stacker(treedef, tuple(rule))(list(full))
