"""Batches from specs such as ``[1, 28, 28, 1]``: built as numpy zeros (`zeros_from_spec`)
or described as the partitioner would place them (`abstract_batch`)::

    zeros_from_spec({'image': [2, 8, 8, 1], 'label': ([2], 'int32')})
    abstract_batch(partitioner, {'image': [256, 28, 28, 1], 'label': ([256], 'int32')})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop import types
from jaxloop.sharding import annotations

Batch = types.Batch

_SPEC_HELP = (
    "expected a shape such as [1, 28, 28, 1], a (shape, dtype) pair such as "
    "([1, 28, 28, 1], 'float32'), or a dict/list/tuple of these")


def is_shape(x: Any) -> bool:
    """Whether `x` is a shape alone (``[1, 28, 28, 1]``), which builds float32 zeros."""
    return isinstance(x, list | tuple) and all(
        isinstance(d, int | np.integer) and not isinstance(d, bool) and d >= 0 for d in x)


def zeros_from_spec(spec: types.BatchSpec, path: str = "spec") -> Batch:
    """Builds a zero batch (numpy arrays) from a batch spec."""
    if isinstance(spec, jax.ShapeDtypeStruct | np.ndarray | jax.Array):
        return np.zeros(spec.shape, spec.dtype)
    if is_shape(spec):
        return np.zeros(tuple(int(d) for d in spec), np.float32)
    is_pair = isinstance(spec, list | tuple) and not hasattr(spec, "_fields") and len(spec) == 2
    if is_pair and is_shape(spec[0]) and isinstance(spec[1], str | np.dtype | type):
        try:
            dtype = jnp.dtype(spec[1])
        except TypeError:
            raise ValueError(f"{path}: {spec[1]!r} is not a dtype; {_SPEC_HELP}") from None
        return np.zeros(tuple(int(d) for d in spec[0]), dtype)
    if isinstance(spec, Mapping):
        return {k: zeros_from_spec(v, f"{path}[{k!r}]") for k, v in spec.items()}
    if isinstance(spec, list | tuple) and spec:
        items = [zeros_from_spec(v, f"{path}[{i}]") for i, v in enumerate(spec)]
        return type(spec)(*items) if hasattr(spec, "_fields") else type(spec)(items)
    raise ValueError(f"{path} is {spec!r}: {_SPEC_HELP}")


def abstract_batch(partitioner: Any, spec: types.BatchSpec) -> Batch:
    """The global batch of `spec` as `jax.ShapeDtypeStruct` leaves placed as `shard_batch`
    places batches (ValueError: a leading dimension not divisible by the data shards)."""
    shards = partitioner.num_data_shards
    replicated = jax.sharding.NamedSharding(partitioner.mesh, jax.sharding.PartitionSpec())

    def describe(path: tuple, x: Any) -> jax.ShapeDtypeStruct:
        if x.ndim and x.shape[0] % shards:
            raise ValueError(f"Batch leaf {annotations.path_str(path)} has shape {tuple(x.shape)}: "
                             f"its leading dimension {x.shape[0]} (the global batch) does not "
                             f"divide by the {shards} devices along mesh axis "
                             f"{partitioner.data_axis!r}")
        sharding = partitioner.batch_sharding if x.ndim else replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    # np.zeros reserves pages lazily: a large batch costs no memory.
    return jax.tree_util.tree_map_with_path(describe, zeros_from_spec(spec))
