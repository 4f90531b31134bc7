"""Data layer: any dataset as an iterator (`as_iterator`), global batches that do not depend
on the process count (`GlobalBatchDataset`), exact eval (`pad_to_global_batches`) and device
prefetch, as ``data.<name>``::

    ds = data.GlobalBatchDataset(data.ArraySource({'x': x, 'y': y}), global_batch_size=64)
    it = data.as_iterator(ds)
    batch = next(it)
    data.iterator_state(it)  # {'next_batch': 1, ...}
"""

import importlib
from typing import Any

# The one list of exported names, each by its submodule, imported from it on first use
# (PEP 562): the loops load no grain.
_NAMES = {name: module for module, names in (
    ("global_batch_iterator", ("GlobalBatchIterator",)),
    ("global_batches", ("GlobalBatchDataset", "batch_rows")),
    ("iterators", ("as_iterator", "describe_iterator", "iterator_state",
                   "restore_iterator_state")),
    ("padding", ("pad_to_global_batches",)),
    ("read_ahead", ("Prefetcher", "prefetch_to_device")),
    ("sources", ("ArraySource",)),
) for name in names}
__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    """Imports an exported name from its submodule when first used."""
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES})
