"""jaxloop: training loops for JAX.

Write one `Step` (what happens to one batch); jaxloop jits and shards it with a partitioner,
runs it in train and eval loops with checkpoint and summary actions, and orchestrates it all
with an `OuterLoop`. Importing jaxloop never imports TensorFlow.

Example::

    from jaxloop import step as step_lib, partition, train_loop, eval_loop, outer_loop
"""

import importlib
import sys
from typing import TYPE_CHECKING, Any

# Every name below is imported on first use (PEP 562 `__getattr__`), so `import jaxloop.step`
# loads the step and what it needs, not the loops, actions, checkpointing (orbax) or data
# (grain) modules. `from jaxloop import X` and `jaxloop.X` work as with eager imports.
# The exported names that are not submodules, by the submodule that defines them:
_NAMES = {
    "Action": "actions",
    "CheckpointAction": "checkpoint_actions",
    "EarlyStoppingAction": "actions",
    "ProgressAction": "progress",
    "StepNumberAction": "actions",
    "SummaryAction": "actions",
    "EvalLoop": "eval_loop",
    "Loop": "loop",
    "STOP_LOOP": "outer_loop",
    "CheckpointSpec": "outer_loop",
    "EvalContext": "outer_loop",
    "EvalSpec": "outer_loop",
    "OuterLoop": "outer_loop",
    "DataParallelPartitioner": "partition",
    "FSDPPartitioner": "partition",
    "Partitioner": "partition",
    "SingleDevicePartitioner": "partition",
    "SPMDPartitioner": "partition",
    "Step": "step",
    "MetricMonitoringStopHandler": "stop_handler",
    "StopTrainingError": "stop_handler",
    "TrainLoop": "train_loop",
    "MetricType": "types",
    "MetricWithMetadata": "types",
    "TrainState": "types",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` imports
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
    from jaxloop.actions import Action, EarlyStoppingAction, StepNumberAction, SummaryAction
    from jaxloop.checkpoint_actions import CheckpointAction
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
    from jaxloop.progress import ProgressAction
    from jaxloop.step import Step
    from jaxloop.stop_handler import MetricMonitoringStopHandler, StopTrainingError
    from jaxloop.train_loop import TrainLoop
    from jaxloop.types import MetricType, MetricWithMetadata, TrainState


def __getattr__(name: str) -> Any:
    """Imports an exported submodule or name when first used (PEP 562)."""
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    elif name in __all__:  # the other exported names are submodules
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"

if "ipykernel" in sys.modules:  # a notebook: show the INFO lines a user asks for
    importlib.import_module(f"{__name__}.notebook_logging").show_info_if_unconfigured()

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
