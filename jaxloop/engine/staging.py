"""Batches made ready for a step's program: placed along the data axis (`place`), stacked for
fused steps (`stack`), and an execution's stacked outputs split per step (`unstack`,
`entry`).
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
from jaxloop.sharding import annotations

Batch = types.Batch


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """A batch already preprocessed and placed (`Step.prepare_batch`): the step skips both."""

    batch: Batch


class BatchLayoutError(ValueError):
    """Batches meant for one execution differ in tree structure or leaf shapes."""


def batch_layout(batch: Batch | PreparedBatch) -> tuple:
    """The tree structure and leaf shapes of a batch: batches of one layout can be stacked."""
    if isinstance(batch, PreparedBatch):
        batch = batch.batch
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return treedef, tuple(map(np.shape, leaves))


@functools.cache
def _local_shards(mesh: jax.sharding.Mesh, axis: str | tuple[str, ...] | None) -> int:
    """The distinct coordinates along `axis` (one or several) of this process's devices."""
    if axis is None:
        return 1
    index = [mesh.axis_names.index(a) for a in ((axis,) if isinstance(axis, str) else axis)]
    local = {d.id for d in mesh.local_devices}
    return len({tuple(idx[i] for i in index)
                for idx, d in np.ndenumerate(mesh.devices) if d.id in local})


def batch_shardings(partitioner: Any, batch: Batch, stacked: bool = False) -> Any:
    """Each leaf's sharding: split along the data axis on its leading dimension (with
    `stacked`, its second), replicated if it has none; cached per layout. ValueError where
    a batch dimension does not divide by this process's devices along the data axis."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    shardings = _leaf_shardings(partitioner.mesh, partitioner.data_axis, treedef, shapes,
                                stacked)
    return jax.tree_util.tree_unflatten(treedef, shardings)


@functools.lru_cache(maxsize=256)
def _leaf_shardings(mesh: jax.sharding.Mesh, axis: str | None, treedef: Any,
                    shapes: tuple, stacked: bool) -> list:
    dim = 1 if stacked else 0
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*[None] * dim, axis))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shards = _local_shards(mesh, axis)
    for path, shape in zip(_paths(treedef), shapes, strict=True):
        if len(shape) > dim and shape[dim] % shards:
            raise ValueError(
                f"Batch leaf {path} has shape "
                f"{shape}{f' ({shape[0]} stacked batches)' if stacked else ''}: its "
                f"{'batch' if stacked else 'leading'} dimension {shape[dim]} does not divide "
                f"by the {shards} local devices along mesh axis {axis!r} of process "
                f"{jax.process_index()}. Use a per-process batch size that is a multiple "
                f"of {shards}.")
    return [replicated if len(shape) <= dim else split for shape in shapes]


def _paths(treedef: Any) -> list[str]:
    """The path of each leaf of `treedef`, for messages."""
    dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    return [annotations.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def place(partitioner: Any, batch: Batch, stacked: bool = False) -> Batch:
    """This process's batch as global arrays placed by `batch_shardings` (P processes: a
    global batch P times larger). Leaves already placed so pass through."""
    shardings = batch_shardings(partitioner, batch, stacked)
    if jax.process_count() == 1:
        return jax.device_put(batch, shardings)
    return jax.tree.map(
        lambda x, s: x
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)
        else jax.make_array_from_process_local_data(s, np.asarray(x)), batch, shardings)


@functools.lru_cache(maxsize=64)
def _device_stacker(treedef: Any, shardings: tuple) -> Any:
    """One jitted stack of placed batches per layout and size (not a dispatch per leaf)."""

    def stack_on_devices(batches: list[Batch]) -> Batch:
        return jax.tree.map(lambda *xs: jnp.stack(xs), *batches)

    return jax.jit(stack_on_devices,
                   out_shardings=jax.tree_util.tree_unflatten(treedef, list(shardings)))


def padded(batches: Sequence[Batch], size: int, moved_once: bool = False
           ) -> tuple[Batch, ...]:
    """`batches` and repeats of the last, `size` in all (``padded([b1, b2], 3) == (b1, b2,
    b2)``), so one program serves every count; BatchLayoutError unless of one layout. With
    `moved_once`, a last host batch that repeats is moved to the devices once: the padding
    moves nothing more."""
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
    entries past them repeating the last. `size` host batches are stacked on the host
    (placed with `place_it`); with `place_it` fewer are stacked on the devices, each moved
    there once (the padding is not moved), as placed ones are."""
    if len(batches) == size or not place_it:
        full = padded(batches, size)
        if not any(isinstance(x, jax.Array) for x in jax.tree.leaves(full[0])):
            stacked = jax.tree.map(lambda *xs: np.stack(xs), *full)
            return partitioner.shard_stacked_batch(stacked) if place_it else stacked
    full = padded(batches, size, moved_once=True)
    leaves, treedef = jax.tree_util.tree_flatten(full[0])
    rule = jax.tree.leaves(batch_shardings(partitioner, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((size, *np.shape(x)), x.dtype), full[0]),
        stacked=True))
    return _device_stacker(treedef, tuple(rule))(list(full))


def entry(stacked: Any, index: int) -> Any:
    """Step `index` of an execution's stacked outputs (a static slice: ``x[i]`` would send
    the index to the devices first)."""
    return jax.tree.map(lambda x: jax.lax.index_in_dim(x, index, keepdims=False), stacked)


@jax.jit
def unstack(outputs: Any) -> list[Any]:
    """An execution's stacked outputs as k per-step outputs, split in one dispatch."""
    size = len(jax.tree.leaves(outputs)[0]) if jax.tree.leaves(outputs) else 0
    return [jax.tree.map(lambda x, i=i: x[i], outputs) for i in range(size)]
