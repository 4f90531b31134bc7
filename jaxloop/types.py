"""Types shared across jaxloop: the training state, batch and output aliases, metric metadata."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics as clu_metrics
from flax.training import train_state

Batch = Any
"""One batch: any pytree of arrays (dicts, tuples, namedtuples, dataclasses)."""

Output = dict[str, Any]
"""What a step or a loop returns beside the state: metric name -> value."""

Array = np.ndarray | jax.Array
"""A host (numpy) or device (jax) array."""

Shape = Sequence[int]
DType = jnp.dtype
BatchShape = Shape | Mapping[str, Shape]
"""An example batch's shape, or a dict of them."""

BatchSpec = Shape | tuple[Shape, Any] | Mapping[str, Any]
"""An example batch's shape (float32), ``(shape, dtype)`` pair, or a dict/list/tuple of these."""

PRNGType = jax.Array | Mapping[str, jax.Array]
"""A PRNG key, or a dict of named keys such as ``{'dropout': key}``."""

Scalar = int | float | np.number | np.ndarray | jax.Array

IterateStopFn = Callable[[], bool]
"""`CheckpointSpec.iterate_stop_fn`: called with no argument, True ends continuous eval."""

CluMetricType = clu_metrics.Metric | clu_metrics.Collection
"""A step output that loops merge over steps (`loop.MetricList`)."""


class TrainState(train_state.TrainState):
    """flax's TrainState plus `batch_stats`, the model's non-parameter variables (or None)."""

    batch_stats: Any = None


class MetricType(enum.Enum):
    """How a summary writer should record a value."""

    SCALAR = "scalar"
    IMAGE = "image"
    HISTOGRAM = "histogram"
    TEXT = "text"
    AUDIO = "audio"
    VIDEO = "video"
    OTHER = "other"
    """For a consumer of its own: `metadata` says what it is (summaries refuse it)."""


@flax.struct.dataclass
class MetricWithMetadata:
    """A step output that says how it should be written (plain outputs are scalars)::

        return state, {'loss': loss, 'inputs': MetricWithMetadata(images, MetricType.IMAGE)}
    """

    value: Any
    type: MetricType = flax.struct.field(pytree_node=False, default=MetricType.SCALAR)
    metadata: tuple[tuple[str, Any], ...] = flax.struct.field(pytree_node=False, default=())

    @property
    def metric_type(self) -> MetricType:
        return self.type


MetricsDict = dict[str, Scalar | Array | MetricWithMetadata]
"""A step's metrics: name -> scalar, array or `MetricWithMetadata`."""
