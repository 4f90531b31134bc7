"""SimpleStep: a ready-made step for models with one input and one target.

Batches are dicts ``{'input_features': x, 'output_features': y}``. The model is called as
``model.apply(variables, x, train=...)`` and trained with the L2 loss (`loss_fn`). Override
`_get_input_features` / `_get_output_features` for other batch layouts, `loss_fn` for
another loss, or `_predict_and_compute_loss` for anything else.

Example::

    step = SimpleStep(jax.random.key(0), MLP(), optimizer=optax.adam(1e-3))  # trains
    state = step.initialize_model({'input_features': [8, 1], 'output_features': [8, 1]})
    state, outputs = step(state, {'input_features': x, 'output_features': y})
    outputs['loss'].compute()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import clu.metrics as clu_metrics
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxloop import partition, types
from jaxloop import step as step_lib
from jaxloop.state import model as model_lib

Batch = types.Batch
Output = types.Output
State = types.TrainState
PyTree = Any

log = logging.getLogger(__name__)


class SimpleStep(step_lib.Step):
    """Trains (``train=True``) or evaluates a model on ``{'input_features', 'output_features'}``.

    Takes `Step`'s arguments. Without ``train=``, a step given an ``optimizer`` trains and
    one without evaluates: google/jaxloop's SimpleStep, given an optimizer and no
    ``train=``, advanced ``state.step`` on every batch, so code written for it expects
    such a step to move the state on.

    Outputs: ``loss`` (the batch's mean loss as a `clu.metrics.Average`; a loop's outputs
    hold one per step) and ``output_features_pred`` (the model's predictions).

    - Randomness: the model gets ``rngs=self.prng_key(state.step)`` (``{'dropout': key}``
      when `base_prng` is a single key), so dropout masks differ from step to step and a
      resumed run draws the same ones.
    - Mutable statistics (``batch_stats``, e.g. BatchNorm) are updated while training and
      carried in the state; evaluation uses them without changing them.
    - Evaluation never changes the state (google/jaxloop's SimpleStep advanced
      ``state.step`` on every eval batch).
    """

    def __init__(
        self,
        base_prng: types.PRNGType,
        model: Any,
        optimizer: optax.GradientTransformation | None = None,
        partitioner: partition.Partitioner | None = None,
        train: bool | None = None,
        **kwargs: Any,
    ):
        super().__init__(
            base_prng,
            model,
            optimizer=optax.identity() if optimizer is None else optimizer,
            partitioner=partitioner,
            train=optimizer is not None if train is None else train,
            **kwargs,
        )

    # -- batch layout ---------------------------------------------------------------------------

    def _get_input_features(self, batch: Batch | types.BatchSpec) -> PyTree:
        """The model input of a batch (``batch['input_features']``; an array as it is)."""
        if isinstance(batch, jax.Array | jnp.ndarray) or not isinstance(batch, Mapping):
            return batch
        if "input_features" not in batch:
            raise KeyError(
                f"{type(self).__name__} expects batches with an 'input_features' entry, got "
                f"keys {sorted(batch)}; override _get_input_features for other layouts"
            )
        return batch["input_features"]

    def _update_input_features(self, batch: Batch, updated_input_features: PyTree) -> Batch:
        """The batch with its input features replaced (e.g. by `preprocess_batch`)."""
        if not isinstance(batch, Mapping):
            return updated_input_features
        return {**batch, "input_features": updated_input_features}

    def _get_output_features(self, batch: Batch) -> PyTree:
        """The targets of a batch (``batch['output_features']``)."""
        if not isinstance(batch, Mapping) or "output_features" not in batch:
            keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise KeyError(
                f"{type(self).__name__} expects batches with an 'output_features' entry, got "
                f"{keys}; override _get_output_features for other layouts"
            )
        return batch["output_features"]

    # -- model state ----------------------------------------------------------------------------

    def initialize_model(
        self, spec: types.BatchSpec, log_num_params: bool = False, **kwargs: Any
    ) -> State:
        """Initialises the model from the input features of `spec` only.

        Args:
          spec: the batch spec, e.g. ``{'input_features': [8, 3], 'output_features': [8, 1]}``
            (shapes, ``(shape, dtype)`` pairs or dicts of these).
          log_num_params: log the number of parameters.
          **kwargs: keyword arguments for the model's ``init`` (flax linen models), e.g.
            ``train=False``.
        """
        features = self._get_input_features(step_lib.get_zeroed_batch(spec))
        if not kwargs:
            return super().initialize_model(features, log_num_params)
        if not isinstance(self.model, nn.Module):
            raise TypeError(
                f"initialize_model keyword arguments {sorted(kwargs)} go to a flax linen "
                f"module's init; {type(self.model).__name__} is not one"
            )

        def init_fn(inputs: PyTree) -> State:
            variables = self.model.init(model_lib.init_rngs(self._base_prng), inputs, **kwargs)
            return State.create(
                apply_fn=self.model.apply,
                params=variables["params"],
                tx=self.optimizer,
                batch_stats=variables.get("batch_stats"),
            )

        state = self.partitioner.shard_init_fn(init_fn)(features)
        self.compute_num_params(state)
        if log_num_params:
            log.info("Number of parameters: %d", self.num_params)
        return state

    def _rngs(self, state: State) -> dict[str, jax.Array]:
        """Per-step keys for the model: a pure function of (base_prng, state.step)."""
        keys = self.prng_key(state.step)
        return dict(keys) if isinstance(keys, Mapping) else {"dropout": keys}

    # -- computation ----------------------------------------------------------------------------

    def run(self, state: State, batch: Batch) -> tuple[State, Output]:
        """Predicts, computes the loss, and (when training) applies the gradients."""
        input_features = self._get_input_features(batch)
        output_features = self._get_output_features(batch)
        state, loss, output_features_pred = self._predict_and_compute_loss(
            state, input_features, output_features
        )
        return state, {
            "loss": clu_metrics.Average.from_model_output(loss),
            "output_features_pred": output_features_pred,
        }

    def _apply_model(
        self, state: State, params: PyTree, input_features: PyTree
    ) -> tuple[PyTree, PyTree | None]:
        """The model's prediction, and its updated ``batch_stats`` when it has them."""
        variables = {"params": params}
        has_stats = bool(state.batch_stats)
        if has_stats:
            variables["batch_stats"] = state.batch_stats
        kwargs: dict[str, Any] = {"train": self.train, "rngs": self._rngs(state)}
        if has_stats and self.train:
            pred, updates = state.apply_fn(
                variables, input_features, mutable=["batch_stats"], **kwargs
            )
            return pred, updates["batch_stats"]
        return state.apply_fn(variables, input_features, **kwargs), None

    def _loss(
        self, output_features_pred: PyTree, input_features: PyTree, output_features: PyTree
    ) -> jax.Array:
        """The loss of a prediction; `TransformerStep` also needs the input mask."""
        return self.loss_fn(output_features_pred, output_features)

    def _predict_and_compute_loss(
        self, state: State, input_features: PyTree, output_features: PyTree
    ) -> tuple[State, jax.Array, PyTree]:
        """Applies the model and the loss; when training, applies the gradients.

        Returns:
          the state (updated when training, unchanged when evaluating), the loss and the
          predictions.
        """

        def forward(params: PyTree) -> tuple[jax.Array, tuple[PyTree, PyTree | None]]:
            pred, new_stats = self._apply_model(state, params, input_features)
            return self._loss(pred, input_features, output_features), (pred, new_stats)

        if not self.train:
            loss, (pred, _) = forward(state.params)
            return state, loss, pred
        (loss, (pred, new_stats)), grads = jax.value_and_grad(forward, has_aux=True)(
            state.params
        )
        state = state.apply_gradients(grads=grads)
        if new_stats is not None:
            state = state.replace(batch_stats=new_stats)
        return state, loss, pred

    def loss_fn(
        self, output_features_pred: jax.Array, true_output_features: jax.Array
    ) -> jax.Array:
        """The mean L2 loss (``optax.l2_loss``: half the squared error). Override for others."""
        return jnp.mean(optax.l2_loss(output_features_pred, true_output_features))
