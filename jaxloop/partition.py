"""Partitioners: where the state and batches live on a mesh, and the jit of a step.

`SingleDevicePartitioner`, `DataParallelPartitioner` (state replicated), `FSDPPartitioner`
(large leaves split over the data axes, or over `fsdp_axis` only: HSDP) and `SPMDPartitioner`
(flax annotations, optionally with FSDP on top). A partitioner is a pure policy: the same
state gets the same placement from any instance; steps ask it, loops never touch sharding::

    mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    step = MyStep(key, model, partitioner=partition.DataParallelPartitioner(mesh), train=True)
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxloop import types
from jaxloop.engine import program as program_lib
from jaxloop.sharding import annotations, batches

Batch = types.Batch
TrainState = types.TrainState
PyTree = Any
Axes = str | tuple[str, ...]

# An activation's constraint by logical names, strict as a parameter's annotation is read.
with_logical_constraint = annotations.with_logical_constraint


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _dense_general_without_mesh(call: Callable[..., Any], args: Any, kwargs: Any,
                                context: Any) -> Any:
    """Runs a flax ``nn.DenseGeneral`` call with no mesh: each call re-creates its kernel
    abstractly at a 2-D shape its annotation does not fit, which fails under a mesh
    (google/flax#3676). Its parameters arrive placed by the step's input shardings."""
    no_mesh = isinstance(context.module, nn.DenseGeneral)
    with jax.sharding.use_abstract_mesh(_NO_MESH) if no_mesh else contextlib.nullcontext():
        return call(*args, **kwargs)


def _checked_axes(mesh: Mesh, axes: str | Sequence[str] | None, name: str) -> Axes | None:
    """`axes` as one axis name (a 1-tuple too) or a tuple of distinct names of the mesh."""
    if axes is None or isinstance(axes, str):
        names = () if axes is None else (axes,)
    elif isinstance(axes, Sequence) and axes and all(isinstance(a, str) for a in axes):
        names = tuple(axes)
    else:
        raise TypeError(f"{name} must be a mesh axis name or a tuple of them, got {axes!r}")
    unknown = [a for a in names if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"{name} {axes!r}: {', '.join(map(repr, unknown))} is not an axis of the "
                         f"mesh {dict(mesh.shape)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{name} {axes!r} names an axis twice")
    return names[0] if len(names) == 1 else names or None


def axes_size(mesh: Mesh, axes: str | Sequence[str] | None) -> int:
    """The number of devices along `axes` (one mesh axis or several; 1 for None)."""
    names = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in names)


