"""Where arrays live: partitioners place the state and batches on a mesh and jit the step.

Four strategies share one interface:

- `SingleDevicePartitioner`: everything on one device.
- `DataParallelPartitioner`: state replicated, batch split along the data axis.
- `FSDPPartitioner`: like data parallel, but every large parameter and optimizer-state leaf is
  split along the data axis too, so each device holds about 1/N of the state.
- `SPMDPartitioner`: honours flax partitioning annotations (`nn.with_partitioning`, nnx
  sharding metadata) for tensor/model parallelism on a multi-axis mesh.

Example::

    mesh = jax.sharding.Mesh(jax.devices(), ('data',))
    partitioner = partition.DataParallelPartitioner(mesh=mesh, data_axis='data')
    step = MyStep(jax.random.key(0), model, partitioner=partitioner, train=True)

Only the partitioner decides placement: steps ask it, loops never touch sharding.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax.core import meta
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any


def _path_str(path: tuple) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.AxisMetadata)


class Partitioner(abc.ABC):
    """Decides where the training state and batches live, and jits step functions.

    Subclasses implement `state_specs`, which maps an abstract state to partition specs.
    Everything else (placing the initial state, splitting batches across processes and
    devices, jitting with state shardings pinned) is shared.
    """

    def __init__(self, mesh: Mesh, data_axis: str | None):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if data_axis is not None and data_axis not in mesh.axis_names:
            raise ValueError(
                f"data_axis {data_axis!r} is not an axis of the mesh {dict(mesh.shape)}"
            )
        self._mesh = mesh
        self._data_axis = data_axis
        self._batch_sharding = NamedSharding(mesh, P(data_axis))
        self._replicated = NamedSharding(mesh, P())
        self._local_data_shards = self._count_local_data_shards()
        # Shardings chosen for states this partitioner created, so a jitted step can pin its
        # output state to exactly the placement of its input state (keeps donation aliasing).
        self._known_state_shardings: dict[Any, PyTree] = {}

    def _count_local_data_shards(self) -> int:
        if self._data_axis is None:
            return 1
        axis = self._mesh.axis_names.index(self._data_axis)
        local = {d.id for d in self._mesh.local_devices}
        coords = {
            idx[axis] for idx, d in np.ndenumerate(self._mesh.devices) if d.id in local
        }
        return len(coords)

    @property
    def mesh(self) -> Mesh:
        """The device mesh arrays are placed on."""
        return self._mesh

    @property
    def data_axis(self) -> str | None:
        """The mesh axis the batch is split along."""
        return self._data_axis

    @property
    def sharding(self) -> NamedSharding:
        """The sharding of batch leaves: leading dimension split along the data axis."""
        return self._batch_sharding

    @abc.abstractmethod
    def state_specs(self, abstract_state: PyTree) -> PyTree:
        """Returns a PartitionSpec for each leaf of the (unboxed) state.

        Args:
          abstract_state: the state as `jax.ShapeDtypeStruct` leaves; it may still hold flax
            `AxisMetadata` boxes (linen `nn.Partitioned`) carrying sharding annotations.
        """

    def state_shardings(self, state: PyTree) -> PyTree:
        """The `NamedSharding` of each state leaf under this partitioner's rule.

        Works on concrete or abstract states (anything with `.shape`); used to place a state
        restored from a checkpoint exactly where training expects it.
        """
        known = self._known_state_shardings.get(jax.tree.structure(meta.unbox(state)))
        if known is not None:
            return known
        specs = self.state_specs(state)
        return jax.tree.map(lambda s: NamedSharding(self._mesh, s), specs)

    def _mesh_context(self) -> contextlib.AbstractContextManager:
        # nnx builds annotated variables eagerly and needs the mesh in context.
        return jax.set_mesh(self._mesh)

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
                specs = self.state_specs(abstract)
                shardings = jax.tree.map(lambda s: NamedSharding(self._mesh, s), specs)
                self._known_state_shardings[jax.tree.structure(shardings)] = shardings
                fn = jax.jit(lambda *a, **k: meta.unbox(init_fn(*a, **k)), out_shardings=shardings)
                return fn(*args, **kwargs)

        return sharded_init

    def _check_batch_leaf(self, path: tuple, x: Any) -> None:
        shape = np.shape(x)
        if not shape:
            return
        if shape[0] % self._local_data_shards:
            raise ValueError(
                f"Batch leaf {_path_str(path)} has shape {tuple(shape)}: its leading dimension "
                f"{shape[0]} does not divide by the {self._local_data_shards} local devices "
                f"along mesh axis {self._data_axis!r} of process {jax.process_index()}. Use a "
                f"per-process batch size that is a multiple of {self._local_data_shards}."
            )

    def shard_batch(self, batch: PyTree) -> PyTree:
        """Turns this process's local batch into global arrays split along the data axis.

        Each leaf's leading dimension is this process's share of the global batch; with P
        processes the global leading dimension is P times larger. 0-d leaves are replicated.
        Leaves already placed with the batch sharding pass through untouched, so a
        prefetcher may shard ahead of time.

        Raises:
          ValueError: a leaf's leading dimension does not divide by the local device count
            along the data axis (the message names the leaf path and shape).
        """
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(batch)
        for path, x in leaves_with_path:
            self._check_batch_leaf(path, x)
        leaves = [x for _, x in leaves_with_path]
        shardings = [
            self._batch_sharding if np.ndim(x) else self._replicated for x in leaves
        ]
        if jax.process_count() == 1:
            out = jax.device_put(leaves, shardings)
        else:
            out = [
                x
                if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, np.ndim(x))
                else jax.make_array_from_process_local_data(s, np.asarray(x))
                for x, s in zip(leaves, shardings, strict=True)
            ]
        return jax.tree.unflatten(treedef, out)

    def partition(self, fn: Callable[..., tuple[PyTree, Any]], **jit_kwargs: Any) -> Callable:
        """Jits `fn(state, batch, ...) -> (state, outputs)` for this placement.

        The output state is pinned to the input state's shardings (so donated buffers are
        reused in place and FSDP state stays split); outputs follow XLA's propagation, which
        keeps per-example outputs split like the batch. `jit_kwargs` go to `jax.jit`; an
        unknown one raises TypeError here, not at the first call.

        Example::

            train_fn = partitioner.partition(step_fn, donate_argnums=(0,))
            state, outputs = train_fn(state, partitioner.shard_batch(batch))
        """
        return _PartitionedFn(self, fn, jit_kwargs)


class _PartitionedFn:
    """A step function jitted once, with the output state's shardings taken from the input."""

    def __init__(self, partitioner: Partitioner, fn: Callable, jit_kwargs: dict[str, Any]):
        self._partitioner = partitioner
        self._fn = fn
        self._state_shardings: PyTree = None
        self._jitted = jax.jit(self._constrained, **jit_kwargs)

    def _constrained(self, state: PyTree, *args: Any, **kwargs: Any) -> tuple[PyTree, Any]:
        new_state, outputs = self._fn(state, *args, **kwargs)
        if self._state_shardings is not None and jax.tree.structure(
            new_state
        ) == jax.tree.structure(self._state_shardings):
            new_state = jax.lax.with_sharding_constraint(new_state, self._state_shardings)
        return new_state, outputs

    def _input_shardings(self, state: PyTree) -> PyTree:
        leaves = jax.tree.leaves(state)
        if leaves and all(isinstance(x, jax.Array) for x in leaves):
            return jax.tree.map(lambda x: x.sharding, state)
        return self._partitioner.state_shardings(state)

    def __call__(self, state: PyTree, *args: Any, **kwargs: Any) -> tuple[PyTree, Any]:
        if self._state_shardings is None and state is not None:
            self._state_shardings = self._input_shardings(state)
        return self._jitted(state, *args, **kwargs)

    def lower(self, state: PyTree, *args: Any, **kwargs: Any) -> Any:
        """Lowers the jitted function for these arguments (for cost analysis)."""
        if self._state_shardings is None and state is not None:
            self._state_shardings = self._input_shardings(state)
        return self._jitted.lower(state, *args, **kwargs)


