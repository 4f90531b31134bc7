"""PipelineLoop: an EvalLoop whose steps' outputs (as numpy, plus `EXAMPLE_COUNT`) are fed to
an ``ml_metrics.chainable.Pipeline`` at the loop's end; its aggregate result becomes the loop's
outputs (``pip install 'jaxloop[pipeline]'``). Accuracy over every example::

    pipeline = chainable.Pipeline.new().assign(
        'correct', fn=lambda logits, y: np.argmax(logits, -1) == y,
        input_keys=('logits', 'labels')).aggregate(
        input_keys='correct', fn=rolling_stats.MeanAndVarianceAggFn(), output_keys='accuracy')
    _, outputs = PipelineLoop(eval_step, pipeline=pipeline)(state, eval_batches)
    outputs['accuracy'].mean
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jaxloop import eval_loop, types
from jaxloop import loop as loop_lib
from jaxloop.metrics import metric_values

try:
    from ml_metrics import chainable
except ImportError as e:  # an optional extra
    raise ImportError(
        "jaxloop.pipeline_loop needs ml_metrics: pip install 'jaxloop[pipeline]' (package "
        "py-ml-metrics)."
    ) from e

Output = types.Output
State = types.TrainState
Step = loop_lib.Step

EXAMPLE_COUNT = "jaxloop/example_count"
"""The pipeline input that holds the real examples of the step's batch."""


class PipelineLoop(eval_loop.EvalLoop):
    """An `EvalLoop` whose outputs are an ml_metrics pipeline's result over its steps, plus
    the loop's clu metrics and statistics. `pipeline` ends in an aggregate whose result is a
    mapping; None: `make_pipeline` decides (by default none: the loop is an `EvalLoop`)."""

    def __init__(self, step: Any, pipeline: chainable.Pipeline | None = None, **kwargs: Any):
        if pipeline is not None and not isinstance(pipeline, chainable.Pipeline):
            raise TypeError("pipeline must be an ml_metrics.chainable.Pipeline, got "
                            f"{type(pipeline).__name__}.")
        super().__init__(step, **kwargs)
        self.pipeline = pipeline

    def make_pipeline(self, state: State) -> chainable.Pipeline | None:
        """The pipeline for a loop over `state`; override to build one from the state."""
        del state
        return self.pipeline

    def run(self, state: State, dataset: Iterator[Any], num_steps: int | None = None,
            **kwargs: Any) -> tuple[State, Output | None]:
        state, outputs = super().run(state, dataset, num_steps, **kwargs)
        pipeline = self.make_pipeline(state)
        if pipeline is None or outputs is None:
            return state, outputs
        # Per-step lists (clu metrics stay with the loop) and example counts: a dict a step.
        columns = {k: v for k, v in outputs.items()
                   if isinstance(v, list) and not isinstance(v, loop_lib.MetricList)}
        kept = {k: v for k, v in outputs.items() if k not in columns}
        if self.example_counts:
            columns[EXAMPLE_COUNT] = list(self.example_counts)
        lengths = {k: len(v) for k, v in columns.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"Every step must return the same output keys; per-step lengths were {lengths}.")
        # Fetched whole: an array that spans other processes is gathered (a collective).
        columns = jax.tree.map(lambda x: np.asarray(metric_values.fetch(x)), columns)
        result = pipeline.make()(input_iterator=[
            dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)])
        if not isinstance(result, Mapping):
            raise TypeError("The pipeline's result must be a mapping (end it with .aggregate(..., "
                            f"output_keys=...)), got {type(result).__name__}.")
        return state, {**kept, **result}
