"""The state half of a `Step` (which inherits it): building, describing and restoring its
state, and what the state and its compiled step cost (parameters, flops, memory).

Example::

    state = step.initialize_model({'image': [1, 28, 28, 1], 'label': ([1], 'int32')})
    abstract = step.abstract_state([1, 28, 28, 1])
    print(step.memory_estimate({'image': [256, 28, 28, 1], 'label': ([256], 'int32')}))
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from jaxloop import types
from jaxloop.diagnostics import analysis
from jaxloop.diagnostics import memory as memory_lib
from jaxloop.recipes import ema
from jaxloop.state import model_state, specs

Batch = types.Batch
State = types.TrainState

log = logging.getLogger("jaxloop.step")


class StepState:
    """Methods of `Step` about its state."""

    state_class: type[types.TrainState] | None = None
    """The class of the states built (set on a Step subclass or instance): a
    `types.TrainState` subclass whose extra fields have defaults, such as
    ``metrics: Metrics = Metrics.empty()``. None: whatever ``jaxloop.step.State`` names at
    the call (google's notebooks set it)."""

    @property
    def num_params(self) -> int | None:
        """Parameter count, known after `initialize_model` or `compute_num_params`."""
        return self._num_params

    @property
    def num_flops(self) -> float | None:
        """Flops of one step on one device, known after a call with `log_num_flops=True`."""
        return self._num_flops

    def initialize_model(self, spec: types.BatchSpec, log_num_params: bool = False) -> State:
        """Initialises the model and optimizer on the mesh from an example batch spec (only
        its shapes and dtypes matter: any batch size works on any mesh)."""
        state = self._state_builder.initialize(self._partitioner, spec, self._state_class())
        self.compute_num_params(state)
        if log_num_params:
            log.info("Number of parameters: %d", self._num_params)
        return state

    def abstract_state(self, spec: types.BatchSpec, log_num_params: bool = False) -> State:
        """The state `initialize_model` would create as `jax.ShapeDtypeStruct` leaves (no
        device memory): pass it where a state is restored, which then lands in place, or
        without a checkpoint is initialised (`materialize`), as in
        ``step.restore_model(step.abstract_state([1, 28, 28, 1]), ckpt_dir)``."""
        abstract = self._state_builder.abstract(self._partitioner, spec, self._state_class())
        self._abstract_spec = spec
        self.compute_num_params(abstract)
        if log_num_params:
            log.info("Number of parameters: %d", self._num_params)
        return abstract

    def materialize(self, state: State) -> State:
        """`state` if it holds arrays; for an `abstract_state`, the state initialised from
        its spec (ValueError for an abstract state this step did not describe)."""
        if not model_state.is_abstract(state):
            return state
        if self._abstract_spec is None:
            raise ValueError(
                "Cannot initialise an abstract state this step did not describe: create it "
                "with step.abstract_state(spec), or pass step.initialize_model(spec)")
        new = self.initialize_model(self._abstract_spec)
        if isinstance(state, ema.EmaState):  # described as ema.init(step.abstract_state(..))
            new = ema.init(new)
        if jax.tree.structure(new) != jax.tree.structure(state):
            raise ValueError(
                "The abstract state does not match the model this step initialises: "
                f"{jax.tree.structure(state)} vs {jax.tree.structure(new)}")
        return new

    def restore_model(self, state: State, checkpoint_dir: Any, step: int | None = None,
                      transforms: Any = None) -> State:
        """Restores `state` (the latest step unless `step` is given) from the orbax
        checkpoints in `checkpoint_dir`, placed as `state` is (which may be abstract). An eval
        step restores no optimizer state. With no checkpoint, logs so and returns `state`
        (materialized). `transforms`: see `checkpoint.restore`."""
        from jaxloop.checkpointing import checkpoint  # noqa: PLC0415 (orbax is heavy; import when used)

        restored, _ = checkpoint.restore(
            state, checkpoint_dir, step, self._partitioner, skip_optimizer=not self._train,
            transforms=transforms)
        return self.materialize(restored)

    def compute_num_params(self, state: State) -> int:
        """Counts the parameters of `state` (and remembers it as `num_params`)."""
        self._num_params = int(sum(
            int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(state.params)))
        return self._num_params

    def compute_num_flops(self, state: State, batch: Batch, **kwargs: Any) -> float | None:
        """Flops of one `run` on this placed batch on one device (a data-parallel step over
        8 devices: about an eighth), from XLA's cost analysis; None where XLA gives none."""
        self._num_flops = analysis.flops(self._program(), state, batch, kwargs)
        return self._num_flops

    def abstract_batch(self, spec: types.BatchSpec) -> Batch:
        """The global batch of `spec` as `run` receives it, described (`specs.abstract_batch`)."""
        return specs.abstract_batch(self._partitioner, spec)

    def memory_estimate(self, spec: types.BatchSpec, state: State | None = None,
                        **kwargs: Any) -> memory_lib.MemoryEstimate:
        """What one device needs to run this step on a global batch of `spec`, from XLA's
        memory analysis of the step compiled for abstract inputs (nothing is created or run).
        `state` defaults to that of the last `abstract_state` spec (else of `spec`)."""
        if state is None:
            init_spec = self._abstract_spec if self._abstract_spec is not None else spec
            # Not `abstract_state`: an estimate leaves the step's bookkeeping as it was.
            state = self._state_builder.abstract(self._partitioner, init_spec,
                                                  self._state_class())
        with self.donating_state():  # as a loop runs it
            program = self._program()
        return analysis.memory(
            program, state, self.abstract_batch(spec), kwargs, self._partitioner.mesh.devices)
