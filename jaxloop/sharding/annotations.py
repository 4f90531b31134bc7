"""Flax partitioning annotations (linen's, or nnx's as `jaxloop.state.model` boxes them) read
as mesh axes, logical names resolved as `nn.logical_to_mesh_axes` does (`leaf_axes`), and
FSDP's split of a leaf (`fsdp_axes`)::

    box = nn.LogicallyPartitioned(jnp.zeros((64, 256)), ('embed', 'mlp'))
    leaf_axes(box, (), mesh, rules=(('embed', None), ('mlp', 'model')))  # [None, 'model']
    spec([None, 'model'])                                                 # P(None, 'model')
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax.core import meta
from flax.core import spmd as core_spmd
from flax.linen import spmd as flax_spmd
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

Rules = tuple[tuple[str, Any], ...]
LogicalNames = tuple[str | None, ...]


def path_str(path: tuple) -> str:
    """A tree path as jax prints it (``['dense']['kernel']``), ``<root>`` for the root."""
    return jax.tree_util.keystr(path) or "<root>"


def is_box(x: Any) -> bool:
    """Whether `x` is a flax annotation box (`flax.core.meta.AxisMetadata`)."""
    return isinstance(x, meta.AxisMetadata)


def unboxed(tree: Any) -> Any:
    """The values inside flax annotation boxes, without `meta.unbox`'s sharding constraint
    (it needs the annotation's axes in the mesh; the jit's out_shardings place them)."""
    return jax.tree.map(lambda x: x.value if is_box(x) else x, tree, is_leaf=is_box)


def spec(axes: Sequence[Any]) -> P:
    """The spec of these per-dimension axes without trailing Nones (replicated: ``P()``)."""
    axes = list(axes)
    while axes and axes[-1] is None:
        axes.pop()
    return P(*axes)


def checked_rules(rules: Sequence[tuple[str, Any]] | None, mesh: Mesh) -> Rules:
    """`rules` as a tuple, each target a mesh axis (or None); else a ValueError naming it."""
    rules = tuple((str(k), v) for k, v in (rules or ()))
    for name, axes in rules:
        unknown = [a for a in jax.tree.leaves(axes) if a not in mesh.axis_names]
        if unknown:
            raise ValueError(
                f"logical_axis_rules map {name!r} to {unknown}, which the mesh "
                f"{dict(mesh.shape)} does not have")
    return rules


def _resolve(box: Any, path: tuple, mesh: Mesh, rules: Rules) -> tuple:
    """Mesh axes for each dimension named by an annotation box."""
    names = tuple(box.names)
    logical = isinstance(box, flax_spmd.LogicallyPartitioned)
    rules = rules or tuple(getattr(box, "rules", None) or ()) or tuple(
        core_spmd.get_logical_axis_rules() or ())
    rule_names = {k for k, _ in rules}
    strs = [n for n in names if isinstance(n, str)]
    known = rule_names if logical else rule_names | set(mesh.axis_names)
    unknown = [n for n in strs if n not in known]
    if unknown:
        raise ValueError(
            f"State leaf {path_str(path)}: partitioning annotation {names} names "
            f"{unknown}, which "
            f"{'have no logical axis rule' if logical else 'are neither mesh axes nor rules'}. "
            f"Mesh axes: {list(mesh.axis_names)}; logical_axis_rules: {list(rules)}")
    if not any(n in rule_names for n in strs):
        return names
    # Names that are mesh axes without a rule are kept as they are.
    kept = [isinstance(n, str) and n not in rule_names for n in names]
    resolved = flax_spmd.logical_to_mesh_axes(
        [None if k else n for n, k in zip(names, kept, strict=True)], rules)
    return tuple(n if k else r for n, k, r in zip(names, kept, resolved, strict=True))


def leaf_axes(x: Any, path: tuple, mesh: Mesh, rules: Rules = ()) -> list:
    """The mesh axis (or None) of each dimension of a state leaf, from its annotation box;
    all None without one or when not shaped like it (optax's factored moments). A name
    that is neither a mesh axis nor a rule is a ValueError."""
    shape = np.shape(x.value if is_box(x) else x)
    axes: list = [None] * len(shape)
    if isinstance(x, meta.Partitioned):
        resolved = _resolve(x, path, mesh, rules)
        if len(resolved) == len(shape):
            axes = list(resolved)
        for a in jax.tree.leaves(axes):
            if a not in mesh.axis_names:
                raise ValueError(
                    f"State leaf {path_str(path)}: partitioning annotation "
                    f"{tuple(x.names)} resolves to mesh axis {a!r}, which the mesh "
                    f"{dict(mesh.shape)} does not have")
    return axes


def fsdp_axes(shape: tuple[int, ...], axes: Sequence[Any], axis: str | tuple[str, ...],
              n: int, min_size: int) -> list:
    """FSDP: `axes` with `axis` (a mesh axis or tuple, `n` devices) on the largest free
    dimension that divides by `n`, for a leaf of at least `min_size` elements not yet using it.

    Example::

        fsdp_axes((784, 256), [None, None], 'data', 8, 4096)  # ['data', None]
        fsdp_axes((784, 256), [None, 'model'], ('replica', 'fsdp'), 8, 4096)
        # [('replica', 'fsdp'), 'model']
    """
    axes = list(axes)
    used = set(jax.tree.leaves(axes)) & set(jax.tree.leaves(axis))
    if n == 1 or used or int(np.prod(shape, dtype=np.int64)) < min_size:
        return axes
    free = [d for d, size in enumerate(shape) if axes[d] is None and size % n == 0]
    if free:
        axes[max(free, key=lambda d: (shape[d], -d))] = axis
    return axes


def _is_names(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and all(
        n is None or isinstance(n, str) or n is P.UNCONSTRAINED for n in x))


def with_logical_constraint(x: Any, names: Any, rules: Sequence[tuple[str, Any]] | None = None,
                            mesh: Mesh | None = None) -> Any:
    """flax's `nn.with_logical_constraint`, but a name without a rule raises (flax leaves
    that dimension replicated silently). `rules` default to those in force (a
    `SPMDPartitioner`'s while its step is traced); with none it does nothing, as flax's.

    Example::

        # in a linen module's __call__, run by a step under SPMDPartitioner(
        #     mesh, logical_axis_rules=[('batch', 'data'), ('mlp', 'model')])
        h = partition.with_logical_constraint(h, ('batch', 'mlp'))
    """
    active = tuple(rules) if rules is not None else tuple(
        core_spmd.get_logical_axis_rules() or ())
    if not active or names is None:
        return x
    rule_names = {k for k, _ in active}
    for leaf in jax.tree.leaves(names, is_leaf=_is_names):
        if not _is_names(leaf):
            raise TypeError(f"with_logical_constraint: {leaf!r} is not a tuple of logical "
                            "axis names (str or None)")
        unknown = [n for n in leaf or () if isinstance(n, str) and n not in rule_names]
        if unknown:
            raise ValueError(
                f"with_logical_constraint on an activation: {tuple(leaf)} names {unknown}, "
                f"which have no logical axis rule. logical_axis_rules: {list(active)}. Add a "
                "rule (a name mapped to None keeps that dimension replicated).")
    return flax_spmd.with_logical_constraint(
        x, names, rules=active, mesh=mesh, fallback=flax_spmd.RulesFallback.RAISE_ERROR)
