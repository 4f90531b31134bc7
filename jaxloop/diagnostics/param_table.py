"""Parameter table: what a state holds and where, one row per array leaf (path, shape, dtype,
sharding, bytes on one device, bytes in all), then totals; abstract states work too::

    print(param_table.table(state))          # in a notebook
    rows = param_table.rows(state)           # the figures, one dict per leaf
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any

import jax
import numpy as np

from jaxloop.diagnostics.memory import format_bytes

__all__ = ["Row", "log_table", "markdown", "rows", "table", "totals"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Row:
    """One leaf; ``bytes_per_device`` is that of the device holding the most of it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    sharding: str
    bytes_per_device: int
    bytes: int


def _sharding_text(sharding: Any) -> str:
    if sharding is None:
        return "-"
    if isinstance(sharding, jax.sharding.NamedSharding):
        return "replicated" if not any(sharding.spec) else str(tuple(sharding.spec))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return "single device"
    return type(sharding).__name__


def _itemsize(dtype: Any) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # PRNG keys: their key data
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return math.prod(data.shape) * data.dtype.itemsize
    return np.dtype(dtype).itemsize


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]


def _per_device(leaf: Any) -> dict[Any, int]:
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return {}
    itemsize = _itemsize(leaf.dtype)  # once: a PRNG key's is traced
    return {device: itemsize * math.prod(len(range(*s.indices(n)))
                                         for s, n in zip(index, leaf.shape, strict=True))
            for device, index in sharding.devices_indices_map(tuple(leaf.shape)).items()}


def rows(tree: Any) -> list[Row]:
    """One `Row` per array leaf of `tree` (arrays or `jax.ShapeDtypeStruct`s)."""
    out = []
    for path, leaf in _leaves(tree):
        size = math.prod(leaf.shape) * _itemsize(leaf.dtype)
        out.append(Row(path, tuple(leaf.shape), str(leaf.dtype),
                       _sharding_text(getattr(leaf, "sharding", None)),
                       max(_per_device(leaf).values(), default=size), size))
    return out


def totals(tree: Any) -> dict[str, int]:
    """``params`` (in the ``params`` subtree, else all), ``bytes`` and ``max_bytes_per_device``."""
    params = getattr(tree, "params", None)
    per_device: collections.Counter = collections.Counter()
    for _, leaf in _leaves(tree):
        per_device.update(_per_device(leaf))
    return {
        "params": sum(math.prod(x.shape) for _, x in _leaves(tree if params is None else params)),
        "bytes": int(sum(r.bytes for r in rows(tree))),
        "max_bytes_per_device": int(max(per_device.values(), default=0)),
    }


def _cells(tree: Any) -> tuple[list[list[str]], str]:
    cells = [["path", "shape", "dtype", "sharding", "bytes/device", "bytes"]]
    cells += [[r.path, str(r.shape), r.dtype, r.sharding, format_bytes(r.bytes_per_device, 1),
               format_bytes(r.bytes, 1)] for r in rows(tree)]
    t = totals(tree)
    return cells, (f"{t['params']:,} parameters; {format_bytes(t['bytes'], 1)} in all; "
                   f"at most {format_bytes(t['max_bytes_per_device'], 1)} on one device")


def table(tree: Any) -> str:
    """The table as aligned plain text, totals last."""
    cells, summary = _cells(tree)
    widths = [max(map(len, column)) for column in zip(*cells, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([*lines, summary])


def markdown(tree: Any) -> str:
    """The table in Markdown (for TensorBoard's text tab), totals last."""
    cells, summary = _cells(tree)
    lines = ["| " + " | ".join(r) + " |" for r in cells]
    lines.insert(1, "|" + " --- |" * len(cells[0]))
    return "\n".join([*lines, "", summary])


def log_table(tree: Any, logger: logging.Logger = log) -> None:
    """Logs `table` at DEBUG level on process 0 (built only when that level is logged)."""
    if jax.process_index() == 0 and logger.isEnabledFor(logging.DEBUG):
        logger.debug("State:\n%s", table(tree))
