"""Step: what happens to one batch. Users subclass it and override `run`.

A call runs ``preprocess_batch -> begin actions -> begin -> compiled run -> end -> end
actions``; `run` is compiled once (`jaxloop.engine.program`). `call_steps` runs up to k batches in
one compiled call (a loop's ``steps_per_execution=k``).

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

import contextlib
import functools
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import optax

from jaxloop import partition as partition_lib
from jaxloop import types
from jaxloop.engine import ownership, staging
from jaxloop.engine import program as program_lib
from jaxloop.hooks import step_actions
from jaxloop.recipes import precision as precision_lib
from jaxloop.state import model as model_lib
from jaxloop.state import model_state, nnx_step, specs, step_state
from jaxloop.state import sown as sown_lib

Batch = types.Batch
BatchSpec = types.BatchSpec
DType = types.DType
Output = types.Output
State = types.TrainState

# Names kept here for code that imports them from the step module.
PreparedBatch = staging.PreparedBatch
BatchLayoutError = staging.BatchLayoutError
batch_layout = staging.batch_layout
zeros_from_spec = specs.zeros_from_spec
get_zeroed_batch = specs.zeros_from_spec  # google/jaxloop's name
action_fires = step_actions.action_fires
is_abstract = model_state.is_abstract

# Evaluation steps need no optimizer; one shared identity keeps the default immutable.
_IDENTITY = optax.identity()


class Step(step_state.StepState):
    """One batch of training or evaluation. Subclass and override `run`.

    Args:
      base_prng: a key (or dict of named keys) for `prng_key` and model initialisation.
      model: a linen or nnx module instance, or an nnx module class (built with
        `nnx_model_args` and `nnx_model_kwargs`).
      should_shard_batch: False when batches arrive already on the devices.
      begin_actions / end_actions: run before / after the steps they fire on.
      dtype_policy: mixed precision (`precision.get_policy`); None leaves the model as is.
      sown: flax collections the model sows into, added to the outputs (`jaxloop.state.sown`).
    """

    def __init__(self, base_prng: types.PRNGType, model: model_lib.Model,
                 optimizer: optax.GradientTransformation = _IDENTITY,
                 partitioner: partition_lib.Partitioner | None = None, train: bool = False,
                 should_shard_batch: bool = True, nnx_model_args: Sequence[Any] | None = None,
                 begin_actions: Sequence[Any] | None = None,
                 end_actions: Sequence[Any] | None = None,
                 dtype_policy: precision_lib.Policy | str | None = None,
                 sown: Sequence[str] = (), sown_scalars_only: bool = True,
                 **nnx_model_kwargs: Any):
        self._sown = (sown,) if isinstance(sown, str) else tuple(sown)
        self._sown_scalars_only = sown_scalars_only
        self._dtype_policy = precision_lib.get_policy(dtype_policy)
        self._state_builder = model_state.StateBuilder(
            model_lib.adapt(model, nnx_model_args, nnx_model_kwargs), optimizer,
            self._dtype_policy, base_prng)
        self._base_prng = base_prng
        self._model = model
        self._optimizer = optimizer
        self._partitioner = partitioner or partition_lib.SingleDevicePartitioner()
        self._train = train
        self._should_shard_batch = should_shard_batch
        self._begin_actions = list(begin_actions or [])
        self._end_actions = list(end_actions or [])
        self._jit_kwargs: dict[str, Any] = {}
        self._donating = False
        self._programs: dict[Any, program_lib.Program] = {}
        self._last_program: program_lib.Program | None = None
        self._last_state: weakref.ref | None = None
        self._placing: tuple[bool, bool] | None = None
        self._num_params: int | None = None
        # The spec of the last `abstract_state`, to initialise it when nothing is restored.
        self._abstract_spec: types.BatchSpec | None = None
        self._num_flops: float | None = None

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

    def _state_class(self) -> type[types.TrainState]:
        # Looked up per call: notebooks reassign ``jaxloop.step.State`` after import.
        return self.state_class or State

    def prng_key(self, step: int | jax.Array) -> types.PRNGType:
        """The PRNG key of a step, a pure function of (base key, step); in `run`:
        ``self.prng_key(state.step)``."""
        if isinstance(self._base_prng, Mapping):
            return {k: jax.random.fold_in(v, step) for k, v in self._base_prng.items()}
        return jax.random.fold_in(self._base_prng, step)

    def compile(self, **jit_kwargs: Any) -> program_lib.Program:
        """Jits `run` with `jit_kwargs` for `jax.jit` (through the partitioner's `partition`);
        returns the program ``step(state, batch)`` runs. ``donate_argnums=(0,)`` consumes the
        state of every call; otherwise a training step donates only inside a loop
        (`donating_state`). ``out_shardings`` places `run`'s outputs (a sharding, or the
        pair ``(state's, outputs')``): the state keeps the partitioner's shardings."""
        self._jit_kwargs = dict(jit_kwargs)
        self._programs = {}
        return self._program()

    @property
    def donates_input_state(self) -> bool:
        """Whether `compile`'s flags donate the state: a loop then copies none."""
        donate = self._jit_kwargs.get("donate_argnums", ())
        names = self._jit_kwargs.get("donate_argnames", ())
        return 0 in ((donate,) if isinstance(donate, int) else tuple(donate)) or "state" in (
            (names,) if isinstance(names, str) else tuple(names))

    @contextlib.contextmanager
    def donating_state(self) -> Iterator[None]:
        """While open, a training step donates the state it is given (one state in memory,
        not two). Loops open it around steps on states they produced: give it only a state
        nobody else holds, such as ``jax.device_put(state, may_alias=False)``."""
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
                  and "donate_argnums" not in self._jit_kwargs
                  and "donate_argnames" not in self._jit_kwargs)
        key = (size, carry_state, unroll, separate, donate)
        program = self._programs.get(key)
        if program is None:
            kwargs = dict(self._jit_kwargs, **({"donate_argnums": (0,)} if donate else {}))

            def run(state: State, batch: Batch, *args: Any, **kw: Any) -> Any:
                return self._run_in_mode(state, batch, *args, **kw)

            # `run`'s own name and signature: jit flags name its arguments, profiles its name.
            functools.update_wrapper(run, self.run)
            program = self._programs[key] = program_lib.Program(
                run, self._partitioner, steps=size, carry_state=carry_state, unroll=unroll,
                separate=separate, **kwargs)
        return program

    @property
    def last_state(self) -> State | None:
        """The state the last compiled call returned, while anything still holds it: after
        an error in an end hook or action, the live state (the one it was given was
        consumed)."""
        return None if self._last_state is None else self._last_state()

    def _made(self, state: State) -> None:
        try:
            self._last_state = weakref.ref(state)
        except TypeError:  # a plain container: the caller has it
            self._last_state = None

    def _hook(self, hook: Any, state: State, other: Any) -> tuple[State, Any]:
        """Calls `begin` or `end`, watching a user's override for a kept state."""
        if getattr(hook, "__func__", None) in (Step.begin, Step.end):
            return hook(state, other)
        return ownership.call(hook, state, other)

    @property
    def last_token(self) -> jax.Array | None:
        """A scalar of the last compiled call, ready when it has finished (`in_flight`)."""
        return None if self._last_program is None else self._last_program.last_token

    def preprocess_batch(self, batch: Batch) -> Batch:
        """Host-side transformation of the raw batch before sharding (numpy in, numpy out)."""
        return batch

    def prepare_batch(self, batch: Batch) -> PreparedBatch:
        """`preprocess_batch`, then `shard_batch`: all the work before a step (a prefetcher
        does it in its thread); ``step(state, prepared)`` does neither again."""
        batch = self.preprocess_batch(batch)
        return PreparedBatch(self.shard_batch(batch) if self._should_shard_batch else batch)

    def shard_batch(self, batch: Batch) -> Batch:
        """Places a preprocessed batch on the mesh (`Partitioner.shard_batch`)."""
        return self._partitioner.shard_batch(batch)

    def _placing_policy(self) -> tuple[bool, bool]:
        """(place a host batch before the program, the user's own `shard_batch` places it),
        decided once. Otherwise jit places it in its own dispatch. Placed first with several
        processes, a custom or patched `shard_batch`, or a `begin` of the user's."""
        if self._placing is None:
            partitioner = self._partitioner
            custom = (type(self).shard_batch is not Step.shard_batch
                      or type(partitioner).shard_batch is not partition_lib.Partitioner.shard_batch
                      or "shard_batch" in vars(partitioner))
            first = (custom or jax.process_count() > 1 or type(self).begin is not Step.begin)
            self._placing = (self._should_shard_batch and first,
                             self._should_shard_batch and custom)
        return self._placing

    def _placed(self, batch: Batch) -> Batch:
        """A preprocessed batch on the devices (as it is when placed already)."""
        placed = all(isinstance(x, jax.Array) for x in jax.tree.leaves(batch))
        return batch if placed or not self._should_shard_batch else self.shard_batch(batch)

    def _ready(self, batch: Batch | PreparedBatch, preprocessed: bool = False) -> Batch:
        """The batch as the single step's program takes it (see `_placing_policy`)."""
        if isinstance(batch, PreparedBatch):
            return batch.batch
        if not preprocessed:
            batch = self.preprocess_batch(batch)
        return self.shard_batch(batch) if self._placing_policy()[0] else batch

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
        """Runs one batch with its actions; ``batch_preprocessed=True`` (passed on to `run`
        with the other kwargs) skips `preprocess_batch`."""
        batch = self._ready(batch, kwargs.get("batch_preprocessed", False))
        if self._begin_actions and any(
                action_fires(a, per_loop_step_number, True) for a in self._begin_actions):
            # A placed copy for the actions only: the program keeps one batch form (no retrace).
            step_actions.fire(self._begin_actions, True, per_loop_step_number, state,
                              batch=self._placed(batch))
        state, batch = self._hook(self.begin, state, batch)
        if log_num_flops:
            self.compute_num_flops(state, batch, **kwargs)
        program = self._last_program = self._program(keep=ownership.is_held(state))
        state, outputs = program(state, batch, **kwargs)
        if self._train:
            self._made(state)
        state, outputs = self._hook(self.end, state, outputs)
        if self._end_actions:
            step_actions.fire(self._end_actions, False, per_loop_step_number, state, outputs)
        return state, outputs

    def call_steps(self, state: State, batches: Sequence[Batch | PreparedBatch],
                   per_loop_step_number: int = 1, log_num_flops: bool = False,
                   carry_state: bool = True, unroll: bool = False, size: int | None = None,
                   **kwargs: Any) -> tuple[State, Output | None]:
        """Runs batches of one layout (else BatchLayoutError) as consecutive steps in one
        compiled call, with the results of calling the step on each. One program serves up
        to `size` batches (default: their number); outputs come back stacked
        (``outputs['loss'][i]`` is step i's). Begin actions fire on the first step, end
        actions on the last (ValueError if one fires inside). ``carry_state=False`` runs
        every step on `state` (eval); `unroll` compiles the steps straight-line."""
        if not batches:
            raise ValueError("call_steps needs at least one batch")
        count = len(batches)
        size = count if size is None else size
        first, last = per_loop_step_number, per_loop_step_number + count - 1
        step_actions.check_none_inside(self._begin_actions, self._end_actions, first, last)
        place_first, custom = self._placing_policy()
        # Without a user `begin` (which sees them stacked) the program stacks the k batches.
        separate = type(self).begin is Step.begin
        ready = [b.batch if isinstance(b, PreparedBatch)
                 else self.shard_batch(self.preprocess_batch(b))
                 if custom or (separate and place_first)
                 else self.preprocess_batch(b) for b in batches]
        stacked = (staging.padded(ready, size, moved_once=True) if separate else
                   staging.stack(ready, size, self._partitioner, place_it=place_first))
        if self._begin_actions and any(action_fires(a, first, True) for a in self._begin_actions):
            step_actions.fire(self._begin_actions, True, first, state,
                              batch=self._placed(ready[0]))
        state, stacked = self._hook(self.begin, state, stacked)
        if log_num_flops:
            self.compute_num_flops(state, ready[0], **kwargs)
        program = self._last_program = self._program(size, carry_state, unroll, separate,
                                                     keep=ownership.is_held(state))
        new_state, outputs = program(state, stacked, count, **kwargs)
        if carry_state and self._train:
            self._made(new_state)
        state = new_state if carry_state else state
        state, outputs = self._hook(self.end, state, outputs)
        if self._end_actions:
            step_actions.fire(self._end_actions, False, last, state,
                              staging.entry(outputs, count - 1))
        return state, outputs