class Partitioner(abc.ABC):
    """Where the state and batches live, and the jit of steps; subclasses define `state_specs`."""

    def __init__(self, mesh: Mesh, data_axis: str | Sequence[str] | None = "data"):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        self._mesh = mesh
        self._data_axis = _checked_axes(mesh, data_axis, "data_axis")
        self._last_state_shardings: PyTree = None

    @property
    def mesh(self) -> Mesh:
        """The device mesh arrays are placed on."""
        return self._mesh

    @property
    def data_axis(self) -> Axes | None:
        """The mesh axis (or tuple of axes) the batch is split over."""
        return self._data_axis

    @property
    def num_data_shards(self) -> int:
        """How many pieces a global batch is split into: the devices along the data axes."""
        return axes_size(self._mesh, self._data_axis)

    @property
    def batch_sharding(self) -> NamedSharding:
        """The sharding of batch leaves: leading dimension split along the data axis."""
        return NamedSharding(self._mesh, P(self._data_axis))

    @property
    def sharding(self) -> PyTree:
        """A report (placement never reads it): the shardings `shard_init_fn` last made."""
        return self._last_state_shardings

    @abc.abstractmethod
    def state_specs(self, abstract_state: PyTree) -> PyTree:
        """A PartitionSpec per state leaf (abstract leaves, maybe in flax `AxisMetadata` boxes)."""

    def state_shardings(self, state: PyTree) -> PyTree:
        """The `NamedSharding` of each state leaf: a leaf already on this mesh's devices keeps
        its sharding, any other gets the rule (`state_specs`)."""
        devices = set(self._mesh.devices.flat)
        rule = jax.tree.map(lambda s: NamedSharding(self._mesh, s), self.state_specs(state))

        def keep_or_rule(leaf: Any, ruled: NamedSharding) -> jax.sharding.Sharding:
            placed = getattr(leaf, "sharding", None)
            keep = isinstance(placed, jax.sharding.Sharding) and placed.device_set == devices
            return placed if keep else ruled

        return jax.tree.map(keep_or_rule, annotations.unboxed(state), rule)

    def placement(self, state: PyTree) -> PyTree:
        """The rule's `NamedSharding` of each leaf on this mesh, wherever the state is now::

            evaluated = jax.device_put(state, eval_partitioner.placement(state))
        """
        specs = self.state_specs(annotations.unboxed(state))
        return jax.tree.map(lambda s: NamedSharding(self._mesh, s), specs)

    def _axis_rules(self) -> contextlib.AbstractContextManager:
        """The logical axis rules in force while state is created or a step traces."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _mesh_context(self) -> Iterator[None]:
        """No mesh, even the user's, while state is created: flax would constrain parameters
        made at another rank than their annotation's (DenseGeneral, Einsum, scan) and nnx
        would place each as made. The jitted init's out_shardings place the state instead."""
        with jax.set_mesh(None), nnx.use_eager_sharding(False), self._axis_rules():
            yield

    @contextlib.contextmanager
    def trace_context(self) -> Iterator[None]:
        """This mesh, abstract, while a step traces: ``with_sharding_constraint(x, P('data'))``
        works in `run` (flax's DenseGeneral runs without it)."""
        with (jax.sharding.use_abstract_mesh(self._mesh.abstract_mesh),
              nn.intercept_methods(_dense_general_without_mesh), self._axis_rules()):
            yield

    def abstract_init_fn(self, init_fn: Callable[..., PyTree]) -> Callable[..., PyTree]:
        """`shard_init_fn`, but abstract: ShapeDtypeStructs carrying the same shardings."""

        def abstract_init(*args: Any, **kwargs: Any) -> PyTree:
            with self._mesh_context():
                abstract, shardings = self._new_state(init_fn, args, kwargs)
            return jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                annotations.unboxed(abstract), shardings)

        return abstract_init

    def _new_state(self, init_fn: Callable[..., PyTree], args: tuple, kwargs: dict
                   ) -> tuple[PyTree, PyTree]:
        """The abstract state `init_fn` makes and the rule's shardings of it."""
        abstract = jax.eval_shape(init_fn, *args, **kwargs)
        self._last_state_shardings = jax.tree.map(
            lambda s: NamedSharding(self._mesh, s), self.state_specs(abstract))
        return abstract, self._last_state_shardings

    def shard_init_fn(self, init_fn: Callable[..., PyTree]) -> Callable[..., PyTree]:
        """Wraps a state-creating function so its result is born in place (jitted with this
        partitioner's output shardings: no device holds more than its share)::

            state = partitioner.shard_init_fn(create_state)(example_batch)
        """

        def sharded_init(*args: Any, **kwargs: Any) -> PyTree:
            with self._mesh_context():
                _, shardings = self._new_state(init_fn, args, kwargs)
                fn = jax.jit(lambda *a, **k: annotations.unboxed(init_fn(*a, **k)),
                             out_shardings=shardings)
                return fn(*args, **kwargs)

        return sharded_init

    def batch_shardings(self, batch: PyTree, stacked: bool = False) -> PyTree:
        """The sharding of each leaf of a process-local batch (`sharding.batches`)."""
        return batches.batch_shardings(self, batch, stacked)

    def shard_batch(self, batch: PyTree) -> PyTree:
        """This process's batch as global arrays split along the data axis (placed leaves pass
        through); the one place a step's batch is placed, so a subclass may change it."""
        return batches.place(self, batch)

    def shard_stacked_batch(self, batch: PyTree) -> PyTree:
        """`shard_batch` for k batches stacked on a new leading axis."""
        return batches.place(self, batch, stacked=True)

    def partition(self, fn: Callable[..., Any], **jit_kwargs: Any) -> Callable[..., Any]:
        """Jits `fn(state, batch, ...)` pinned to the state's shardings (with `in_shardings`
        given, plain ``jax.jit(fn, **jit_kwargs)``). Every step's program is made here, so an
        override wraps, logs or changes the jit of every step::

            class Logged(partition.DataParallelPartitioner):
                def partition(self, fn, **jit_kwargs):
                    print('jitting', fn.__name__)
                    return super().partition(fn, **jit_kwargs)
        """
        if "in_shardings" in jit_kwargs:
            return jax.jit(fn, **jit_kwargs)
        return program_lib.Program(fn, self, returns_state=None, **jit_kwargs)


class DataParallelPartitioner(Partitioner):
    """Replicates the state on every device and splits the batch along `data_axis`."""

    @property
    def sharding(self) -> NamedSharding:
        """The state's sharding: replicated, ``NamedSharding(mesh, P())``."""
        return NamedSharding(self._mesh, P())

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        return jax.tree.map(lambda _: P(), annotations.unboxed(abstract_state))