class DataParallelPartitioner(Partitioner):
    """Replicates the state on every device and splits the batch along `data_axis`.

    Example::

        mesh = Mesh(mesh_utils.create_device_mesh((jax.device_count(),)), ('data',))
        partitioner = DataParallelPartitioner(mesh=mesh, data_axis='data')
    """

    def __init__(self, mesh: Mesh, data_axis: str = "data"):
        super().__init__(mesh, data_axis)

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        return jax.tree.map(lambda _: P(), meta.unbox(abstract_state))


class SingleDevicePartitioner(DataParallelPartitioner):
    """Puts everything on one device (the first local one unless given)."""

    def __init__(self, device: jax.Device | None = None):
        device = device if device is not None else jax.local_devices()[0]
        super().__init__(Mesh(np.array([device]), ("data",)), "data")


class FSDPPartitioner(Partitioner):
    """Fully sharded data parallel: large state leaves are split along the data axis.

    Every parameter, optimizer-state and batch-stats leaf with at least `min_weight_size`
    elements is split on the largest of its dimensions that divides by the data-axis size;
    smaller leaves (biases, scalars, counters) are replicated. The batch is split as in data
    parallel, and XLA inserts the all-gathers and reduce-scatters, so results match data
    parallel while each device holds about 1/N of the state.

    Example::

        partitioner = FSDPPartitioner(mesh=mesh, data_axis='data', min_weight_size=2**12)
    """

    def __init__(self, mesh: Mesh, data_axis: str = "data", min_weight_size: int = 2**12):
        super().__init__(mesh, data_axis)
        if min_weight_size < 0:
            raise ValueError(f"min_weight_size must be >= 0, got {min_weight_size}")
        self._min_weight_size = min_weight_size

    @property
    def min_weight_size(self) -> int:
        return self._min_weight_size

    def leaf_spec(self, shape: tuple[int, ...]) -> P:
        """The spec of one state leaf of this shape: split on its largest divisible dim."""
        n = self._mesh.shape[self._data_axis]
        if n == 1 or int(np.prod(shape, dtype=np.int64)) < self._min_weight_size:
            return P()
        candidates = [d for d, size in enumerate(shape) if size % n == 0]
        if not candidates:
            return P()
        dim = max(candidates, key=lambda d: (shape[d], -d))
        return P(*[self._data_axis if d == dim else None for d in range(len(shape))])

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        return jax.tree.map(lambda x: self.leaf_spec(tuple(x.shape)), meta.unbox(abstract_state))


