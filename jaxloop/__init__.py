"""jaxloop: training loops for JAX.

Write one `Step` (what happens to one batch); jaxloop jits and shards it with a partitioner,
runs it in train and eval loops with checkpoint and summary actions, and orchestrates it all
with an `OuterLoop`. Importing jaxloop never imports TensorFlow.

Example::

    from jaxloop import step as step_lib, partition, train_loop, eval_loop, outer_loop
"""

import importlib
import sys
from typing import Any

# The one list of exported names, each by its submodule (a submodule by itself), imported
# on first use (PEP 562): `import jaxloop.step` loads neither orbax nor grain.
_EXPORTS = {name: module for module, names in (
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
) for name in names} | {module: module for module in (
    # the google/jaxloop modules
    "action_loop", "actions", "async_action_context", "eval_loop", "loop", "outer_loop",
    "partition", "pipeline_loop", "stat_loop", "step", "step_number_writer", "stop_handler",
    "train_loop", "trainers", "types",
    # the concerns beneath them
    "checkpointing", "data", "diagnostics", "engine", "launch", "metrics", "orchestration",
    "recipes", "sharding", "state", "hooks",
)}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Imports an exported submodule or name when first used (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    value = module if _EXPORTS[name] == name else getattr(module, name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"

if "ipykernel" in sys.modules:  # a notebook: show the INFO lines a user asks for
    importlib.import_module(f"{__name__}.metrics.notebook_logging").show_info_if_unconfigured()
