"""Where arrays live: partitioners place the state and batches on a mesh and jit the step.

Four strategies share one interface:

- `SingleDevicePartitioner`: everything on one device.
- `DataParallelPartitioner`: state replicated, batch split along the data axis.
- `FSDPPartitioner`: like data parallel, but every large parameter and optimizer-state leaf is
  split along the data axis too, so each device holds about 1/N of the state. With
  `fsdp_axis`, the state is split over that axis only and replicated over the other data
  axes: hybrid sharding (HSDP), e.g. split within a host and replicated across hosts.
- `SPMDPartitioner`: honours flax partitioning annotations (`nn.with_partitioning`, nnx
  sharding metadata, and logical names through `logical_axis_rules`) for tensor/model
  parallelism on a multi-axis mesh, optionally with FSDP on top (`fsdp_min_weight_size`).

`data_axis` is one mesh axis or a tuple of them: the batch is split over their product, in
the tuple's order (``('replica', 'fsdp')`` gives rows ``[r*F + f]`` to coordinate ``(r, f)``).

A partitioner is a pure policy: where a new state goes follows from its shapes and
annotations, and an existing state stays where its arrays are (`state_shardings`), so a
restore through another partitioner instance lands where the target state's arrays are.

Example::

    mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    partitioner = partition.DataParallelPartitioner(mesh=mesh, data_axis='data')
    step = MyStep(jax.random.key(0), model, partitioner=partitioner, train=True)

Only the partitioner decides placement: steps ask it, loops never touch sharding.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax.core import spmd as core_spmd
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxloop import annotations, staging
from jaxloop import program as program_lib

PyTree = Any
Axes = str | tuple[str, ...]

# An activation's constraint by logical names, strict as a parameter's annotation is read.
with_logical_constraint = annotations.with_logical_constraint


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
        raise ValueError(
            f"{name} {axes!r}: {', '.join(map(repr, unknown))} is not an axis of the mesh "
            f"{dict(mesh.shape)}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{name} {axes!r} names an axis twice")
    if not names:
        return None
    return names[0] if len(names) == 1 else names


def axes_size(mesh: Mesh, axes: str | Sequence[str] | None) -> int:
    """The number of devices along `axes` (one mesh axis or several; 1 for None).

    Example::

        axes_size(mesh, ('replica', 'fsdp'))  # mesh.shape['replica'] * mesh.shape['fsdp']
    """
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in names], dtype=np.int64))


class Partitioner(abc.ABC):
    """Decides where the training state and batches live, and jits step functions.

    Subclasses implement `state_specs`, which maps an abstract state to partition specs.
    Everything else (placing the initial state, splitting batches across processes and
    devices, jitting with state shardings pinned) is shared.
    """

    def __init__(self, mesh: Mesh, data_axis: str | Sequence[str] | None):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        data_axis = _checked_axes(mesh, data_axis, "data_axis")
        self._mesh = mesh
        self._data_axis = data_axis
        self._batch_sharding = NamedSharding(mesh, P(data_axis))
        self._replicated = NamedSharding(mesh, P())
        # The shardings of the last state `shard_init_fn` created: only reported by
        # `sharding`, never read to place anything (placement is a pure function of the
        # state's arrays and the model's annotations).
        self._last_state_shardings: PyTree = None

    @property
    def mesh(self) -> Mesh:
        """The device mesh arrays are placed on."""
        return self._mesh

    @property
    def data_axis(self) -> Axes | None:
        """The mesh axis the batch is split along, or the tuple of axes it is split over
        (a one-axis tuple given to the constructor reads as that axis's name)."""
        return self._data_axis

    @property
    def num_data_shards(self) -> int:
        """How many pieces a global batch is split into: the devices along the data axes."""
        return axes_size(self._mesh, self._data_axis)

    @property
    def batch_sharding(self) -> NamedSharding:
        """The sharding of batch leaves: leading dimension split along the data axis."""
        return self._batch_sharding

    @property
    def sharding(self) -> PyTree:
        """The state's sharding, as in the Jaxloop reference.

        Data parallel (and single device): the replicated ``NamedSharding(mesh, P())``
        every state leaf has. FSDP and SPMD place each leaf by its shape and annotations,
        so there it is the tree of shardings of the state last created through
        `shard_init_fn` (`Step.initialize_model` / `Step.abstract_state`), None before.
        It is a report only: placement never reads it. For the batch's sharding see
        `batch_sharding`.
        """
        return self._last_state_shardings

    @abc.abstractmethod
    def state_specs(self, abstract_state: PyTree) -> PyTree:
        """Returns a PartitionSpec for each leaf of the (unboxed) state.

        Args:
          abstract_state: the state as `jax.ShapeDtypeStruct` leaves; it may still hold flax
            `AxisMetadata` boxes (linen `nn.Partitioned`) carrying sharding annotations.
        """

    def state_shardings(self, state: PyTree) -> PyTree:
        """The `NamedSharding` of each state leaf under this partitioner's rule.

        Decided leaf by leaf: a leaf already placed on this mesh's devices (an array, or a
        `jax.ShapeDtypeStruct` with a sharding) keeps its sharding; any other leaf (a Python
        scalar such as flax's ``TrainState.create`` step, a numpy array, an array on other
        devices) gets the rule (`state_specs`). Used to pin a step's state and to place a
        state restored from a checkpoint exactly where training expects it.

        Example::

            params = jax.device_put(params, NamedSharding(mesh, P(None, 'model')))
            state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
            partitioner.state_shardings(state).params  # P(None, 'model'); .step: the rule's
        """
        # Placement is a property of the arrays, so the same state gets the same shardings
        # whichever partitioner instance asks (a restore lands where the target's arrays are).
        devices = set(self._mesh.devices.flat)
        rule = jax.tree.map(lambda s: NamedSharding(self._mesh, s), self.state_specs(state))

        def keep_or_rule(leaf: Any, ruled: NamedSharding) -> jax.sharding.Sharding:
            placed = getattr(leaf, "sharding", None)
            if isinstance(placed, jax.sharding.Sharding) and placed.device_set == devices:
                return placed
            return ruled

        return jax.tree.map(keep_or_rule, annotations.unboxed(state), rule)

    def placement(self, state: PyTree) -> PyTree:
        """The `NamedSharding` of each leaf where this partitioner runs an existing state: its
        rule (`state_specs`) for the state's shapes, on its own mesh, whatever the state's
        current placement. `EvalLoop` moves a state there once per evaluation when it lives
        elsewhere (training on another mesh or with another partitioner).

        Example::

            evaluated = jax.device_put(state, eval_partitioner.placement(state))
        """
        specs = self.state_specs(annotations.unboxed(state))
        return jax.tree.map(lambda s: NamedSharding(self._mesh, s), specs)

    def _mesh_context(self) -> contextlib.AbstractContextManager:
        """The context state creation runs in; SPMD needs its mesh there (see there)."""
        return contextlib.nullcontext()

    def trace_context(self) -> contextlib.AbstractContextManager:
        """The context a partitioned function is traced in: this partitioner's mesh (as an
        abstract mesh), so ``jax.lax.with_sharding_constraint(x, P('data'))`` works in a
        step's `run`."""
        return jax.sharding.use_abstract_mesh(self._mesh.abstract_mesh)

    def abstract_init_fn(self, init_fn: Callable[..., PyTree]) -> Callable[..., PyTree]:
        """Like `shard_init_fn`, but the state is only described, never built: its leaves
        are `jax.ShapeDtypeStruct`s with the shapes, dtypes and shardings `shard_init_fn`
        would give them (`jax.eval_shape`; no device memory is used).

        Example::

            abstract = partitioner.abstract_init_fn(create_state)(example_batch)
        """

        def abstract_init(*args: Any, **kwargs: Any) -> PyTree:
            with self._mesh_context():
                abstract = jax.eval_shape(init_fn, *args, **kwargs)
                shardings = self._shardings_of_new(abstract)
            return jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                annotations.unboxed(abstract), shardings,
            )

        return abstract_init

    def _shardings_of_new(self, abstract: PyTree) -> PyTree:
        specs = self.state_specs(abstract)
        shardings = jax.tree.map(lambda s: NamedSharding(self._mesh, s), specs)
        self._last_state_shardings = shardings
        return shardings

    def shard_init_fn(self, init_fn: Callable[..., PyTree]) -> Callable[..., PyTree]:
        """Wraps a state-creating function so its result is born in place on the mesh.

        The returned function traces `init_fn` abstractly to learn the state's shapes and
        annotations, then runs it under `jax.jit` with the output shardings this partitioner
        chooses, so no device ever holds the full state unless the strategy says so. flax
        `AxisMetadata` boxes in the result are unboxed.

        Example::

            state = partitioner.shard_init_fn(create_state)(example_batch)
        """

        def sharded_init(*args: Any, **kwargs: Any) -> PyTree:
            with self._mesh_context():
                abstract = jax.eval_shape(init_fn, *args, **kwargs)
                shardings = self._shardings_of_new(abstract)
                fn = jax.jit(lambda *a, **k: annotations.unboxed(init_fn(*a, **k)),
                             out_shardings=shardings)
                return fn(*args, **kwargs)

        return sharded_init

    def batch_shardings(self, batch: PyTree, stacked: bool = False) -> PyTree:
        """The sharding of each leaf of a process-local batch (`staging.batch_shardings`)."""
        return staging.batch_shardings(self, batch, stacked)

    def shard_batch(self, batch: PyTree) -> PyTree:
        """Turns this process's local batch into global arrays split along the data axis
        (`batch_shardings`); with P processes the global batch is P times larger. Leaves
        already placed so pass through untouched.

        This is the one place a step's batch is placed (`Step.shard_batch` calls it), so a
        subclass or a patched method (``SPMDPartitioner.shard_batch = my_fn``, as google's
        notebooks do) decides how batches land.

        Example::

            sharded = partitioner.shard_batch({'x': np.ones((32, 784)), 'y': np.zeros(32)})
        """
        return staging.place(self, batch)

    def shard_stacked_batch(self, batch: PyTree) -> PyTree:
        """Like `shard_batch` for k batches stacked on a new leading axis (``np.stack``):
        ``stacked[i]`` is placed as `shard_batch` places batch i."""
        return staging.place(self, batch, stacked=True)

    def partition(self, fn: Callable[..., Any], **jit_kwargs: Any) -> program_lib.Program:
        """Jits `fn(state, batch, ...)` as one `jax.jit` pinned to the state's shardings
        (`jaxloop.program.Program`); `jit_kwargs` go to `jax.jit`.

        Example::

            train_fn = partitioner.partition(step_fn, donate_argnums=(0,))
            state, outputs = train_fn(state, partitioner.shard_batch(batch))
        """
        return program_lib.Program(fn, self, returns_state=None, **jit_kwargs)



