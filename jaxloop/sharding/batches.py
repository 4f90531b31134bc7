"""Where a batch's leaves live on the mesh: split along the partitioner's data axis on their
leading dimension (`batch_shardings`), and a process's batch placed so (`place`). A
`Partitioner`'s ``batch_shardings`` and ``shard_batch`` are these."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jaxloop.sharding import annotations

Batch = Any


@functools.cache
def _local_shards(mesh: jax.sharding.Mesh, axis: str | tuple[str, ...] | None) -> int:
    """The distinct coordinates along `axis` (one or several) of this process's devices."""
    index = [mesh.axis_names.index(a) for a in ((axis,) if isinstance(axis, str) else axis or ())]
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
    for i, shape in enumerate(shapes):
        if len(shape) > dim and shape[dim] % shards:
            dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
            path = jax.tree_util.tree_flatten_with_path(dummy)[0][i][0]
            raise ValueError(
                f"Batch leaf {annotations.path_str(path)} has shape "
                f"{shape}{f' ({shape[0]} stacked batches)' if stacked else ''}: its "
                f"{'batch' if stacked else 'leading'} dimension {shape[dim]} does not divide "
                f"by the {shards} local devices along mesh axis {axis!r} of process "
                f"{jax.process_index()}. Use a per-process batch size that is a multiple "
                f"of {shards}.")
    return [replicated if len(shape) <= dim else split for shape in shapes]


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
