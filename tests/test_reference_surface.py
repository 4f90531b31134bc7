"""Every public name google/jaxloop's modules define exists in the module of the same name
here, and the names whose meaning is behaviour behave as there.

`REFERENCE_NAMES` is taken from google/jaxloop's source at snapshot `REFERENCE_COMMIT`: each
module's public top-level classes, functions and assignments (its tests, examples and
``__init__`` left out). To refresh it, fetch ``github:google/jaxloop``, ``git archive`` its
newest commit into a directory and print the new list with::

    .venv/bin/python tests/test_reference_surface.py /path/to/google-jaxloop
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib
import pathlib
import sys
import threading
import time

import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

REFERENCE_COMMIT = "d1bac45a77c4cf3b852c69ef9fe53e04161b0cbf"

REFERENCE_NAMES = {
    "jaxloop.action_loop": ["Action", "Output", "State", "Step", "ActionLoop"],
    "jaxloop.actions": [
        "MetricMonitoringStopHandler", "StopTrainingError", "Output", "State", "Scalar",
        "PyTree", "ApplyFn", "MetricWithMetadata", "MetricType", "Action", "SummaryAction",
        "CheckpointAction", "StepNumberAction", "EarlyStoppingAction"],
    "jaxloop.async_action_context": [
        "Future", "MutexLock", "AsyncActionContext", "get_async_action_context"],
    "jaxloop.constants": ["DEFAULT_SIGNATURE_KEY"],
    "jaxloop.eval_loop": ["Loop", "State", "Step", "EvalLoop"],
    "jaxloop.loop": ["Output", "State", "Step", "Loop"],
    "jaxloop.outer_loop": [
        "Loop", "Output", "State", "Step", "STAT_PREFIX", "STOP_LOOP", "EvalContext",
        "ShouldEvalFn", "EvalSpec", "CheckpointSpec", "OuterLoop"],
    "jaxloop.partition": [
        "Batch", "TrainState", "Partitioner", "SingleDevicePartitioner",
        "DataParallelPartitioner", "SPMDPartitioner"],
    "jaxloop.pipeline_loop": ["State", "Step", "PipelineLoop"],
    "jaxloop.stat_loop": [
        "Loop", "Output", "State", "Step", "STAT_PREFIX", "STAT_NUM_PARAMS", "STAT_NUM_FLOPS",
        "STAT_INIT_TIME", "STAT_BEGIN_TIME", "STAT_LIFE_TIME_SECS", "STAT_LOOP_TIME_SECS",
        "STAT_STEPS_PER_SEC", "STAT_EXAMPLES_PER_SEC", "StatLoop"],
    "jaxloop.step": ["DType", "Batch", "BatchSpec", "Output", "State", "get_zeroed_batch",
                     "Step"],
    "jaxloop.step_number_writer.local_file_step_number_writer": ["LocalFileStepNumberWriter"],
    "jaxloop.step_number_writer.step_number_writer": ["StepNumberWriter"],
    "jaxloop.stop_handler": ["StopTrainingError", "MetricMonitoringStopHandler"],
    "jaxloop.train_loop": ["Loop", "Output", "State", "Step", "TrainLoop"],
    "jaxloop.trainers.data_loader": [
        "NestedBatch", "PADDING_TOKEN", "TrainerDataLoader", "SimpleDataLoader",
        "TransformerDataLoader"],
    "jaxloop.trainers.data_preprocessor": ["Batch", "DataPreprocessor",
                                           "DataPreprocessorBuilder"],
    "jaxloop.trainers.simple_step": ["SimpleStep"],
    "jaxloop.trainers.simple_trainer": ["SimpleTrainer"],
    "jaxloop.trainers.trainer_utils": ["TrainerBatchSpec", "CheckpointingConfig",
                                       "SummaryConfig"],
    "jaxloop.trainers.transformer_step": ["Array", "PyTree", "TransformerStep"],
    "jaxloop.types": [
        "MetricType", "Array", "Scalar", "PRNGType", "MetricWithMetadata", "Batch", "Output",
        "Shape", "DType", "BatchShape", "BatchSpec", "MetricsDict", "CluMetricType",
        "IterateStopFn", "TrainState"],
}


def reference_names(snapshot: str | pathlib.Path) -> dict[str, list[str]]:
    """The public top-level names of each module of a google/jaxloop checkout."""
    src = pathlib.Path(snapshot) / "src"
    names = {}
    for path in sorted((src / "jaxloop").rglob("*.py")):
        if (path.name.endswith("_test.py") or path.name == "__init__.py"
                or {"tests", "examples"} & set(path.parts)):
            continue
        defined = []
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.append(node.name)
            elif isinstance(node, ast.Assign):
                defined += [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.append(node.target.id)
        module = ".".join(path.relative_to(src).with_suffix("").parts)
        names[module] = [n for n in defined if not n.startswith("_")]
    return names


@pytest.mark.parametrize("module", sorted(REFERENCE_NAMES))
def test_every_public_name_of_the_reference_module_resolves_here(module):
    here = importlib.import_module(module)
    missing = [n for n in REFERENCE_NAMES[module] if not hasattr(here, n)]
    assert not missing, f"{module} lacks google/jaxloop's {missing}"


def test_the_aliases_mean_what_they_mean_there():
    from jaxloop import (
        action_loop,
        actions,
        async_action_context,
        constants,
        eval_loop,
        loop,
        outer_loop,
        partition,
        pipeline_loop,
        stat_loop,
        train_loop,
        types,
    )
    from jaxloop import step as step_lib

    for module in (action_loop, eval_loop, outer_loop, pipeline_loop, stat_loop, train_loop):
        assert module.Step is step_lib.Step and module.State is types.TrainState
    for module in (eval_loop, outer_loop, stat_loop, train_loop):
        assert module.Loop is loop.Loop
    assert action_loop.Action is actions.Action
    assert partition.TrainState is types.TrainState and partition.Batch is types.Batch
    assert step_lib.BatchSpec is types.BatchSpec and step_lib.DType is types.DType
    assert constants.DEFAULT_SIGNATURE_KEY == "serving_default"
    assert outer_loop.STAT_PREFIX == stat_loop.STAT_PREFIX == "jaxloop"
    assert outer_loop.STOP_LOOP == f"{outer_loop.STAT_PREFIX}/stop_loop"
    assert stat_loop.STAT_INIT_TIME == "jaxloop/init_time"
    assert stat_loop.STAT_BEGIN_TIME == "jaxloop/begin_time"
    assert types.MetricType.OTHER.value == "other"
    assert async_action_context.Future is concurrent.futures.Future


def test_get_zeroed_batch_builds_the_batch_simple_step_initialises_from():
    from jaxloop import step as step_lib

    batch = step_lib.get_zeroed_batch({"input_features": [2, 3],
                                       "output_features": ([2], np.int32)})
    assert batch["input_features"].shape == (2, 3)
    assert batch["input_features"].dtype == np.float32
    assert batch["output_features"].dtype == np.int32
    assert not batch["input_features"].any()


def test_mutex_lock_holds_the_lock_for_its_block():
    from jaxloop import async_action_context

    lock = threading.Lock()
    with async_action_context.MutexLock(lock):
        assert lock.locked()
        assert not lock.acquire(blocking=False)
    assert not lock.locked()
    with pytest.raises(RuntimeError), async_action_context.MutexLock(lock):
        raise RuntimeError("released on an exception too")
    assert not lock.locked()


def test_stat_loop_records_its_construction_and_begin_wall_times():
    from jaxloop import stat_loop

    step = ClassifierStep(jax.random.key(0), LinenMLP(),
                          optimizer=optax.sgd(0.1), train=True)
    state = step.initialize_model([1, 16])
    data = toy_data()
    before = time.time()
    loop = stat_loop.StatLoop(step, stat_names=[stat_loop.STAT_INIT_TIME,
                                                stat_loop.STAT_BEGIN_TIME])
    built = time.time()
    state, first = loop(state, iter([data] * 2), num_steps=2)
    between = time.time()
    _, second = loop(state, iter([data] * 2), num_steps=2)
    assert before <= first[stat_loop.STAT_INIT_TIME] <= built
    assert built <= first[stat_loop.STAT_BEGIN_TIME] <= between
    # The construction time stays; the begin time is each loop's own.
    assert second[stat_loop.STAT_INIT_TIME] == first[stat_loop.STAT_INIT_TIME]
    assert second[stat_loop.STAT_BEGIN_TIME] >= between
    assert set(first) == {"loss", "accuracy", "logits", stat_loop.STAT_INIT_TIME,
                          stat_loop.STAT_BEGIN_TIME}


def test_eval_spec_evaluates_only_where_both_the_interval_and_the_function_say_so():
    from jaxloop import actions, eval_loop, outer_loop, train_loop

    train = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP())
    data = toy_data()
    asked, evaluated = [], []

    class Record(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            evaluated.append(int(state.step))

    def should_eval(context):
        asked.append(context.loop_count)
        return context.step_num >= 16

    outer = outer_loop.OuterLoop(
        train_loop=train_loop.TrainLoop(train),
        eval_loops=[eval_loop.EvalLoop(evaluate, end_actions=[Record()])])
    outer(train.initialize_model([1, 16]), iter(lambda: data, None), train_total_steps=20,
          train_loop_steps=4,
          eval_specs=[outer_loop.EvalSpec([data], eval_loop_interval=2,
                                          should_eval_fn=should_eval)])
    # Loops 2 and 4 are on the interval; the function says yes at step 16 only.
    assert asked == [2, 4]
    assert evaluated == [16]


if __name__ == "__main__":
    for name, defined in reference_names(sys.argv[1]).items():
        print(f"    {name!r}: {defined!r},")