class DataParallelPartitioner(Partitioner):
    """Replicates the state on every device and splits the batch along `data_axis` (one
    mesh axis or a tuple of them).

    Example::

        mesh = Mesh(mesh_utils.create_device_mesh((jax.device_count(),)), ('data',))
        partitioner = DataParallelPartitioner(mesh=mesh, data_axis='data')
    """

    def __init__(self, mesh: Mesh, data_axis: str | Sequence[str] = "data"):
        super().__init__(mesh, data_axis)

    @property
    def sharding(self) -> NamedSharding:
        """The state's sharding: replicated, ``NamedSharding(mesh, P())``."""
        return self._replicated

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        return jax.tree.map(lambda _: P(), annotations.unboxed(abstract_state))


class SingleDevicePartitioner(DataParallelPartitioner):
    """Puts everything on one device (the first local one unless given)."""

    def __init__(self, device: jax.Device | None = None):
        device = device if device is not None else jax.local_devices()[0]
        super().__init__(Mesh(np.array([device]), ("data",)), "data")


class FSDPPartitioner(Partitioner):
    """Fully sharded data parallel: large state leaves are split along the data axis.

    Every parameter, optimizer-state and batch-stats leaf with at least `min_weight_size`
    elements is split on the largest of its dimensions that divides by the size of
    `fsdp_axis` (by default the data axes); smaller leaves (biases, scalars, counters) are
    replicated. The batch is split as in data parallel, and XLA inserts the all-gathers and
    reduce-scatters, so results match data parallel while each device holds about 1/N of
    the state (N the devices along `fsdp_axis`).

    Hybrid sharding (HSDP): with ``data_axis=('replica', 'fsdp')`` and ``fsdp_axis='fsdp'``
    the batch is split over both axes, the state only over 'fsdp' and replicated over
    'replica'. Lay 'fsdp' out within a host (`jaxloop.meshes.make_mesh` does) and the
    parameter all-gathers stay on the host's fast links; only the gradient all-reduce
    crosses hosts.

    Example::

        partitioner = FSDPPartitioner(mesh=mesh, data_axis='data', min_weight_size=2**12)

        mesh = meshes.make_mesh({'replica': -1, 'fsdp': jax.local_device_count()})
        hsdp = FSDPPartitioner(mesh, data_axis=('replica', 'fsdp'), fsdp_axis='fsdp')
    """

    def __init__(self, mesh: Mesh, data_axis: str | Sequence[str] = "data",
                 min_weight_size: int = 2**12, fsdp_axis: str | Sequence[str] | None = None):
        super().__init__(mesh, data_axis)
        if min_weight_size < 0:
            raise ValueError(f"min_weight_size must be >= 0, got {min_weight_size}")
        self._min_weight_size = min_weight_size
        fsdp_axis = _checked_axes(mesh, fsdp_axis, "fsdp_axis")
        self._fsdp_axis = self._data_axis if fsdp_axis is None else fsdp_axis

    @property
    def min_weight_size(self) -> int:
        return self._min_weight_size

    @property
    def fsdp_axis(self) -> Axes | None:
        """The mesh axis (or axes) large state leaves are split over."""
        return self._fsdp_axis

    def leaf_spec(self, shape: tuple[int, ...]) -> P:
        """The spec of one state leaf of this shape: split on its largest divisible dim."""
        return annotations.spec(annotations.fsdp_axes(
            shape, [None] * len(shape), self._fsdp_axis,
            axes_size(self._mesh, self._fsdp_axis), self._min_weight_size))

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        return jax.tree.map(lambda x: self.leaf_spec(np.shape(x)),
                            annotations.unboxed(abstract_state))


