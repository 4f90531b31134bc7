"""Types shared across jaxloop: the training state, batch and output aliases, metric metadata."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
from flax.training import train_state

Batch = Any
"""One batch: any pytree of arrays (dicts, tuples, namedtuples, dataclasses)."""

Output = dict[str, Any]
"""What a step or a loop returns beside the state: metric name -> value."""

Shape = Sequence[int]
BatchSpec = Shape | tuple[Shape, Any] | Mapping[str, Any]
"""The shape of an example batch for `Step.initialize_model`.

Either a shape (``[1, 28, 28, 1]``, float32), a ``(shape, dtype)`` pair, or a nested dict,
list or tuple of these.
"""

PRNGType = jax.Array | Mapping[str, jax.Array]
"""A PRNG key, or a dict of named keys such as ``{'dropout': key}``."""

Scalar = int | float | jax.Array


class TrainState(train_state.TrainState):
    """flax's TrainState plus the model's mutable collections: arrays only, since the whole
    state enters jit. Host data (the data iterator's position, loop counters) is saved
    beside it in each checkpoint (see `jaxloop.checkpoint`).

    Attributes:
      batch_stats: non-parameter model variables (linen ``batch_stats``, nnx ``BatchStat``
        and other non-``Param`` state), or None.
    """

    batch_stats: Any = None


class MetricType(enum.Enum):
    """How a summary writer should record a value."""

    SCALAR = "scalar"
    IMAGE = "image"
    HISTOGRAM = "histogram"
    TEXT = "text"
    AUDIO = "audio"
    VIDEO = "video"


@flax.struct.dataclass
class MetricWithMetadata:
    """A step output that says how it should be written.

    The value is a pytree leaf that may be traced inside a jitted step; the type and
    metadata are static. Plain outputs (without this wrapper) are written as scalars.

    Example::

        return state, {
            'loss': loss,
            'inputs': MetricWithMetadata(images, MetricType.IMAGE),
            'logits': MetricWithMetadata(logits, MetricType.HISTOGRAM),
        }
    """

    value: Any
    type: MetricType = flax.struct.field(pytree_node=False, default=MetricType.SCALAR)
    metadata: tuple[tuple[str, Any], ...] = flax.struct.field(pytree_node=False, default=())

    @property
    def metric_type(self) -> MetricType:
        return self.type
