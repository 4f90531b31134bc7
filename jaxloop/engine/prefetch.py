"""Where batches are read ahead, and whether placed there, decided by the step's devices:
off CPUs the read-ahead thread also places them (the copy overlaps the step); on CPUs
placing ahead buys nothing and an `OuterLoop` reads in the training thread by default.
"""

from __future__ import annotations

from typing import Any

from jaxloop.data.read_ahead import Prefetcher, prefetch_to_device

__all__ = ["DEFAULT_SIZE", "Prefetcher", "default_size", "places_ahead", "prefetch_to_device"]

# What an `OuterLoop` reads ahead by default where batches are placed ahead.
DEFAULT_SIZE = 2


def places_ahead(step: Any) -> bool:
    """Whether a prefetcher places the step's batches ahead: where its mesh has a device
    other than a CPU (on CPUs a device array is host memory)."""
    mesh = getattr(getattr(step, "partitioner", None), "mesh", None)
    devices = mesh.devices.flat if mesh is not None else ()
    return any(d.platform != "cpu" for d in devices)


def default_size(step: Any) -> int:
    """Batches an `OuterLoop` reads ahead unless told: `DEFAULT_SIZE` where they are placed
    ahead, else 0; an explicit ``OuterLoop(..., prefetch=4)`` wins (for a slow pipeline)."""
    return DEFAULT_SIZE if places_ahead(step) else 0
