"""jaxloop: training loops for JAX.

Write one `Step` (what happens to one batch); jaxloop jits and shards it with a partitioner,
runs it in train and eval loops with checkpoint and summary actions, and orchestrates it all
with an `OuterLoop`. Importing jaxloop never imports TensorFlow.

Example::

    from jaxloop import step as step_lib, partition, train_loop, eval_loop, outer_loop
"""

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

# Names are imported on first use (PEP 562), so `import jaxloop.step` loads neither orbax
# nor grain. The exported names that are not submodules, by their defining submodule:
_NAMES = {name: module for module, names in (
    ("actions", ("Action", "EarlyStoppingAction", "StepNumberAction", "SummaryAction")),
    ("checkpointing.checkpoint_actions", ("CheckpointAction",)),
    ("metrics.progress", ("ProgressAction",)),
    ("eval_loop", ("EvalLoop",)),
    ("loop", ("Loop",)),
    ("outer_loop", ("STOP_LOOP", "CheckpointSpec", "EvalContext", "EvalSpec", "OuterLoop")),
    ("partition", ("DataParallelPartitioner", "FSDPPartitioner", "Partitioner",
                   "SingleDevicePartitioner", "SPMDPartitioner")),
    ("step", ("Step",)),
    ("stop_handler", ("MetricMonitoringStopHandler", "StopTrainingError")),
    ("train_loop", ("TrainLoop",)),
    ("types", ("MetricType", "MetricWithMetadata", "TrainState")),
) for name in names}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` imports
    from jaxloop import (
        action_loop,
        actions,
        async_action_context,
        checkpointing,
        data,
        diagnostics,
        engine,
        eval_loop,
        launch,
        loop,
        metrics,
        orchestration,
        outer_loop,
        partition,
        pipeline_loop,
        recipes,
        stat_loop,
        state,
        step,
        step_number_writer,
        stop_handler,
        train_loop,
        trainers,
        types,
    )
    from jaxloop.actions import Action, EarlyStoppingAction, StepNumberAction, SummaryAction
    from jaxloop.checkpointing.checkpoint_actions import CheckpointAction
    from jaxloop.eval_loop import EvalLoop
    from jaxloop.loop import Loop
    from jaxloop.metrics.progress import ProgressAction
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


def __getattr__(name: str) -> Any:
    """Imports an exported submodule or name when first used (PEP 562)."""
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    elif name in __all__:  # the other exported names are submodules
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        for concern in _CONCERNS:  # a module of an earlier release, now in a concern's folder
            if importlib.util.find_spec(f"{__name__}.{concern}.{name}") is not None:
                # An ImportError, which `from jaxloop import name` shows as it is.
                raise ImportError(f"jaxloop.{name} is now jaxloop.{concern}.{name}: write "
                                  f"`from jaxloop.{concern} import {name}`", name=name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"

if "ipykernel" in sys.modules:  # a notebook: show the INFO lines a user asks for
    importlib.import_module(f"{__name__}.metrics.notebook_logging").show_info_if_unconfigured()

__all__ = [
    "STOP_LOOP", "Action", "CheckpointAction", "CheckpointSpec", "DataParallelPartitioner",
    "EarlyStoppingAction", "EvalContext", "EvalLoop", "EvalSpec", "FSDPPartitioner", "Loop",
    "MetricMonitoringStopHandler", "MetricType", "MetricWithMetadata", "OuterLoop", "Partitioner",
    "ProgressAction", "SPMDPartitioner", "SingleDevicePartitioner", "Step", "StepNumberAction",
    "StopTrainingError", "SummaryAction", "TrainLoop", "TrainState",
    # the google/jaxloop modules
    "action_loop", "actions", "async_action_context", "eval_loop", "loop", "outer_loop",
    "partition", "pipeline_loop", "stat_loop", "step", "step_number_writer", "stop_handler",
    "train_loop", "trainers", "types",
    # the concerns beneath them
    "checkpointing", "data", "diagnostics", "engine", "launch", "metrics", "orchestration",
    "recipes", "state",
]
_CONCERNS = __all__[__all__.index("checkpointing"):]
