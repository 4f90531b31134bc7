"""Data layer: any dataset as an iterator (`as_iterator`), global batches that do not depend
on the process count (`GlobalBatchDataset`), exact eval (`pad_to_global_batches`) and device
prefetch, as ``data.<name>``::

    ds = data.GlobalBatchDataset(data.ArraySource({'x': x, 'y': y}), global_batch_size=64)
    it = data.as_iterator(ds)
    batch = next(it)
    data.iterator_state(it)  # {'next_batch': 1, ...}
"""

import importlib
from typing import TYPE_CHECKING, Any

# Each name is imported from its submodule on first use (PEP 562): the loops load no grain.
_NAMES = {
    "ArraySource": "sources.ArraySource",
    "GlobalBatchDataset": "global_batches.GlobalBatchDataset",
    "GlobalBatchIterator": "global_batch_iterator.GlobalBatchIterator",
    "as_iterator": "iterators.as_iterator",
    "batch_rows": "global_batches.batch_rows",
    "describe_iterator": "iterators.describe_iterator",
    "iterator_state": "iterators.iterator_state",
    "Prefetcher": "read_ahead.Prefetcher",
    "pad_to_global_batches": "padding.pad_to_global_batches",
    "prefetch_to_device": "read_ahead.prefetch_to_device",
    "restore_iterator_state": "iterators.restore_iterator_state",
}
__all__ = [
    "ArraySource", "GlobalBatchDataset", "GlobalBatchIterator", "Prefetcher", "as_iterator",
    "batch_rows", "describe_iterator", "iterator_state", "pad_to_global_batches",
    "prefetch_to_device", "restore_iterator_state",
]

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports
    from jaxloop.data.global_batch_iterator import GlobalBatchIterator
    from jaxloop.data.global_batches import GlobalBatchDataset, batch_rows
    from jaxloop.data.iterators import (
        as_iterator,
        describe_iterator,
        iterator_state,
        restore_iterator_state,
    )
    from jaxloop.data.padding import pad_to_global_batches
    from jaxloop.data.read_ahead import Prefetcher, prefetch_to_device
    from jaxloop.data.sources import ArraySource


def __getattr__(name: str) -> Any:
    """Imports an exported name from its submodule when first used."""
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _NAMES[name].split(".")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES})
