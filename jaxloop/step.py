"""Step: what happens to one batch. Users subclass it and override `run`. A call runs
``preprocess_batch -> begin actions -> begin -> compiled run -> end -> end actions``; `run`
is compiled once (`jaxloop.engine.program`), and `call_steps` runs k batches in one call.

Example::

    class MnistStep(step_lib.Step):
        def run(self, state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, batch)
            return state.apply_gradients(grads=grads), {'loss': loss}

    step = MnistStep(jax.random.key(0), CNN(), optimizer=optax.adam(1e-3), train=True)
    state, outputs = step(step.initialize_model([1, 28, 28, 1]), batch)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import optax

from jaxloop import partition as partition_lib
from jaxloop import types
from jaxloop.engine import outputs as outputs_lib
from jaxloop.engine import ownership, staging
from jaxloop.engine import program as program_lib
from jaxloop.hooks import step_actions
from jaxloop.state import model as model_lib
from jaxloop.state import model_state, nnx_step, specs
from jaxloop.state import sown as sown_lib

Batch = types.Batch
BatchSpec = types.BatchSpec
DType = types.DType
Output = types.Output
State = types.TrainState
get_zeroed_batch = specs.zeros_from_spec  # google/jaxloop's name

log = logging.getLogger(__name__)
_IDENTITY = optax.identity()  # eval steps need no optimizer; one shared default


class Step:
    """One batch of training or evaluation. Subclass and override `run`.

    Args:
      base_prng: a key (or dict of named keys) for `prng_key` and model initialisation.
      model: a linen or nnx module instance, or an nnx module class (built with
        `nnx_model_args` and `nnx_model_kwargs`).
      should_shard_batch: False when batches arrive already on the devices.
      begin_actions / end_actions: run before / after the steps they fire on.
      dtype_policy: mixed precision, ``'bfloat16'`` or a `jaxloop.recipes.precision.Policy`.
      sown: flax collections the model sows into, added to the outputs (`jaxloop.state.sown`).
    """

    state_class: type[types.TrainState] | None = None
    """The `types.TrainState` subclass built (its extra fields with defaults), set on a
    subclass or instance; None: whatever ``jaxloop.step.State`` names at the call."""

    def __init__(self, base_prng: types.PRNGType, model: model_lib.Model,
                 optimizer: optax.GradientTransformation = _IDENTITY,
                 partitioner: partition_lib.Partitioner | None = None, train: bool = False,
                 should_shard_batch: bool = True, nnx_model_args: Sequence[Any] | None = None,
                 begin_actions: Sequence[Any] | None = None,
                 end_actions: Sequence[Any] | None = None, dtype_policy: Any = None,
                 sown: Sequence[str] = (), sown_scalars_only: bool = True,
                 **nnx_model_kwargs: Any):
        self._sown = (sown,) if isinstance(sown, str) else tuple(sown)
        self._sown_scalars_only = sown_scalars_only
        self._state_builder = model_state.StateBuilder(
            model_lib.adapt(model, nnx_model_args, nnx_model_kwargs), optimizer,
            dtype_policy, base_prng)
        self._base_prng, self._model, self._optimizer = base_prng, model, optimizer
        self._partitioner = partitioner or partition_lib.SingleDevicePartitioner()
        self._train, self._should_shard_batch = train, should_shard_batch
        self._begin_actions, self._end_actions = list(begin_actions or []), list(end_actions or [])
        self._jit_kwargs: dict[str, Any] = {}
        self._donating = False
        self._programs: dict[Any, program_lib.Program] = {}
        self._last_program: program_lib.Program | None = None
        self._last_state: weakref.ref | None = None
        self._num_params: int | None = None
        self._num_flops: float | None = None
        self._abstract_spec: types.BatchSpec | None = None  # what `materialize` initialises

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
    def dtype_policy(self) -> Any:
        """The mixed-precision `Policy` of the model's ``apply_fn`` (None: as the model is)."""
        return self._state_builder.policy

    @property
    def begin_actions(self) -> list[Any]:
        return self._begin_actions

    @property
    def end_actions(self) -> list[Any]:
        return self._end_actions

    @property
    def num_params(self) -> int | None:
        """Parameter count, known after `initialize_model` or `compute_num_params`."""
        return self._num_params

    @property
    def num_flops(self) -> float | None:
        """Flops of one step on one device, known after a call with `log_num_flops=True`."""
        return self._num_flops

    def _counted(self, state: State, log_num_params: bool) -> State:
        self.compute_num_params(state)
        if log_num_params:
            log.info("Number of parameters: %d", self._num_params)
        return state

    def initialize_model(self, spec: types.BatchSpec, log_num_params: bool = False) -> State:
        """Initialises the model and optimizer on the mesh from an example batch spec (its
        shapes and dtypes; `State` looked up per call, as google's notebooks reassign it)."""
        return self._counted(self._state_builder.initialize(
            self._partitioner, spec, self.state_class or State), log_num_params)

    def abstract_state(self, spec: types.BatchSpec, log_num_params: bool = False,
                       remember: bool = True) -> State:
        """The state `initialize_model` would create as `jax.ShapeDtypeStruct` leaves, to
        restore into in place (``step.restore_model(step.abstract_state(spec), ckpt_dir)``) or
        initialise (`materialize`); ``remember=False`` leaves `num_params` and those alone."""
        abstract = self._state_builder.abstract(self._partitioner, spec,
                                                self.state_class or State)
        if not remember:
            return abstract
        self._abstract_spec = spec
        return self._counted(abstract, log_num_params)

    def materialize(self, state: State) -> State:
        """`state`, or for an `abstract_state` the state its spec initialises (else ValueError)."""
        return model_state.materialize(state, self._abstract_spec, self.initialize_model)

    def restore_model(self, state: State, checkpoint_dir: Any, step: int | None = None,
                      transforms: Any = None) -> State:
        """Restores `state` (placed as it is, maybe abstract) from the latest checkpoint in
        `checkpoint_dir` (or `step`'s; for an eval step without optimizer state; `transforms`:
        see `checkpoint.restore`); with none, returns `state` materialized."""
        return self.materialize(model_state.restore(
            state, checkpoint_dir, step, self._partitioner, not self._train, transforms))

    def compute_num_params(self, state: State) -> int:
        """Counts the parameters of `state` (remembered as `num_params`)."""
        self._num_params = model_state.count_params(state)
        return self._num_params

    def compute_num_flops(self, state: State, batch: Batch, **kwargs: Any) -> float | None:
        """Flops of one `run` on this placed batch on one device (`Program.flops`)."""
        self._num_flops = self._program().flops(state, batch, **kwargs)
        return self._num_flops

    def abstract_batch(self, spec: types.BatchSpec) -> Batch:
        """The global batch of `spec` as `run` receives it, described (`specs.abstract_batch`)."""
        return specs.abstract_batch(self._partitioner, spec)

    def prng_key(self, step: int | jax.Array) -> types.PRNGType:
        """The PRNG key of a step, from (base key, step): ``self.prng_key(state.step)``."""
        return jax.tree.map(lambda key: jax.random.fold_in(key, step), self._base_prng)

    def compile(self, **jit_kwargs: Any) -> program_lib.Program:
        """Jits `run` with these `jax.jit` flags (through the partitioner's `partition`) and
        returns the program ``step(state, batch)`` runs. ``donate_argnums=(0,)`` consumes the
        state of every call (else a training step donates only inside `donating_state`);
        ``out_shardings`` places `run`'s outputs (the state keeps the partitioner's)."""
        self._jit_kwargs = dict(jit_kwargs)
        self._programs = {}
        return self._program()

    def program(self) -> program_lib.Program:
        """The program ``step(state, batch)`` runs now (e.g. to lower for XLA's analyses)."""
        return self._program()

    @contextlib.contextmanager
    def donating_state(self) -> Iterator[None]:
        """While open, a training step donates (consumes) the state it is given, as loops do
        on states they made: give it only a state nobody else holds."""
        previous, self._donating = self._donating, True
        try:
            yield
        finally:
            self._donating = previous

    def _program(self, size: int | None = None, carry_state: bool = True,
                 unroll: bool = False, separate: bool = False, keep: bool = False
                 ) -> program_lib.Program:
        """The program of one step (`size` None) or of up to `size` steps, made on first use;
        inside `donating_state` it consumes the state unless `keep` (someone holds it)."""
        donate = (self._train and self._donating and not keep
                  and not {"donate_argnums", "donate_argnames"} & set(self._jit_kwargs))
        key = (size, carry_state, unroll, separate, donate)
        if key not in self._programs:
            # `run`'s own name and signature: jit flags name its arguments, profiles its name.
            run = functools.update_wrapper(functools.partial(self._run_in_mode), self.run)
            self._programs[key] = program_lib.Program(
                run, self._partitioner, steps=size, carry_state=carry_state, unroll=unroll,
                separate=separate, **self._jit_kwargs, **{"donate_argnums": (0,)} if donate else {})
        return self._programs[key]

    @property
    def last_state(self) -> State | None:
        """The state the last call returned, while held: after an error in an end hook or
        action, the live one (the one given was consumed)."""
        return None if self._last_state is None else self._last_state()

    def _hook(self, hook: Any, state: State, other: Any) -> tuple[State, Any]:
        # A user's `begin` or `end` is watched for a state it keeps.
        mine = getattr(hook, "__func__", None) in (Step.begin, Step.end)
        return hook(state, other) if mine else ownership.call(hook, state, other)

    @property
    def last_token(self) -> jax.Array | None:
        """A scalar of the last compiled call, ready when it has finished (`in_flight`)."""
        return None if self._last_program is None else self._last_program.last_token

    def preprocess_batch(self, batch: Batch) -> Batch:
        """Host-side transformation of the raw batch before sharding (numpy in, numpy out)."""
        return batch

    def prepare_batch(self, batch: Batch) -> staging.PreparedBatch:
        """`preprocess_batch` then `shard_batch` (a prefetcher's thread runs it): the step does
        neither again for ``step(state, prepared)``."""
        return staging.PreparedBatch(self._ready(batch, self._should_shard_batch))

    def shard_batch(self, batch: Batch) -> Batch:
        """Places a preprocessed batch on the mesh (`Partitioner.shard_batch`)."""
        return self._partitioner.shard_batch(batch)

    @functools.cached_property
    def _placing(self) -> tuple[bool, bool]:
        """(place a host batch before the program, not in jit's dispatch: with several
        processes, a custom `shard_batch` or `begin`; the user's `shard_batch` places it)."""
        partitioner = self._partitioner
        custom = (type(self).shard_batch is not Step.shard_batch
                  or type(partitioner).shard_batch is not partition_lib.Partitioner.shard_batch
                  or "shard_batch" in vars(partitioner))
        first = custom or jax.process_count() > 1 or type(self).begin is not Step.begin
        return self._should_shard_batch and first, self._should_shard_batch and custom

    def _ready(self, batch: Batch | staging.PreparedBatch, place: bool,
               preprocessed: bool = False) -> Batch:
        """The batch as a program takes it, preprocessed and, if `place`, placed."""
        if isinstance(batch, staging.PreparedBatch):
            return batch.batch
        batch = batch if preprocessed else self.preprocess_batch(batch)
        return self.shard_batch(batch) if place else batch

    def begin(self, state: State, batch: Batch) -> tuple[State, Batch]:
        """Runs on the host before each compiled call, on its placed batch (for fused steps,
        the k batches stacked on a leading axis)."""
        return state, batch

    def run(self, state: State, batch: Batch) -> tuple[State, Output | None]:
        """The computation for one batch; traced and compiled. Override this. (A `run` that
        takes ``model`` first gets an nnx.Module: `jaxloop.state.nnx_step`.)"""
        raise NotImplementedError("Subclasses of Step must implement run(state, batch)")

    def _run_in_mode(self, state: State, batch: Batch, *args: Any,
                     **kwargs: Any) -> tuple[State, Output | None]:
        if nnx_step.takes_model(self.run):  # run(self, model, ...): the NNX way
            return nnx_step.run(self, self._state_builder.adapter, state, batch, *args, **kwargs)
        # nnx models follow this step's mode while `run` is traced.
        with model_lib.training_mode(self._train):
            if not self._sown:
                return self.run(state, batch, *args, **kwargs)
            recording, recorder = sown_lib.record(state, self._sown, self._sown_scalars_only)
            new_state, outputs = self.run(recording, batch, *args, **kwargs)
            return sown_lib.restored(new_state, state), recorder.outputs(outputs)

    def end(self, state: State, outputs: Output | None) -> tuple[State, Output | None]:
        """Runs on the host after each compiled call, on its outputs (for fused steps,
        stacked on a leading axis of k; entries past the real steps are padding)."""
        return state, outputs

    def __call__(self, state: State, batch: Batch, per_loop_step_number: int = 0,
                 log_num_flops: bool = False, **kwargs: Any) -> tuple[State, Output | None]:
        """Runs one batch with its actions; ``batch_preprocessed=True`` (passed to `run` with
        the other kwargs) skips `preprocess_batch`."""
        batch = self._ready(batch, self._placing[0], kwargs.get("batch_preprocessed", False))
        return self._execute(state, batch, batch, per_loop_step_number, per_loop_step_number,
                             log_num_flops, kwargs)

    def call_steps(self, state: State, batches: Sequence[Batch | staging.PreparedBatch],
                   per_loop_step_number: int = 1, log_num_flops: bool = False,
                   carry_state: bool = True, unroll: bool = False, size: int | None = None,
                   **kwargs: Any) -> tuple[State, Output | None]:
        """Runs batches of one layout (else BatchLayoutError) as consecutive steps in one
        compiled call of a program for up to `size` (default: their number), outputs stacked
        (``outputs['loss'][i]`` is step i's). Begin actions fire on the first step, end
        actions on the last (ValueError if one fires inside). ``carry_state=False`` runs
        every step on `state` (eval); `unroll` compiles the steps straight-line."""
        if not batches:
            raise ValueError("call_steps needs at least one batch")
        count = len(batches)
        size = count if size is None else size
        first, last = per_loop_step_number, per_loop_step_number + count - 1
        step_actions.check_none_inside(self._begin_actions, self._end_actions, first, last)
        place_first, custom = self._placing
        # Without a user `begin` (which sees them stacked) the program stacks the k batches.
        separate = type(self).begin is Step.begin
        ready = [self._ready(b, custom or (separate and place_first)) for b in batches]
        stacked = (staging.padded(ready, size, moved_once=True) if separate else
                   staging.stack(ready, size, self._partitioner, place_it=place_first))
        return self._execute(state, stacked, ready[0], first, last, log_num_flops, kwargs,
                             count, size, carry_state, unroll, separate)

    def _execute(self, state: State, batch: Any, one: Batch, first: int, last: int,
                 log_num_flops: bool, kwargs: dict[str, Any], count: int | None = None,
                 size: int | None = None, carry_state: bool = True, unroll: bool = False,
                 separate: bool = False) -> tuple[State, Output | None]:
        """Begin actions (on the placed batch `one`), `begin`, the compiled call (one step,
        or `count` of a `size`-step program), `end` and end actions, for steps first-last."""
        if self._begin_actions and any(step_actions.action_fires(a, first, True)
                                       for a in self._begin_actions):
            # A placed copy for the actions only: the program keeps one batch form (no retrace).
            placed = (one if all(isinstance(x, jax.Array) for x in jax.tree.leaves(one))
                      or not self._should_shard_batch else self.shard_batch(one))
            step_actions.fire(self._begin_actions, True, first, state, batch=placed)
        state, batch = self._hook(self.begin, state, batch)
        if log_num_flops:  # of one step
            self.compute_num_flops(state, batch if count is None else one, **kwargs)
        program = self._last_program = self._program(size, carry_state, unroll, separate,
                                                     keep=ownership.is_held(state))
        new_state, outputs = program(state, batch, *(() if count is None else (count,)),
                                     **kwargs)
        if carry_state and self._train:
            try:
                self._last_state = weakref.ref(new_state)
            except TypeError:  # a plain container: the caller has it
                self._last_state = None
        state, outputs = self._hook(self.end, new_state if carry_state else state, outputs)
        if self._end_actions:
            step_actions.fire(self._end_actions, False, last, state,
                              outputs if count is None else outputs_lib.entry(outputs, count - 1))
        return state, outputs
