"""Where batches are read ahead, and whether they are placed there: the one place that
decides it, by the step's devices.

Where a host-to-device copy exists (GPU, TPU) a loop's read-ahead thread
(`read_ahead.Prefetcher`) also places the batches, so the copy overlaps the step; where
device arrays are host memory (CPU) it only reads ahead and the program's jit places each
batch. An `OuterLoop` reads ahead by default only where batches are placed ahead.

Example::

    places_ahead(step)   # False for a step on CPU devices
    default_size(step)   # 0 there, 2 on a GPU or TPU
"""

from __future__ import annotations

from typing import Any

from jaxloop.read_ahead import Prefetcher, prefetch_to_device

__all__ = ["DEFAULT_SIZE", "Prefetcher", "default_size", "places_ahead", "prefetch_to_device"]

# What an `OuterLoop` reads ahead by default where batches are placed ahead (`places_ahead`).
DEFAULT_SIZE = 2


def places_ahead(step: Any) -> bool:
    """Whether a prefetcher places the step's batches on its devices ahead of the step: where
    the step's mesh has a device other than a CPU (a copy to device memory, which the thread
    overlaps with the step). On CPUs a device array is host memory: placing ahead buys
    nothing and takes a core from XLA.

    Example::

        places_ahead(step)  # False for a step on CPU devices
    """
    mesh = getattr(getattr(step, "partitioner", None), "mesh", None)
    devices = mesh.devices.flat if mesh is not None else ()
    return any(d.platform != "cpu" for d in devices)


def default_size(step: Any) -> int:
    """Batches an `OuterLoop` reads ahead unless told: `DEFAULT_SIZE` where they are placed
    ahead (`places_ahead`), else 0 (batches are read in the training thread, as a
    hand-written loop reads them; ask for a read-ahead thread for a slow input pipeline).

    Example::

        OuterLoop(train_loop, prefetch=4)  # an explicit size always wins
    """
    return DEFAULT_SIZE if places_ahead(step) else 0
