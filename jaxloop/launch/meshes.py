"""Device meshes from per-axis sizes, laid out so the last axes stay inside a host.

`make_mesh` takes ``{axis: size}`` in order (one size may be -1: the rest) and devices in
process order, so trailing axes run within a host (fast links)::

    mesh = meshes.make_mesh({'replica': -1, 'fsdp': jax.local_device_count()})
    partitioner = partition.FSDPPartitioner(mesh, data_axis=('replica', 'fsdp'),
                                            fsdp_axis='fsdp')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

__all__ = ["axis_sizes", "make_mesh"]


def axis_sizes(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """`sizes` with a -1 replaced by what makes the product `num_devices` (ValueError for
    other sizes below 1, several -1s or a wrong product)::

        axis_sizes({'replica': -1, 'fsdp': 4}, 8)  # {'replica': 2, 'fsdp': 4}
    """
    sizes = dict(sizes)
    if not sizes:
        raise ValueError("make_mesh needs at least one axis, e.g. {'data': -1}")
    bad = {k: v for k, v in sizes.items()
           if isinstance(v, bool) or not isinstance(v, int | np.integer) or (v < 1 and v != -1)}
    if bad:
        raise ValueError(f"Mesh axis sizes must be positive integers or -1, got {bad}")
    rest = [k for k, v in sizes.items() if v == -1]
    if len(rest) > 1:
        raise ValueError(f"Only one mesh axis may be -1 (the rest), got {rest} in {sizes}")
    known = int(np.prod([v for v in sizes.values() if v != -1], dtype=np.int64))
    if rest:
        if num_devices % known:
            raise ValueError(f"Mesh axis sizes {sizes}: the {num_devices} devices do not divide by "
                             f"{known}, so axis {rest[0]!r} cannot take the rest")
        sizes[rest[0]] = num_devices // known
    elif known != num_devices:
        raise ValueError(f"Mesh axis sizes {sizes} multiply to {known}, not the {num_devices} "
                         "devices; give one axis -1 to take the rest")
    return {k: int(v) for k, v in sizes.items()}


def make_mesh(sizes: Mapping[str, int],
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with these axes (one size may be -1) over `devices` (default all) in process
    order, so trailing axes lie within a host when their product divides its devices."""
    devices = list(jax.devices() if devices is None else devices)
    shape = axis_sizes(sizes, len(devices))
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(ordered, dtype=object).reshape(tuple(shape.values())),
                tuple(shape))
