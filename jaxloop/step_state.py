"""The state half of a `Step`: building, describing and restoring the state it trains, and
what the state and its compiled step cost (parameters, flops, memory).

`Step` inherits these methods; they use the step's model, optimizer, partitioner and
compiled program, and never run a step.

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

from jaxloop import analysis, ema, model_state, specs, types
from jaxloop import memory as memory_lib

Batch = types.Batch
State = types.TrainState

log = logging.getLogger("jaxloop.step")


class StepState:
    """Methods of `Step` about its state (see the module docstring)."""

    state_class: type[types.TrainState] | None = None
    """The class of the states `initialize_model` and `abstract_state` build: a subclass of
    `types.TrainState` whose extra fields have defaults (clu metrics, counters), set on your
    Step subclass or on an instance. None: whatever ``jaxloop.step.State`` names at the time
    of the call, as google/jaxloop's notebooks set it.

    Example::

        class MetricsState(types.TrainState):
            metrics: Metrics = Metrics.empty()

        class MyStep(step_lib.Step):
            state_class = MetricsState
    """

    @property
    def num_params(self) -> int | None:
        """Parameter count, known after `initialize_model` or `compute_num_params`."""
        return self._num_params

    @property
    def num_flops(self) -> float | None:
        """Flops of one step on one device, known after a call with `log_num_flops=True`
        (see `compute_num_flops`)."""
        return self._num_flops

    # -- model state --------------------------------------------------------------------------

    def _state_class(self) -> type[types.TrainState]:
        return self.state_class or State

    def initialize_model(self, spec: types.BatchSpec, log_num_params: bool = False) -> State:
        """Initialises the model and optimizer from an example batch spec, placed on the mesh.

        The spec only fixes shapes and dtypes (a zero batch is built), so its batch size need
        not divide by the device count: ``initialize_model([1, 28, 28, 1])`` works on any
        mesh.

        Example::

            state = step.initialize_model({'image': [1, 28, 28, 1], 'label': ([1], 'int32')})
        """
        state = self._state_builder.initialize(self._partitioner, spec, self._state_class())
        self.compute_num_params(state)
        if log_num_params:
            log.info("Number of parameters: %d", self._num_params)
        return state

    def abstract_state(self, spec: types.BatchSpec, log_num_params: bool = False) -> State:
        """The state `initialize_model` would create, described but not built: each leaf a
        `jax.ShapeDtypeStruct` with its shape, dtype and sharding (no device memory used).

        Pass it where a state is restored (`restore_model`, `OuterLoop`,
        `checkpoint.restore`): the checkpoint lands straight in place, and without one the
        state is initialised from this step (`materialize`).

        Example::

            state = step.restore_model(step.abstract_state([1, 28, 28, 1]), ckpt_dir)
        """
        abstract = self._state_builder.abstract(self._partitioner, spec, self._state_class())
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
        if not model_state.is_abstract(state):
            return state
        if self._abstract_spec is None:
            raise ValueError(
                "Cannot initialise an abstract state this step did not describe: create it "
                "with step.abstract_state(spec), or pass step.initialize_model(spec)"
            )
        new = self.initialize_model(self._abstract_spec)
        if isinstance(state, ema.EmaState):  # described as ema.init(step.abstract_state(..))
            new = ema.init(new)
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
        """Restores `state` (the latest step unless `step` is given) from the orbax
        checkpoints in `checkpoint_dir`, each array placed as the given state's is.

        `state` may be abstract (`abstract_state`): the checkpoint is read straight into
        place, and with no checkpoint the state is initialised (`materialize`). An eval step
        (``train=False``) restores no optimizer state. With no checkpoint, logs "No
        checkpoint found in <dir>" and returns `state`. `transforms`: orbax restore
        transforms (see `checkpoint.restore`).

        Example::

            state = step.restore_model(step.initialize_model(spec), workdir / 'checkpoints')
        """
        from jaxloop import checkpoint  # noqa: PLC0415 (orbax is heavy; import when used)

        restored, _ = checkpoint.restore(
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

    def compute_num_flops(self, state: State, batch: Batch, **kwargs: Any) -> float | None:
        """Flops of one `run` on this (placed) batch on one device, from XLA's cost
        analysis of the compiled step (`analysis.flops`): a data-parallel step over 8
        devices reports about an eighth of the single-device figure. None where XLA gives
        none. Compiles the step ahead of time once for the analysis.
        """
        self._num_flops = analysis.flops(self._program(), state, batch, kwargs)
        return self._num_flops

    def abstract_batch(self, spec: types.BatchSpec) -> Batch:
        """The global batch of `spec` as `run` receives it, described but not built (see
        `specs.abstract_batch`)."""
        return specs.abstract_batch(self._partitioner, spec)

    def memory_estimate(
        self, spec: types.BatchSpec, state: State | None = None, **kwargs: Any
    ) -> memory_lib.MemoryEstimate:
        """What one device needs to run this step on a global batch of `spec` (as `run`
        receives it), from XLA's memory analysis of the step compiled for an abstract state
        and batch: nothing is created or run, so an out-of-memory is found before a job is
        scheduled. `state` defaults to the state of the last `abstract_state` spec (else of
        `spec`); `kwargs` go to `run`.

        Example::

            state = step.abstract_state([1, 28, 28, 1])
            print(step.memory_estimate({'image': [256, 28, 28, 1],
                                        'label': ([256], 'int32')}, state))
        """
        if state is None:
            init_spec = self._abstract_spec if self._abstract_spec is not None else spec
            # Not `abstract_state`: an estimate leaves the step's bookkeeping as it was.
            state = self._state_builder.abstract(self._partitioner, init_spec,
                                                  self._state_class())
        with self.donating_state():  # as a loop runs it
            program = self._program()
        return analysis.memory(
            program, state, self.abstract_batch(spec), kwargs,
            self._partitioner.mesh.devices,
        )