class SingleDevicePartitioner(DataParallelPartitioner):
    """Puts everything on one device (the first local one unless given)."""

    def __init__(self, device: jax.Device | None = None):
        super().__init__(Mesh(np.array([device or jax.local_devices()[0]]), ("data",)))


class FSDPPartitioner(Partitioner):
    """Fully sharded data parallel: each state leaf of at least `min_weight_size` elements
    is split on its largest dimension divisible by the size of `fsdp_axis` (default the
    data axes). With ``fsdp_axis`` a data axis within a host (HSDP), all-gathers stay there::

        mesh = meshes.make_mesh({'replica': -1, 'fsdp': jax.local_device_count()})
        hsdp = FSDPPartitioner(mesh, data_axis=('replica', 'fsdp'), fsdp_axis='fsdp')
    """

    def __init__(self, mesh: Mesh, data_axis: str | Sequence[str] = "data",
                 min_weight_size: int = 2**12, fsdp_axis: str | Sequence[str] | None = None):
        super().__init__(mesh, data_axis)
        if min_weight_size < 0:
            raise ValueError(f"min_weight_size must be >= 0, got {min_weight_size}")
        self.min_weight_size = min_weight_size
        self.fsdp_axis = _checked_axes(mesh, fsdp_axis, "fsdp_axis") or self._data_axis

    def leaf_spec(self, shape: tuple[int, ...]) -> P:
        """The spec of one state leaf of this shape: split on its largest divisible dim."""
        return annotations.spec(annotations.fsdp_axes(
            shape, [None] * len(shape), self.fsdp_axis,
            axes_size(self._mesh, self.fsdp_axis), self.min_weight_size))

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        return jax.tree.map(lambda x: self.leaf_spec(np.shape(x)),
                            annotations.unboxed(abstract_state))


class SPMDPartitioner(Partitioner):
    """Places each state leaf as its flax annotation says (mesh axes, or logical names through
    `logical_axis_rules`); optimizer leaves shaped like their parameter inherit its annotation.
    With `fsdp_min_weight_size`, FSDP runs on top over `fsdp_axis` where the annotation leaves
    it unused. `run` traces under the mesh and rules (`with_logical_constraint` works)::

        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('data', 'model'))
        partitioner = SPMDPartitioner(
            mesh, data_axis='data',
            logical_axis_rules=[('batch', 'data'), ('embed', None), ('mlp', 'model')],
            fsdp_min_weight_size=2**12)
    """

    def __init__(self, mesh: Mesh, data_axis: str | Sequence[str] | None = "data",
                 logical_axis_rules: Sequence[tuple[str, Any]] | None = None,
                 fsdp_min_weight_size: int | None = None,
                 fsdp_axis: str | Sequence[str] | None = None):
        super().__init__(mesh, data_axis)
        self.logical_axis_rules = annotations.checked_rules(logical_axis_rules, mesh)
        if fsdp_min_weight_size is not None and fsdp_min_weight_size < 0:
            raise ValueError(f"fsdp_min_weight_size must be >= 0, got {fsdp_min_weight_size}")
        self._fsdp_min_weight_size = fsdp_min_weight_size
        self.fsdp_axis = _checked_axes(mesh, fsdp_axis, "fsdp_axis") or self._data_axis

    def _axis_rules(self) -> contextlib.AbstractContextManager:
        if not self.logical_axis_rules:  # keep any rules the user set with nn.logical_axis_rules
            return super()._axis_rules()
        return core_spmd.logical_axis_rules(self.logical_axis_rules)

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        def spec(path: tuple, x: Any) -> P:
            axes = annotations.leaf_axes(x, path, self._mesh, self.logical_axis_rules)
            if self._fsdp_min_weight_size is not None and self.fsdp_axis is not None:
                shape = np.shape(x.value if annotations.is_box(x) else x)
                axes = annotations.fsdp_axes(shape, axes, self.fsdp_axis,
                                             axes_size(self._mesh, self.fsdp_axis),
                                             self._fsdp_min_weight_size)
            return annotations.spec(axes)

        return jax.tree_util.tree_map_with_path(spec, abstract_state, is_leaf=annotations.is_box)

    def placement(self, state: PyTree) -> PyTree:
        """`Partitioner.placement`, but a state already on this mesh stays where it is."""
        leaves = jax.tree.leaves(state)
        if leaves and all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
                          and x.sharding.mesh == self._mesh for x in leaves):
            return jax.tree.map(lambda x: x.sharding, state)
        return super().placement(state)
