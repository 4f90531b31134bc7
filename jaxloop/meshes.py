"""Device meshes from per-axis sizes, laid out so the last axes stay inside a host.

`make_mesh` builds a `jax.sharding.Mesh` from ``{axis: size}`` in order, with one size
allowed to be -1 ("the rest of the devices"). Devices are taken in process order (all of
process 0's, then process 1's, ...), so the leading axes run across processes (slow links)
and the trailing axes within one (fast links): in ``{'replica': -1, 'fsdp': 4}`` on 2 hosts
of 4 devices, each 'fsdp' group is one host's devices and FSDP's all-gathers never leave it.

The usual meshes (see docs/multihost.md for the partitioner that goes with each):

- data parallel: ``make_mesh({'data': -1})``
- FSDP: ``make_mesh({'fsdp': -1})``
- HSDP: ``make_mesh({'replica': -1, 'fsdp': jax.local_device_count()})``
- FSDP x tensor parallel: ``make_mesh({'data': -1, 'fsdp': 2, 'tensor': 2})``

Example::

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
    """`sizes` with a -1 replaced by what makes the product `num_devices`.

    Example::

        axis_sizes({'replica': -1, 'fsdp': 4}, 8)  # {'replica': 2, 'fsdp': 4}

    Raises:
      ValueError: a size that is 0 or below -1, more than one -1, or sizes whose product is
        not `num_devices` (the message names the sizes and the device count).
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
            raise ValueError(
                f"Mesh axis sizes {sizes}: the {num_devices} devices do not divide by {known}, "
                f"so axis {rest[0]!r} cannot take the rest"
            )
        sizes[rest[0]] = num_devices // known
    elif known != num_devices:
        raise ValueError(
            f"Mesh axis sizes {sizes} multiply to {known}, not the {num_devices} devices; "
            "give one axis -1 to take the rest"
        )
    return {k: int(v) for k, v in sizes.items()}


def make_mesh(sizes: Mapping[str, int],
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with these axes, in order, over `devices` (default all of them) taken in
    process order, so the trailing axes lie within a host when their product divides the
    devices per host.

    Args:
      sizes: axis name to size, in mesh order; one size may be -1 for the rest.
      devices: the devices to lay out (default ``jax.devices()``).

    Example::

        mesh = make_mesh({'data': -1, 'fsdp': 2, 'tensor': 2})  # 8 devices: 2 x 2 x 2

    Raises:
      ValueError: see `axis_sizes`.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = axis_sizes(sizes, len(devices))
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(ordered, dtype=object).reshape(tuple(shape.values())),
                tuple(shape))