class SPMDPartitioner(Partitioner):
    """Places each state leaf as its flax partitioning annotation says.

    Parameters created with `nn.with_partitioning(init, ('data', 'model'))` (linen) or nnx
    variables with sharding metadata are split along those mesh axes; optimizer-state leaves
    built from them inherit the annotation (optax maps over the boxed parameters); leaves
    without an annotation are replicated. The batch is split along `data_axis`.

    Example::

        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('data', 'model'))
        partitioner = SPMDPartitioner(mesh=mesh, data_axis='data')
        # in the model: nn.Dense(1024, kernel_init=nn.with_partitioning(init, (None, 'model')))
    """

    def __init__(self, mesh: Mesh, data_axis: str = "data"):
        super().__init__(mesh, data_axis)

    def state_specs(self, abstract_state: PyTree) -> PyTree:
        def spec(x: Any) -> P:
            if isinstance(x, meta.Partitioned):
                names = tuple(x.names)
                unknown = [n for n in names if n is not None and n not in self._mesh.axis_names]
                if unknown:
                    raise ValueError(
                        f"Partitioning annotation {names} names axes {unknown} that the mesh "
                        f"{dict(self._mesh.shape)} does not have"
                    )
                return P(*names)
            return P()

        return jax.tree.map(spec, abstract_state, is_leaf=_is_box)
