"""jaxloop: training loops for JAX.

Write one `Step` (what happens to one batch); jaxloop jits and shards it with a partitioner,
runs it in train and eval loops with checkpoint and summary actions, and orchestrates it all
with an `OuterLoop`. Importing jaxloop never imports TensorFlow.
"""

from jaxloop import partition, step, types
from jaxloop.partition import (
    DataParallelPartitioner,
    FSDPPartitioner,
    Partitioner,
    SingleDevicePartitioner,
    SPMDPartitioner,
)
from jaxloop.step import Step
from jaxloop.types import MetricType, MetricWithMetadata, TrainState

__all__ = [
    "DataParallelPartitioner",
    "FSDPPartitioner",
    "MetricType",
    "MetricWithMetadata",
    "Partitioner",
    "SPMDPartitioner",
    "SingleDevicePartitioner",
    "Step",
    "TrainState",
    "partition",
    "step",
    "types",
]
