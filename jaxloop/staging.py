"""Batches made ready for a step's compiled program: placed, built from specs, stacked, split.

- `batch_shardings` / `place`: a process-local batch split along the partitioner's data axis
  (what `Partitioner.shard_batch` does, and the shardings a program's jit places a host
  batch to in its own dispatch).
- `stack`: up to k batches of one layout stacked on a new leading axis of k for an execution
  of fused steps, the entries past the real ones repeating the last.
- `unstack`: an execution's stacked outputs as one output per step.

Example::

    stacked = staging.stack(batches[:5], 16, partitioner)  # 5 real of 16
    state, outputs = program(state, stacked, 5)
    per_step = staging.unstack(outputs)[:5]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop import annotations, types

Batch = types.Batch



@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """A batch already preprocessed and made ready for the step's program
    (`Step.prepare_batch`), as a prefetcher hands them to the step, which then skips both."""

    batch: Batch


class BatchLayoutError(ValueError):
    """Batches meant for one execution differ in tree structure or leaf shapes."""


def batch_layout(batch: Batch | PreparedBatch) -> tuple:
    """The tree structure and leaf shapes of a batch: batches of one layout can be stacked.

    Example::

        batch_layout({'x': np.ones((8, 2))}) == batch_layout({'x': np.zeros((8, 2))})  # True
    """
    if isinstance(batch, PreparedBatch):
        batch = batch.batch
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return treedef, tuple(map(np.shape, leaves))


@functools.cache
def _local_shards(mesh: jax.sharding.Mesh, axis: str | tuple[str, ...] | None) -> int:
    """The distinct coordinates along `axis` (one mesh axis or several) of this process's
    devices."""
    if axis is None:
        return 1
    index = [mesh.axis_names.index(a) for a in ((axis,) if isinstance(axis, str) else axis)]
    local = {d.id for d in mesh.local_devices}
    return len({tuple(idx[i] for i in index)
                for idx, d in np.ndenumerate(mesh.devices) if d.id in local})


def batch_shardings(partitioner: Any, batch: Batch, stacked: bool = False) -> Any:
    """The sharding of each leaf of a process-local batch, checked against the mesh.

    Leaves are split along the data axis on their leading dimension (with `stacked`, on
    their second: ``stacked[i]`` is placed as batch i); leaves without it are replicated.
    Computed once per batch layout (tree structure and leaf shapes).

    Raises:
      ValueError: a leaf's batch dimension does not divide by this process's devices along
        the data axis (the message names the leaf path and shape).
    """
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    shardings = _leaf_shardings(partitioner.mesh, partitioner.data_axis, treedef, shapes,
                                stacked)
    return jax.tree_util.tree_unflatten(treedef, shardings)


@functools.lru_cache(maxsize=256)
def _leaf_shardings(mesh: jax.sharding.Mesh, axis: str | None, treedef: Any,
                    shapes: tuple, stacked: bool) -> list:
    dim = 1 if stacked else 0
    split = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(*[None] * dim, axis))
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
                f"of {shards}."
            )
    return [replicated if len(shape) <= dim else split for shape in shapes]


def _paths(treedef: Any) -> list[str]:
    """The path of each leaf of `treedef`, as messages name them."""
    dummy = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    return [annotations.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def place(partitioner: Any, batch: Batch, stacked: bool = False) -> Batch:
    """This process's batch as global arrays placed by `batch_shardings`: with P processes
    the global batch is P times larger. Leaves already placed so pass through.

    Example::

        placed = place(partitioner, {'x': np.ones((32, 784))})
    """
    shardings = batch_shardings(partitioner, batch, stacked)
    if jax.process_count() == 1:
        return jax.device_put(batch, shardings)
    return jax.tree.map(
        lambda x, s: x
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)
        else jax.make_array_from_process_local_data(s, np.asarray(x)),
        batch, shardings,
    )


@functools.lru_cache(maxsize=64)
def _device_stacker(treedef: Any, shardings: tuple) -> Any:
    """One jitted stack of placed batches (compiled once per layout and size): eager
    stacking would dispatch once per batch and leaf."""

    def stack_on_devices(batches: list[Batch]) -> Batch:
        return jax.tree.map(lambda *xs: jnp.stack(xs), *batches)

    return jax.jit(stack_on_devices,
                   out_shardings=jax.tree_util.tree_unflatten(treedef, list(shardings)))


def padded(batches: Sequence[Batch], size: int) -> tuple[Batch, ...]:
    """`batches` (of one layout) and repeats of the last, `size` in all: an execution's
    program always takes `size` batches and is told how many are real, so one program
    serves every count.

    Raises:
      BatchLayoutError: the batches differ in tree structure or leaf shapes.

    Example::

        padded([b1, b2, b3], 4)  # (b1, b2, b3, b3)
    """
    if not 0 < len(batches) <= size:
        raise ValueError(f"an execution takes 1 to {size} batches, got {len(batches)}")
    layouts = {batch_layout(b) for b in batches}
    if len(layouts) > 1:
        raise BatchLayoutError(
            f"Batches run in one execution must share one layout (tree structure and "
            f"leaf shapes); got {len(layouts)} layouts: {sorted(map(str, layouts))}"
        )
    return (*batches, *[batches[-1]] * (size - len(batches)))


def stack(batches: Sequence[Batch], size: int, partitioner: Any, place_it: bool = False
          ) -> Batch:
    """Stacks `batches` (preprocessed, of one layout) on a new leading axis of `size`.

    Entries past ``len(batches)`` repeat the last (`padded`). Host batches are stacked on
    the host and left for the program's jit to place, or placed here with `place_it`
    (`Partitioner.shard_stacked_batch`: global arrays with several processes); batches
    already placed are stacked on the devices.

    Raises:
      BatchLayoutError: the batches differ in tree structure or leaf shapes.

    Example::

        stacked = stack([b1, b2, b3], 4, partitioner)  # leading axis 4, 3 real
    """
    full = padded(batches, size)
    leaves, treedef = jax.tree_util.tree_flatten(full[0])
    if not any(isinstance(x, jax.Array) for x in leaves):
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *full)
        return partitioner.shard_stacked_batch(stacked) if place_it else stacked
    rule = jax.tree.leaves(batch_shardings(partitioner, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((size, *np.shape(x)), x.dtype), full[0]),
        stacked=True))
    return _device_stacker(treedef, tuple(rule))(list(full))


@jax.jit
def unstack(outputs: Any) -> list[Any]:
    """An execution's stacked outputs (leading axis k) as k per-step outputs, split on the
    devices in one dispatch.

    Example::

        per_step = unstack({'loss': jnp.arange(4.0)})  # [{'loss': 0.0}, ..., {'loss': 3.0}]
    """
    size = len(jax.tree.leaves(outputs)[0]) if jax.tree.leaves(outputs) else 0
    return [jax.tree.map(lambda x, i=i: x[i], outputs) for i in range(size)]
