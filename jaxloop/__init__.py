"""jaxloop: training loops for JAX.

Write one `Step` (what happens to one batch); jaxloop jits and shards it with a partitioner,
runs it in train and eval loops with checkpoint and summary actions, and orchestrates it all
with an `OuterLoop`. Importing jaxloop never imports TensorFlow.

Example::

    from jaxloop import step as step_lib, partition, train_loop, eval_loop, outer_loop
"""

import sys

from jaxloop import (
    action_loop,
    actions,
    async_action_context,
    checkpoint,
    eval_loop,
    history,
    loop,
    notebook_logging,
    outer_loop,
    partition,
    stat_loop,
    step,
    step_number_writer,
    stop_handler,
    train_loop,
    trainers,
    types,
    writers,
)
from jaxloop.actions import (
    Action,
    CheckpointAction,
    EarlyStoppingAction,
    ProgressAction,
    StepNumberAction,
    SummaryAction,
)
from jaxloop.eval_loop import EvalLoop
from jaxloop.loop import Loop
from jaxloop.outer_loop import STOP_LOOP, CheckpointSpec, EvalContext, EvalSpec, OuterLoop
from jaxloop.partition import (
    DataParallelPartitioner,
    FSDPPartitioner,
    Partitioner,
    SingleDevicePartitioner,
    SPMDPartitioner,
)
from jaxloop.step import Step
from jaxloop.stop_handler import MetricMonitoringStopHandler, StopTrainingError
from jaxloop.train_loop import TrainLoop
from jaxloop.types import MetricType, MetricWithMetadata, TrainState

__version__ = "0.1.0"

if "ipykernel" in sys.modules:  # a notebook: show the INFO lines a user asks for
    notebook_logging.show_info_if_unconfigured()

__all__ = [
    "STOP_LOOP",
    "Action",
    "CheckpointAction",
    "CheckpointSpec",
    "DataParallelPartitioner",
    "EarlyStoppingAction",
    "EvalContext",
    "EvalLoop",
    "EvalSpec",
    "FSDPPartitioner",
    "Loop",
    "MetricMonitoringStopHandler",
    "MetricType",
    "MetricWithMetadata",
    "OuterLoop",
    "Partitioner",
    "ProgressAction",
    "SPMDPartitioner",
    "SingleDevicePartitioner",
    "Step",
    "StepNumberAction",
    "StopTrainingError",
    "SummaryAction",
    "TrainLoop",
    "TrainState",
    "action_loop",
    "actions",
    "async_action_context",
    "checkpoint",
    "eval_loop",
    "history",
    "loop",
    "notebook_logging",
    "outer_loop",
    "partition",
    "stat_loop",
    "step",
    "step_number_writer",
    "stop_handler",
    "train_loop",
    "trainers",
    "types",
    "writers",
]
