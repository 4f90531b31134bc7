"""TransformerStep: a SimpleStep for causal language models.

Batches (as `TransformerDataLoader` makes them)::

    {'input_features': {'input_ids': int[batch, seq], 'attention_mask': int[batch, seq]},
     'output_features': {'labels': int[batch, seq]}}

The model is called with the whole ``input_features`` dict and returns logits
``[batch, seq, vocab]``.

Example::

    step = TransformerStep(jax.random.key(0), TinyLM(), optimizer=optax.adam(1e-3), train=True)
    state = step.initialize_model({'input_features': {'input_ids': ([4, 16], 'int32'),
                                                      'attention_mask': ([4, 16], 'int32')}})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxloop import types
from jaxloop.trainers import simple_step

Array = jax.Array
PyTree = Any
State = types.TrainState


class TransformerStep(simple_step.SimpleStep):
    """Trains or evaluates a causal LM with a masked softmax cross-entropy.

    The loss is the mean over real (unmasked) target tokens; 0 when every token is masked.
    With ``shift_labels`` (the default) the logits at position t are scored against the
    label at t + 1 -- the next token, as for Hugging Face causal LMs whose labels equal
    their input ids (google/jaxloop's TransformerStep scored position t against token t,
    which a causal model learns by copying its input). Set ``shift_labels = False`` in a
    subclass for models that shift themselves.
    """

    shift_labels: bool = True

    def _get_input_features(self, batch: Any) -> PyTree:
        if not isinstance(batch, Mapping) or "input_features" not in batch:
            raise ValueError(
                "TransformerStep expects batches {'input_features': {'input_ids', "
                "'attention_mask'}, 'output_features': {'labels'}}, got "
                f"{sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__}"
            )
        return batch["input_features"]

    def _get_output_features(self, batch: Any) -> PyTree:
        if not isinstance(batch, Mapping) or "output_features" not in batch:
            raise ValueError(
                "TransformerStep expects batches with 'output_features': {'labels': ...}, got "
                f"{sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__}"
            )
        return batch["output_features"]

    def _validate_input_features(self, input_features: Any) -> None:
        """Raises ValueError unless `input_features` has 'input_ids' and 'attention_mask'."""
        if not isinstance(input_features, Mapping):
            raise ValueError(
                "TransformerStep: input_features must be a dict with 'input_ids' and "
                f"'attention_mask', got {type(input_features).__name__}"
            )
        missing = {"input_ids", "attention_mask"} - set(input_features)
        if missing:
            raise ValueError(
                f"TransformerStep: input_features is missing {sorted(missing)}; it needs "
                f"'input_ids' and 'attention_mask' (got {sorted(input_features)})"
            )

    def _validate_output_features(self, output_features: Any) -> None:
        """Raises ValueError unless `output_features` has 'labels'."""
        if not isinstance(output_features, Mapping) or "labels" not in output_features:
            got = (sorted(output_features) if isinstance(output_features, Mapping)
                   else type(output_features).__name__)
            raise ValueError(
                f"TransformerStep: output_features must be a dict with 'labels', got {got}"
            )

    def loss_fn(
        self, logits: jax.Array, labels: jax.Array, attention_mask: jax.Array
    ) -> jax.Array:
        """Masked softmax cross-entropy, averaged over positions where the mask is 1.

        Labels at masked positions (e.g. `data_loader.PADDING_TOKEN`) are ignored.
        """
        if self.shift_labels:
            logits, labels, attention_mask = logits[:, :-1], labels[:, 1:], attention_mask[:, 1:]
        mask = attention_mask.astype(jnp.float32)
        safe_labels = jnp.where(attention_mask > 0, labels, 0)
        token_losses = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), safe_labels
        )
        return jnp.sum(token_losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    def _loss(self, logits: PyTree, input_features: PyTree, output_features: PyTree) -> jax.Array:
        return self.loss_fn(logits, output_features["labels"], input_features["attention_mask"])

    def _predict_and_compute_loss(
        self, state: State, input_features: PyTree, output_features: PyTree
    ) -> tuple[State, jax.Array, PyTree]:
        self._validate_input_features(input_features)
        self._validate_output_features(output_features)
        return super()._predict_and_compute_loss(state, input_features, output_features)