class SPMDPartitioner(Partitioner):
    """Places each state leaf as its flax partitioning annotation says.

    Annotations name mesh axes (`nn.with_partitioning`, nnx sharding metadata) or logical
    axes, resolved through `logical_axis_rules` as flax's `nn.logical_to_mesh_sharding`
    does (`jaxloop.annotations`); a logical name without a rule is a ValueError that lists
    it and the rules. Optimizer-state leaves shaped like their parameter inherit its
    annotation (optax maps over the boxed parameters); other leaves (adafactor's factored
    moments, counts, unannotated leaves) are replicated.

    With `fsdp_min_weight_size`, FSDP runs on top: a leaf of at least that many elements
    whose annotation leaves the FSDP axes unused is also split along `fsdp_axis` (default
    `data_axis`) on its largest unannotated dimension that divides, so on a
    ``('data', 'model')`` mesh each device holds about 1/(data x model) of every big leaf.
    MaxText's usual mesh, data x fsdp x tensor, is ``data_axis=('data', 'fsdp')``,
    ``fsdp_axis='fsdp'`` and rules that map model dimensions to 'tensor'. `run` is traced
    under the mesh and the rules, so `jax.lax.with_sharding_constraint` and
    `partition.with_logical_constraint` work inside it; the latter raises on a logical name
    without a rule, as a parameter's annotation does, where flax's
    `nn.with_logical_constraint` leaves that dimension replicated without a word.

    Example::

        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('data', 'model'))
        partitioner = SPMDPartitioner(
            mesh, data_axis='data',
            logical_axis_rules=[('batch', 'data'), ('embed', None), ('mlp', 'model')],
            fsdp_min_weight_size=2**12)
        # in the model: nn.Dense(1024, kernel_init=nn.with_logical_partitioning(
        #     init, ('embed', 'mlp')))
    """

    def __init__(
        self,
        mesh: Mesh,
        data_axis: str | Sequence[str] | None = "data",
        logical_axis_rules: Sequence[tuple[str, Any]] | None = None,
        fsdp_min_weight_size: int | None = None,
        fsdp_axis: str | Sequence[str] | None = None,
    ):
        super().__init__(mesh, data_axis)
        rules = annotations.checked_rules(logical_axis_rules, mesh)
        if fsdp_min_weight_size is not None and fsdp_min_weight_size < 0:
            raise ValueError(f"fsdp_min_weight_size must be >= 0, got {fsdp_min_weight_size}")
        self._rules = rules
        self._fsdp_min_weight_size = fsdp_min_weight_size
        fsdp_axis = _checked_axes(mesh, fsdp_axis, "fsdp_axis")
        self._fsdp_axis = self._data_axis if fsdp_axis is None else fsdp_axis

    @property
    def logical_axis_rules(self) -> tuple[tuple[str, Any], ...]:
        return self._rules

    def _mesh_context(self) -> contextlib.AbstractContextManager:
        # nnx builds annotated variables eagerly and needs the mesh (and the rules for
        # logical names) in context; linen applies logical constraints through the rules.
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self._mesh))
        if self._rules:  # else keep any rules the user set with nn.logical_axis_rules
            stack.enter_context(core_spmd.logical_axis_rules(self._rules))
        return stack

    def trace_context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(super().trace_context())
        if self._rules:
            stack.enter_context(core_spmd.logical_axis_rules(self._rules))
        return stack

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        def spec(path: tuple, x: Any) -> P:
            axes = annotations.leaf_axes(x, path, self._mesh, self._rules)
            if self._fsdp_min_weight_size is not None and self._fsdp_axis is not None:
                shape = np.shape(x.value if annotations.is_box(x) else x)
                axes = annotations.fsdp_axes(shape, axes, self._fsdp_axis,
                                             axes_size(self._mesh, self._fsdp_axis),
                                             self._fsdp_min_weight_size)
            return annotations.spec(axes)

        return jax.tree_util.tree_map_with_path(spec, abstract_state, is_leaf=annotations.is_box)

    def placement(self, state: PyTree) -> PyTree:
        """Like `Partitioner.placement`, but a state already on this mesh stays as it is:
        the annotations that placed it were read when it was created and are not in its
        arrays. A state from another mesh is placed by its shapes (replicated, or FSDP with
        `fsdp_min_weight_size`)."""
        leaves = jax.tree.leaves(state)
        if leaves and all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
                          and x.sharding.mesh == self._mesh for x in leaves):
            return jax.tree.map(lambda x: x.sharding, state)
        return super().placement(state)
