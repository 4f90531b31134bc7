"""Step: what happens to one batch. Users subclass it and override `run`.

`Step.__call__` runs ``preprocess_batch -> shard -> begin actions -> begin -> jitted run -> end
-> end actions``. `run` is compiled once through the partitioner and reused. `Step.call_steps`
runs several batches in one compiled call (a `jax.lax.scan` of `run`), which is what a loop
with ``steps_per_execution > 1`` does.

Example::

    class MnistStep(step_lib.Step):
        def run(self, state, batch):
            def loss_fn(params):
                logits = state.apply_fn({'params': params}, batch['image'])
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, batch['label']).mean()
            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), {'loss': loss}

    step = MnistStep(jax.random.key(0), CNN(), optimizer=optax.adam(1e-3), train=True)
    state = step.initialize_model([1, 28, 28, 1])
    state, outputs = step(state, batch)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxloop import memory as memory_lib
from jaxloop import model as model_lib
from jaxloop import partition as partition_lib
from jaxloop import precision as precision_lib
from jaxloop import types

Batch = types.Batch
Output = types.Output
State = types.TrainState

log = logging.getLogger(__name__)

# Evaluation steps need no optimizer; one shared identity keeps the default immutable.
_IDENTITY = optax.identity()

_SPEC_HELP = (
    "expected a shape such as [1, 28, 28, 1], a (shape, dtype) pair such as "
    "([1, 28, 28, 1], 'float32'), or a dict/list/tuple of these"
)


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
    """A batch already preprocessed (and placed on the devices) by `Step.prepare_batch`.

    A device prefetcher hands these to the step, which then skips both stages.
    `Step.prepare_batches` makes one of several batches stacked on a new leading axis, with
    `num_steps` set to their number (None for a single batch). `on_host` marks a
    preprocessed batch left on the host because the step's compiled call places it itself
    (one process on CPU devices, where placing ahead saves nothing).
    """

    batch: Batch
    num_steps: int | None = None
    on_host: bool = False


class BatchLayoutError(ValueError):
    """Batches meant for one execution differ in tree structure or leaf shapes."""


def action_fires(action: Any, per_loop_step_number: int, begin: bool) -> bool:
    """Whether a step-level action runs at this step (before it when `begin`, else after).

    An action fires every `interval` steps, or where its optional method
    ``fires_at(per_loop_step_number, begin)`` says (for actions tied to one step range,
    such as `profiling.ProfileAction`).

    Example::

        action_fires(SummaryAction(writer, interval=10), 20, begin=False)  # True
    """
    fires_at = getattr(action, "fires_at", None)
    if fires_at is not None:
        return bool(fires_at(per_loop_step_number, begin))
    return per_loop_step_number % action.interval == 0


def batch_layout(batch: Batch | PreparedBatch) -> tuple:
    """The tree structure and leaf shapes of a batch: batches of one layout can be stacked.

    Example::

        batch_layout({'x': np.ones((8, 2))}) == batch_layout({'x': np.zeros((8, 2))})  # True
    """
    if isinstance(batch, PreparedBatch):
        batch = batch.batch
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return treedef, tuple(map(np.shape, leaves))


def _index(tree: Any, i: int) -> Any:
    return jax.tree.map(lambda x: x[i], tree)


@jax.jit
def _stack_on_device(batches: list[Batch]) -> Batch:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *batches)


def _is_shape(x: Any) -> bool:
    return isinstance(x, list | tuple) and all(
        isinstance(d, int | np.integer) and not isinstance(d, bool) and d >= 0 for d in x
    )


def _as_dtype(x: Any) -> np.dtype | None:
    if isinstance(x, str | np.dtype | type):
        try:
            return jnp.dtype(x)
        except TypeError:
            return None
    return None


def zeros_from_spec(spec: types.BatchSpec, path: str = "spec") -> Batch:
    """Builds a zero batch (numpy arrays) from a batch spec.

    Example::

        zeros_from_spec({'image': [2, 8, 8, 1], 'label': ([2], 'int32')})
    """
    if isinstance(spec, jax.ShapeDtypeStruct | np.ndarray | jax.Array):
        return np.zeros(spec.shape, spec.dtype)
    if _is_shape(spec):
        return np.zeros(tuple(int(d) for d in spec), np.float32)
    is_pair = isinstance(spec, list | tuple) and not hasattr(spec, "_fields") and len(spec) == 2
    if is_pair and _is_shape(spec[0]) and isinstance(spec[1], str | np.dtype | type):
        dtype = _as_dtype(spec[1])
        if dtype is None:
            raise ValueError(f"{path}: {spec[1]!r} is not a dtype; {_SPEC_HELP}")
        return np.zeros(tuple(int(d) for d in spec[0]), dtype)
    if isinstance(spec, Mapping):
        return {k: zeros_from_spec(v, f"{path}[{k!r}]") for k, v in spec.items()}
    if isinstance(spec, list | tuple) and spec:
        items = [zeros_from_spec(v, f"{path}[{i}]") for i, v in enumerate(spec)]
        return type(spec)(*items) if hasattr(spec, "_fields") else type(spec)(items)
    raise ValueError(f"{path} is {spec!r}: {_SPEC_HELP}")


def is_abstract(state: Any) -> bool:
    """Whether `state` only describes arrays (`jax.ShapeDtypeStruct` leaves, as from
    `Step.abstract_state`) instead of holding them."""
    leaves = jax.tree.leaves(state)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


class Step:
    """One batch of training or evaluation. Subclass and override `run`.

    Args:
      base_prng: a PRNG key (or a dict of named keys) from which per-step keys are derived
        with `prng_key(step)`; also seeds model initialisation.
      model: a flax linen module instance, or a flax nnx module class (built with
        `nnx_model_args` and `nnx_model_kwargs`), or an nnx module instance.
      optimizer: an optax transformation (identity for eval steps).
      partitioner: where arrays live; single device when None.
      train: whether this is a training step (its state buffers are donated to `run`).
        nnx models run in train mode in a training step and in eval mode (dropout off,
        BatchNorm on running averages) otherwise; a linen model takes its mode as a call
        argument, by the idiom ``deterministic=not train`` (see `jaxloop.model`).
      should_shard_batch: whether `__call__` shards the batch (off when batches arrive
        already on the devices).
      nnx_model_args: positional arguments for an nnx module class.
      begin_actions / end_actions: actions run before / after each step whose number
        (`per_loop_step_number`) is a multiple of their interval (see `action_fires`).
      dtype_policy: mixed precision, a `jaxloop.precision.Policy` or a string such as
        ``'bfloat16'`` (params and outputs float32, computation bfloat16; see
        `precision.get_policy`). The model's ``apply_fn`` casts parameters and floating
        inputs to the compute dtype and outputs to the output dtype; new parameters are
        stored in the param dtype. None (the default) leaves the model untouched.
      **nnx_model_kwargs: keyword arguments for an nnx module class.
    """

    def __init__(
        self,
        base_prng: types.PRNGType,
        model: model_lib.Model,
        optimizer: optax.GradientTransformation = _IDENTITY,
        partitioner: partition_lib.Partitioner | None = None,
        train: bool = False,
        should_shard_batch: bool = True,
        nnx_model_args: Sequence[Any] | None = None,
        begin_actions: Sequence[Any] | None = None,
        end_actions: Sequence[Any] | None = None,
        dtype_policy: precision_lib.Policy | str | None = None,
        **nnx_model_kwargs: Any,
    ):
        self._adapter = model_lib.adapt(model, nnx_model_args, nnx_model_kwargs)
        self._dtype_policy = precision_lib.get_policy(dtype_policy)
        # Wrapped once: the state keeps apply_fn in its tree structure.
        self._apply_fn = (
            self._adapter.apply
            if self._dtype_policy is None
            else self._dtype_policy.wrap_apply(self._adapter.apply)
        )
        self._base_prng = base_prng
        self._model = model
        self._optimizer = optimizer
        self._partitioner = partitioner or partition_lib.SingleDevicePartitioner()
        self._train = train
        self._should_shard_batch = should_shard_batch
        self._begin_actions = list(begin_actions or [])
        self._end_actions = list(end_actions or [])
        self._compiled: Callable | None = None
        # The prefetch thread's `prepare_batch` and the loop's first call may both compile.
        self._compile_lock = threading.Lock()
        self._runs_host_batches = False
        self._prepares_on_host = False
        self._jit_kwargs: dict[str, Any] = {}
        # The multi-step programs of `call_steps`, keyed by (carry_state, unroll).
        self._compiled_steps: dict[tuple[bool, int | bool], Callable] = {}
        self._num_params: int | None = None
        # The batch spec of the last `abstract_state`, to initialise it when nothing is
        # restored (host-side configuration, like the model itself).
        self._abstract_spec: types.BatchSpec | None = None
        self._num_flops: float | None = None

    # -- properties -------------------------------------------------------------------------

    @property
    def train(self) -> bool:
        return self._train

    @property
    def model(self) -> Any:
        return self._model

    @property
    def partitioner(self) -> partition_lib.Partitioner:
        return self._partitioner

    @property
    def optimizer(self) -> optax.GradientTransformation:
        return self._optimizer

    @property
    def dtype_policy(self) -> precision_lib.Policy | None:
        """The mixed-precision policy of the model's ``apply_fn`` (None: as the model is)."""
        return self._dtype_policy

    @property
    def begin_actions(self) -> list[Any]:
        """Actions run before the steps they fire on (see `action_fires`)."""
        return self._begin_actions

    @property
    def end_actions(self) -> list[Any]:
        """Actions run after the steps they fire on (see `action_fires`)."""
        return self._end_actions

    @property
    def num_params(self) -> int | None:
        """Parameter count, known after `initialize_model` or `compute_num_params`."""
        return self._num_params

    @property
    def num_flops(self) -> float | None:
        """Flops of one whole step (all devices), known after a call with
        `log_num_flops=True` (see `compute_num_flops`)."""
        return self._num_flops

    # -- randomness -------------------------------------------------------------------------

    def prng_key(self, step: int | jax.Array) -> types.PRNGType:
        """The PRNG key for a step: a pure function of (base key, step), also inside `run`.

        Example::

            dropout_key = self.prng_key(state.step)
        """
        if isinstance(self._base_prng, Mapping):
            return {k: jax.random.fold_in(v, step) for k, v in self._base_prng.items()}
        return jax.random.fold_in(self._base_prng, step)

    # -- model state --------------------------------------------------------------------------

    def _create_state(self, batch: Batch) -> State:
        variables = self._adapter.init(self._base_prng, batch)
        params = variables["params"]
        if self._dtype_policy is not None:
            params = self._dtype_policy.cast_to_param(params)
        return State.create(
            apply_fn=self._apply_fn,
            params=params,
            tx=self._optimizer,
            batch_stats=variables.get("batch_stats"),
        )

    def initialize_model(self, spec: types.BatchSpec, log_num_params: bool = False) -> State:
        """Initialises the model and optimizer from an example batch spec, placed on the mesh.

        The spec only fixes shapes and dtypes (a zero batch is built), so its batch size need
        not divide by the device count: ``initialize_model([1, 28, 28, 1])`` works on any
        mesh.

        Example::

            state = step.initialize_model({'image': [1, 28, 28, 1], 'label': ([1], 'int32')})
        """
        batch = zeros_from_spec(spec)
        state = self._partitioner.shard_init_fn(self._create_state)(batch)
        self.compute_num_params(state)
        if log_num_params:
            log.info("Number of parameters: %d", self._num_params)
        return state

    def abstract_state(self, spec: types.BatchSpec, log_num_params: bool = False) -> State:
        """The state `initialize_model` would create, described but not built.

        Every array leaf is a `jax.ShapeDtypeStruct` with the shape, dtype and sharding the
        partitioner gives it (`jax.eval_shape`: no device memory is used). Pass it where a
        state is restored (`restore_model`, `OuterLoop`, `checkpoint.restore`) so the
        checkpoint lands straight in place, without a freshly initialised state alive beside
        it; where there is no checkpoint yet, those initialise the state from this step
        (`materialize`).

        Example::

            state = step.restore_model(step.abstract_state([1, 28, 28, 1]), ckpt_dir)
        """
        batch = zeros_from_spec(spec)
        abstract = self._partitioner.abstract_init_fn(self._create_state)(batch)
        self._abstract_spec = spec
        self.compute_num_params(abstract)
        if log_num_params:
            log.info("Number of parameters: %d", self._num_params)
        return abstract

    def materialize(self, state: State) -> State:
        """`state` if it holds arrays; for an abstract state (`abstract_state`), the state
        initialised from the spec it was described with.

        Raises:
          ValueError: an abstract state this step did not describe.
        """
        if not is_abstract(state):
            return state
        if self._abstract_spec is None:
            raise ValueError(
                "Cannot initialise an abstract state this step did not describe: create it "
                "with step.abstract_state(spec), or pass step.initialize_model(spec)"
            )
        new = self.initialize_model(self._abstract_spec)
        if jax.tree.structure(new) != jax.tree.structure(state):
            raise ValueError(
                "The abstract state does not match the model this step initialises: "
                f"{jax.tree.structure(state)} vs {jax.tree.structure(new)}"
            )
        return new

    def restore_model(
        self,
        state: State,
        checkpoint_dir: Any,
        step: int | None = None,
        transforms: Any = None,
    ) -> State:
        """Restores `state` from the orbax checkpoints in `checkpoint_dir`.

        Restores the latest step unless `step` is given, placing every array as the given
        state's arrays are placed (whichever partitioner instance placed them). `state` may
        be abstract (`abstract_state`): the checkpoint is then read straight into place, and
        with no checkpoint the state is initialised (`materialize`). An eval step
        (``train=False``) restores no optimizer state. With no checkpoint there, logs "No
        checkpoint found in <dir>" and returns `state` unchanged (initialised if abstract).
        `transforms` are orbax restore transforms, as in the reference (see
        `checkpoint.restore`).

        Example::

            state = step.restore_model(step.initialize_model(spec), workdir / 'checkpoints')
        """
        from jaxloop import checkpoint  # noqa: PLC0415 (orbax is heavy; import when used)

        restored = checkpoint.restore_state(
            state, checkpoint_dir, step, self._partitioner, skip_optimizer=not self._train,
            transforms=transforms,
        )
        return self.materialize(restored)

    def compute_num_params(self, state: State) -> int:
        """Counts the parameters of `state` (and remembers it as `num_params`)."""
        self._num_params = int(sum(
            int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(state.params)
        ))
        return self._num_params

    # -- compilation ----------------------------------------------------------------------------

    def compile(self, **jit_kwargs: Any) -> Callable:
        """Jits `run` through the partitioner; `jit_kwargs` go to `jax.jit`.

        Training steps donate the state's buffers (argument 0) unless `donate_argnums` is
        given. An unknown jit flag raises TypeError here.

        Example::

            step.compile(keep_unused=True)
        """
        kwargs = {"donate_argnums": (0,)} if self._train else {}
        kwargs.update(jit_kwargs)
        self._compiled = self._partitioner.partition(self._run_in_mode, **kwargs)
        self._jit_kwargs = kwargs
        self._compiled_steps = {}
        # Whether `__call__` may let the compiled call place host batches: only where
        # neither an overridden `prepare_batch` nor `begin` expects them on the devices.
        cls = type(self)
        self._runs_host_batches = (
            self._should_shard_batch
            and cls.prepare_batch is Step.prepare_batch
            and cls.begin is Step.begin
            and callable(getattr(self._compiled, "call_placing_batch", None))
        )
        # On CPU devices in one process, placing a batch ahead (a prefetch thread) is a
        # copy in host memory that the compiled call would make anyway: leave it to the
        # call.
        self._prepares_on_host = (
            self._runs_host_batches
            and jax.process_count() == 1
            and all(d.platform == "cpu" for d in self._partitioner.mesh.devices.flat)
        )
        return self._compiled

    def _program(self) -> Callable:
        """The single-step program, made on first use (`compile` with default flags)."""
        compiled = self._compiled
        if compiled is None:
            with self._compile_lock:
                compiled = self._compiled or self.compile()
        return compiled

    def _steps_program(self, carry_state: bool, unroll: int | bool) -> Callable:
        program = self._compiled_steps.get((carry_state, unroll))
        if program is None:
            self._program()
            program = self._partitioner.partition_steps(
                self._run_in_mode, carry_state=carry_state, unroll=unroll, **self._jit_kwargs
            )
            self._compiled_steps[(carry_state, unroll)] = program
        return program

    def compute_num_flops(self, state: State, batch: Batch, **kwargs: Any) -> float:
        """Flops of one whole `run` on this batch (all devices together), from XLA's cost
        analysis of the program before it is split across devices.

        Nothing is compiled for it (the step is only lowered), and the figure does not
        depend on the partitioner: single device, data parallel and SPMD agree.
        """
        compiled = self._program()
        analysis = compiled.lower(state, batch, **kwargs).cost_analysis()
        if isinstance(analysis, list | tuple):
            analysis = analysis[0] if analysis else {}
        self._num_flops = float((analysis or {}).get("flops", 0.0))
        return self._num_flops

    def abstract_batch(self, spec: types.BatchSpec) -> Batch:
        """The global batch of `spec` as `run` receives it, described but not built: each
        leaf a `jax.ShapeDtypeStruct` placed as `Partitioner.shard_batch` places batches
        (leading dimension split along the data axis, 0-d leaves replicated).

        Raises:
          ValueError: a leaf's leading dimension does not divide by the devices along the
            data axis (the message names the leaf), or a malformed spec.
        """
        partitioner = self._partitioner
        mesh = partitioner.mesh
        axis = partitioner.data_axis
        shards = mesh.shape[axis] if axis is not None else 1
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def describe(path: tuple, x: Any) -> jax.ShapeDtypeStruct:
            if getattr(x, "sharding", None) is not None:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if x.ndim and x.shape[0] % shards:
                raise ValueError(
                    f"Batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape "
                    f"{tuple(x.shape)}: its leading dimension {x.shape[0]} (the global "
                    f"batch) does not divide by the {shards} devices along mesh axis "
                    f"{axis!r}"
                )
            sharding = partitioner.batch_sharding if x.ndim else replicated
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        # np.zeros reserves pages lazily: describing a large batch this way costs no memory.
        return jax.tree_util.tree_map_with_path(describe, zeros_from_spec(spec))

    def memory_estimate(
        self, spec: types.BatchSpec, state: State | None = None, **kwargs: Any
    ) -> memory_lib.MemoryEstimate:
        """What one device needs to run this step on a global batch of `spec`, from XLA's
        memory analysis of the compiled step: arguments, outputs, temporaries and total.

        The step is compiled for an abstract state and batch (`abstract_state`,
        `abstract_batch`) and never run: no state is created and no device memory is
        used beyond the compilation itself, so an out-of-memory is found before a job is
        scheduled.

        Args:
          spec: the global batch `run` receives (after `preprocess_batch`), e.g.
            ``{'image': [256, 28, 28, 1], 'label': ([256], 'int32')}``.
          state: the state to run on, abstract or concrete. By default the state described
            by the last `abstract_state` call's spec, or when there was none, the state
            initialised from `spec` itself.
          **kwargs: passed to `run`, as in `__call__`.

        Example::

            state = step.abstract_state([1, 28, 28, 1])
            print(step.memory_estimate({'image': [256, 28, 28, 1],
                                        'label': ([256], 'int32')}, state))
        """
        if state is None:
            init_spec = self._abstract_spec if self._abstract_spec is not None else spec
            # Not `abstract_state`: an estimate leaves the step's bookkeeping as it was.
            state = self._partitioner.abstract_init_fn(self._create_state)(
                zeros_from_spec(init_spec)
            )
        batch = self.abstract_batch(spec)
        compiled = self._program()
        program = compiled.lower(state, batch, **kwargs).compile()
        return memory_lib.MemoryEstimate.from_compiled(program, self._partitioner.mesh.devices)

    # -- the parts users override ---------------------------------------------------------------

    def preprocess_batch(self, batch: Batch) -> Batch:
        """Host-side transformation of the raw batch before sharding (numpy in, numpy out)."""
        return batch

    def batches_stay_on_host(self) -> bool:
        """Whether `prepare_batch` leaves batches on the host for the compiled call to place
        (CPU devices in one process, the default `prepare_batch` and `begin`).

        Such batches have nothing to be placed ahead of the step, so a prefetcher reads them
        as they are needed instead of in a thread (see `Loop.prefetching`). Makes the step's
        program if it is not made yet, as `prepare_batch` does.
        """
        self._program()
        return self._prepares_on_host

    def prepare_batch(self, batch: Batch) -> PreparedBatch:
        """`preprocess_batch`, then sharding (if enabled): the host-side work for a batch,
        which a prefetcher may do in the background ahead of the step.

        On CPU devices in one process the batch stays on the host (``on_host=True``) when
        the compiled call can place it itself: placing it ahead would copy it within host
        memory for nothing. The choice is made here once for all batches (this makes the
        step's program, as its first call would), so the batches a prefetcher prepares
        before the first step run the same compiled program as all later ones.
        """
        self._program()
        batch = self.preprocess_batch(batch)
        if self._prepares_on_host:
            return PreparedBatch(batch, on_host=True)
        if self._should_shard_batch:
            batch = self._partitioner.shard_batch(batch)
        return PreparedBatch(batch)

    def prepare_batches(self, batches: Sequence[Batch | PreparedBatch]) -> PreparedBatch:
        """The host-side work for several batches run in one `call_steps` execution.

        Each batch is preprocessed; host (numpy) batches are then stacked with `np.stack`
        on a new leading axis and placed in one transfer with
        `Partitioner.shard_stacked_batch`. Batches already on the devices (prefetched
        `PreparedBatch`es, jax arrays) are stacked on the devices instead.

        Raises:
          BatchLayoutError: the batches differ in layout (`batch_layout`); raised before
            any batch is preprocessed.

        Example::

            stacked = step.prepare_batches([batch1, batch2, batch3, batch4])
            state, outputs = step.call_steps(state, stacked)  # outputs['loss'].shape == (4,)
        """
        if not batches:
            raise ValueError("prepare_batches needs at least one batch")
        layouts = {batch_layout(b) for b in batches}
        if len(layouts) > 1:
            raise BatchLayoutError(
                f"Batches run in one execution must share one layout (tree structure and "
                f"leaf shapes); got {len(layouts)} layouts: {sorted(map(str, layouts))}"
            )
        shard = self._should_shard_batch
        if not any(isinstance(b, PreparedBatch) for b in batches):
            host = [self.preprocess_batch(b) for b in batches]
            if not any(isinstance(x, jax.Array) for x in jax.tree.leaves(host)):
                stacked = jax.tree.map(lambda *xs: np.stack(xs), *host)
                if shard:
                    stacked = self._partitioner.shard_stacked_batch(stacked)
                return PreparedBatch(stacked, len(batches))
            placed = [self._partitioner.shard_batch(b) if shard else b for b in host]
        elif all(isinstance(b, PreparedBatch) and b.on_host for b in batches):
            stacked = jax.tree.map(lambda *xs: np.stack(xs), *(b.batch for b in batches))
            return PreparedBatch(self._partitioner.shard_stacked_batch(stacked), len(batches))
        else:
            placed = [self._placed(b) for b in batches]
        stacked = self._partitioner.stack_batches(placed) if shard else _stack_on_device(placed)
        return PreparedBatch(stacked, len(batches))

    def _placed(self, batch: Batch | PreparedBatch) -> Batch:
        """The batch preprocessed and on the devices."""
        if not isinstance(batch, PreparedBatch):
            batch = self.prepare_batch(batch)
        if batch.on_host:
            return self._partitioner.shard_batch(batch.batch)
        return batch.batch

    def begin(self, state: State, batch: Batch) -> tuple[State, Batch]:
        """Runs before the compiled `run`, outside jit, on the sharded batch.

        In `call_steps` it runs once per execution, on the stacked batch.
        """
        return state, batch

    def run(self, state: State, batch: Batch) -> tuple[State, Output | None]:
        """The computation for one batch; traced and compiled. Override this."""
        raise NotImplementedError("Subclasses of Step must implement run(state, batch)")

    def _run_in_mode(self, state: State, batch: Batch, *args: Any,
                     **kwargs: Any) -> tuple[State, Output | None]:
        # nnx models follow this step's mode while `run` is traced (see model.training_mode).
        with model_lib.training_mode(self._train):
            return self.run(state, batch, *args, **kwargs)

    def end(self, state: State, outputs: Output | None) -> tuple[State, Output | None]:
        """Runs after the compiled `run`, outside jit.

        In `call_steps` it runs once per execution, on the stacked outputs.
        """
        return state, outputs

    # -- driver ---------------------------------------------------------------------------------

    def __call__(
        self,
        state: State,
        batch: Batch,
        per_loop_step_number: int = 0,
        log_num_flops: bool = False,
        **kwargs: Any,
    ) -> tuple[State, Output | None]:
        """Runs one batch: preprocess, shard, begin, compiled run, end, with step actions.

        When nothing looks at the sharded batch before `run` (`prepare_batch` and `begin`
        not overridden), the compiled call places the host batch itself, exactly as
        `Partitioner.shard_batch` would: one dispatch instead of two. A begin action firing
        on this step is given a placed copy, and `log_num_flops` only lowers the step, so
        every step runs the one compiled program.
        """
        compiled = self._program()
        prepared = isinstance(batch, PreparedBatch)
        if prepared and not batch.on_host:
            batch = batch.batch
        elif self._runs_host_batches and not kwargs:
            host = batch.batch if prepared else self.preprocess_batch(batch)
            if log_num_flops:
                self.compute_num_flops(state, host)
            if self._begin_actions:
                for action in self._begin_actions:
                    if action_fires(action, per_loop_step_number, begin=True):
                        # Actions see the batch on the devices; the step still gets the host
                        # batch, so every step runs the one compiled program.
                        placed = self._partitioner.shard_batch(host)
                        action(state, None, batch=placed,
                               per_loop_step_number=per_loop_step_number)
            state, outputs = compiled.call_placing_batch(state, host)
            return self._end_step(state, outputs, per_loop_step_number)
        else:
            batch = self._placed(batch)
        for action in self._begin_actions:
            if action_fires(action, per_loop_step_number, begin=True):
                action(state, None, batch=batch, per_loop_step_number=per_loop_step_number)
        state, batch = self.begin(state, batch)
        if log_num_flops:
            self.compute_num_flops(state, batch, **kwargs)
        state, outputs = compiled(state, batch, **kwargs)
        return self._end_step(state, outputs, per_loop_step_number)

    def _end_step(
        self, state: State, outputs: Output | None, per_loop_step_number: int
    ) -> tuple[State, Output | None]:
        state, outputs = self.end(state, outputs)
        for action in self._end_actions:
            if action_fires(action, per_loop_step_number, begin=False):
                action(state, outputs, per_loop_step_number=per_loop_step_number)
        return state, outputs

    def call_steps(
        self,
        state: State,
        batches: Sequence[Batch | PreparedBatch] | PreparedBatch,
        per_loop_step_number: int = 1,
        log_num_flops: bool = False,
        carry_state: bool = True,
        unroll: int | bool = 1,
        **kwargs: Any,
    ) -> tuple[State, Output | None]:
        """Runs several batches as consecutive steps in one compiled call.

        The steps are a `jax.lax.scan` of `run` over the stacked batches, so the host
        dispatches once for all of them, and the results equal those of calling the step on
        each batch in turn. Outputs come back stacked: ``outputs['loss'][i]`` is step i's.

        `begin` and `end` run once for the whole execution, on the stacked batch and the
        stacked outputs. Step actions fire as in `__call__`, for step numbers
        ``per_loop_step_number ...`` (the first step's number onwards), but only where the
        host sees a step boundary: a begin action may fire on the first step (it is given
        that step's batch) and an end action on the last (given that step's outputs).

        Args:
          state: the state before the first step.
          batches: a sequence of batches, or their `prepare_batches` result.
          per_loop_step_number: the number of the first step in its loop.
          log_num_flops: compute `num_flops` of one step first.
          carry_state: False runs every step on the given `state` (as eval loops do) and
            returns it unchanged.
          unroll: how many steps the compiled loop body holds (`jax.lax.scan`'s `unroll`;
            True: all). See `Partitioner.partition_steps`: on XLA:CPU, unroll conv nets.
          **kwargs: passed to every `run`.

        Raises:
          ValueError: a step action would fire on a step inside the execution.

        Example::

            state, outputs = step.call_steps(state, [batch1, batch2, batch3, batch4])
        """
        if not isinstance(batches, PreparedBatch):
            batches = self.prepare_batches(batches)
        if batches.num_steps is None:
            raise ValueError(
                "call_steps needs stacked batches: a sequence of batches or the result of "
                "prepare_batches, not a single PreparedBatch"
            )
        num_steps = batches.num_steps
        first = per_loop_step_number
        last = first + num_steps - 1
        self._check_no_inner_actions(first, last)
        stacked = batches.batch
        for action in self._begin_actions:
            if action_fires(action, first, begin=True):
                action(state, None, batch=_index(stacked, 0), per_loop_step_number=first)
        state, stacked = self.begin(state, stacked)
        if log_num_flops:
            self.compute_num_flops(state, _index(stacked, 0), **kwargs)
        state, outputs = self._steps_program(carry_state, unroll)(state, stacked, **kwargs)
        state, outputs = self.end(state, outputs)
        for action in self._end_actions:
            if action_fires(action, last, begin=False):
                action(state, _index(outputs, -1), per_loop_step_number=last)
        return state, outputs

    def _check_no_inner_actions(self, first: int, last: int) -> None:
        for actions, begin, steps in (
            (self._begin_actions, True, range(first + 1, last + 1)),
            (self._end_actions, False, range(first, last)),
        ):
            for action in actions:
                inner = [n for n in steps if action_fires(action, n, begin)]
                if inner:
                    raise ValueError(
                        f"Step action {action!r} fires on step {inner[0]}, inside an "
                        f"execution of steps {first}..{last}; run the steps around it "
                        "separately (loops with steps_per_execution do this)"
                    )

