"""Replica integrity: every copy of a replicated state leaf holds the same values (a faulty
device or a non-deterministic collective can make them drift apart silently). Each device
fingerprints its slice of every leaf; only leaves whose fingerprints differ are compared value
by value. A collective: every process calls it::

    integrity.check_replicas(state, atol=0.0)            # raises ReplicaMismatchError
    TrainLoop(step, end_actions=[integrity.ReplicaIntegrityAction(interval=10)])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxloop.hooks.action import Action

__all__ = ["ReplicaIntegrityAction", "ReplicaMismatchError", "check_replicas"]


class ReplicaMismatchError(RuntimeError):
    """Copies of a replicated leaf differ (the message names the leaf and devices)."""


def _replicated_axes(sharding: NamedSharding) -> tuple[str, ...]:
    named = set(jax.tree.leaves(tuple(sharding.spec)))  # its entries' axes, tuples flattened
    return tuple(a for a in sharding.mesh.axis_names
                 if a not in named and sharding.mesh.shape[a] > 1)


# Odd weights: any one changed element changes the fingerprint (modulo 2**32).
_GOLDEN = 0x9E3779B1


def _bits(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _gathered(mesh: jax.sharding.Mesh, specs: tuple[P, ...], per_leaf: Any) -> Any:
    """jit of ``per_leaf(i, slice)`` on each device's leaf slices: ``[devices, leaves, ...]``."""

    def per_device(*leaves):
        out = jnp.stack([per_leaf(i, x) for i, x in enumerate(leaves)])
        return jax.lax.all_gather(out, tuple(mesh.axis_names), tiled=False)

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P(),
                                 check_vma=False))


@functools.lru_cache(maxsize=64)  # one compiled fingerprint per layout, not one per call
def _fingerprints(mesh: jax.sharding.Mesh, specs: tuple[P, ...]):
    def fingerprint(_, x):
        bits = _bits(x).ravel()
        weights = (jnp.arange(bits.size, dtype=jnp.uint32) * 2 + 1) * jnp.uint32(_GOLDEN)
        return jnp.sum(bits * weights, dtype=jnp.uint32)

    return _gathered(mesh, specs, fingerprint)


def _differs(prints: np.ndarray, mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> bool:
    """Whether any device's fingerprint differs from its slice's first copy's."""
    first = prints[tuple(slice(0, 1) if a in axes else slice(None) for a in mesh.axis_names)]
    return bool(np.any(prints != first))


@functools.lru_cache(maxsize=64)  # one compiled comparison per layout, not one per call
def _deviation(mesh: jax.sharding.Mesh, specs: tuple[P, ...], axes: Sequence[tuple[str, ...]],
               rtol: float):
    """Per device and leaf: the largest |copy - first copy| and its largest excess over
    ``rtol * |first copy|``."""
    def deviation(i, x):
        x = x.astype(jnp.float32) if x.dtype != jnp.float64 else x
        first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in axes[i]]))
        ref = jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axes[i])
        both_nan = jnp.isnan(x) & jnp.isnan(ref)
        diff = jnp.where(both_nan, 0.0, jnp.abs(x - ref))
        diff = jnp.where(jnp.isnan(diff), jnp.inf, diff)  # NaN on one copy only
        excess = jnp.max(diff - rtol * jnp.abs(jnp.where(both_nan, 0.0, ref)), initial=0.0)
        return jnp.stack([jnp.max(diff, initial=0.0), excess])

    return _gathered(mesh, specs, deviation)


def check_replicas(tree: Any, atol: float = 0.0, rtol: float = 0.0) -> dict[str, float]:
    """Checks that every copy of each replicated leaf of `tree` equals the first copy of its
    slice within ``atol + rtol * |first copy|`` (NaN equals NaN), else raises
    `ReplicaMismatchError`; returns the largest difference per leaf path checked."""
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    by_mesh: dict[Any, list[tuple[str, jax.Array, tuple[str, ...]]]] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if (isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
                and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended)  # PRNG keys
                and (axes := _replicated_axes(leaf.sharding))):
            by_mesh.setdefault(leaf.sharding.mesh, []).append(
                (jax.tree_util.keystr(path, simple=True, separator="/"), leaf, axes))
    found: dict[str, float] = {}
    problems = []
    for mesh, leaves in by_mesh.items():
        names, arrays, axes = zip(*leaves, strict=True)
        specs = tuple(x.sharding.spec for x in arrays)
        prints = np.asarray(jax.device_get(_fingerprints(mesh, specs)(*arrays)))
        prints = prints.reshape(*mesh.devices.shape, len(arrays))
        found.update(dict.fromkeys(names, 0.0))
        differ = [i for i, a in enumerate(axes) if _differs(prints[..., i], mesh, a)]
        if not differ:
            continue
        fn = _deviation(mesh, tuple(specs[i] for i in differ), tuple(axes[i] for i in differ), rtol)
        results = np.asarray(jax.device_get(fn(*[arrays[i] for i in differ])))
        devices = list(mesh.devices.flat)
        for i, table in zip(differ, results.swapaxes(0, 1), strict=True):
            found[names[i]] = float(table[:, 0].max())
            bad = [d for d, (_, excess) in zip(devices, table, strict=True) if excess > atol]
            if bad:
                where = ", ".join(f"{d} (process {d.process_index})" for d in bad)
                problems.append(f"{names[i]}: the copies on {where} differ from the first copy "
                                f"of their slice (replicated over {axes[i]}) by up to "
                                f"{found[names[i]]:.6g} (atol={atol}, rtol={rtol})")
    if problems:
        raise ReplicaMismatchError("Replicated state copies differ:\n  " + "\n  ".join(problems))
    return found


class ReplicaIntegrityAction(Action):
    """Runs `check_replicas` on the loop's state (`ReplicaMismatchError` when copies differ)."""

    def __init__(self, interval: int = 1, atol: float = 0.0, rtol: float = 0.0):
        super().__init__(interval)
        self._atol, self._rtol = atol, rtol

    def __call__(self, state: Any, outputs: Any = None, **kwargs: Any) -> dict[str, float]:
        return check_replicas(state, self._atol, self._rtol)
