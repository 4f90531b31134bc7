"""The train state of a model and optimizer, made by `StateBuilder` through a partitioner
(born in place on the mesh, or only described); `Step`'s state methods are its front::

    builder = StateBuilder(model.adapt(CNN()), optax.adam(1e-3), 'bfloat16', jax.random.key(0))
    state = builder.initialize(partitioner, [1, 28, 28, 1])
    abstract = builder.abstract(partitioner, [1, 28, 28, 1])  # ShapeDtypeStruct leaves
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import optax

from jaxloop import types
from jaxloop.recipes import precision as precision_lib
from jaxloop.state import model as model_lib
from jaxloop.state import specs as specs_lib

State = types.TrainState


def is_abstract(state: Any) -> bool:
    """Whether `state` only describes arrays (`jax.ShapeDtypeStruct` leaves)."""
    leaves = jax.tree.leaves(state)
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def count_params(state: State) -> int:
    """The number of parameters in ``state.params``."""
    return int(sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(state.params)))


def materialize(state: State, spec: types.BatchSpec | None,
                initialize: Callable[[types.BatchSpec], State]) -> State:
    """`state` if it holds arrays; for an abstract one, ``initialize(spec)``, made the
    abstract state's class through its ``from_state`` where it has one (`ema.EmaState`)."""
    if not is_abstract(state):
        return state
    if spec is None:
        raise ValueError(
            "Cannot initialise an abstract state this step did not describe: create it "
            "with step.abstract_state(spec), or pass step.initialize_model(spec)")
    new = initialize(spec)
    from_state = getattr(type(state), "from_state", None)
    if type(new) is not type(state) and from_state is not None:
        new = from_state(new)
    if jax.tree.structure(new) != jax.tree.structure(state):
        raise ValueError(
            "The abstract state does not match the model this step initialises: "
            f"{jax.tree.structure(state)} vs {jax.tree.structure(new)}")
    return new


def restore(state: State, checkpoint_dir: Any, step: int | None, partitioner: Any,
            skip_optimizer: bool, transforms: Any = None) -> State:
    """`state` restored from `checkpoint_dir` (`checkpoint.restore`), else as it is."""
    from jaxloop.checkpointing import checkpoint  # noqa: PLC0415 (orbax is heavy; import when used)

    return checkpoint.restore(state, checkpoint_dir, step, partitioner,
                              skip_optimizer=skip_optimizer, transforms=transforms)[0]


def _spec_call(shape: tuple, dtype: Any) -> str:
    """One leaf's spec for one example, with its dtype unless float32 (a bare shape's)."""
    example = [1, *shape[1:]]
    if dtype == np.float32:
        return f"initialize_model({example})"
    return f"initialize_model(({example}, {dtype.name!r}))"


@contextlib.contextmanager
def _model_input_spec(spec: types.BatchSpec, batch: Any,
                      abstract_init: Callable[[Any], Any]) -> Iterator[None]:
    """Names the mistake when a whole batch was given where the model's input is wanted
    (flax fails deep inside), or a bare shape where the model takes int32 token ids."""
    try:
        yield
    except (AttributeError, TypeError, ValueError) as e:
        if specs_lib.is_shape(spec) and spec:
            with contextlib.suppress(Exception):  # any failure: the hint would not help
                abstract_init(np.zeros(spec, np.int32))
                e.add_note(
                    f"initialize_model({list(spec)}) builds float32 zeros; a model that takes "
                    f"integer inputs (token ids) wants the dtype beside the shape: "
                    f"initialize_model(({list(spec)}, 'int32')).")
            raise
        if not isinstance(spec, Mapping):
            raise
        arrays = {k: v for k, v in batch.items() if isinstance(v, np.ndarray)}
        shapes = {k: (v.shape, v.dtype.name) if k in arrays else () for k, v in batch.items()}
        examples = "; ".join(f"for {k!r}: {_spec_call(v.shape, v.dtype)}"
                             for k, v in arrays.items() if v.ndim)
        raise TypeError(
            f"The model could not be initialised from the spec {shapes}: a dict with keys "
            f"{sorted(batch)} looks like a whole batch (labels included). initialize_model "
            "and abstract_state want the spec of the model's input, the array the step "
            f"passes to apply_fn ({examples}); diagnostics.memory.estimate is the one that "
            f"takes the whole batch's spec. (The model raised {type(e).__name__}: {e})"
        ) from e


class StateBuilder:
    """Makes the `TrainState` of a model and an optimizer; a mixed-precision `policy` (a
    `precision.Policy`, a string `precision.get_policy` reads, or None) wraps ``apply_fn``
    and sets the parameters' dtype."""

    def __init__(self, adapter: model_lib.ModelAdapter, optimizer: optax.GradientTransformation,
                 policy: precision_lib.Policy | str | None, base_prng: types.PRNGType):
        self.adapter = adapter  # an NNX-native `run` gets the model merged by it
        self._optimizer = optimizer
        self.policy = policy = precision_lib.get_policy(policy)
        self._base_prng = base_prng
        # Wrapped once: the state keeps apply_fn in its tree structure.
        self._apply_fn = adapter.apply if policy is None else policy.wrap_apply(adapter.apply)

    def create(self, batch: types.Batch, variables: Any = None,
               state_class: type[State] = State) -> State:
        """The `state_class` state for this example batch (traced by `initialize`)."""
        if variables is None:
            variables = self.adapter.init(self._base_prng, batch)
        params = variables["params"]
        if self.policy is not None:
            params = self.policy.cast_to_param(params)
        return state_class.create(apply_fn=self._apply_fn, params=params, tx=self._optimizer,
                            batch_stats=variables.get("batch_stats"))

    def initialize(self, partitioner: Any, spec: types.BatchSpec,
                   state_class: type[State] = State) -> State:
        """The state, each leaf created where `partitioner` places it; the spec only fixes
        shapes and dtypes, so its batch size need not divide by the device count."""
        batch = specs_lib.zeros_from_spec(spec)
        create = functools.partial(self.create, state_class=state_class)
        held = self.adapter.held_variables()
        if held is None:
            with _model_input_spec(spec, batch, partitioner.abstract_init_fn(create)):
                return partitioner.shard_init_fn(create)(batch)
        # An nnx instance's values go to their place and enter as arguments, not constants.
        held = jax.device_put(held, partitioner.state_shardings(held))
        return partitioner.shard_init_fn(create)(batch, held)

    def abstract(self, partitioner: Any, spec: types.BatchSpec,
                 state_class: type[State] = State) -> State:
        """The state `initialize` would make, as sharded `jax.ShapeDtypeStruct` leaves."""
        abstract_init = partitioner.abstract_init_fn(
            functools.partial(self.create, state_class=state_class))
        batch = specs_lib.zeros_from_spec(spec)
        with _model_input_spec(spec, batch, abstract_init):
            return abstract_init(batch)
