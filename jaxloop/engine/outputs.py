"""A loop's outputs: one list per key, one entry per step; `clu.metrics` values go to a
`MetricList`, whose `compute()` merges them over the loop.

Example::

    outputs = append({}, {'loss': loss, 'accuracy': Accuracy.from_model_output(...)})
    outputs['loss'][0]               # step 1's loss
    outputs['accuracy'].compute()    # over the whole loop
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from clu import metrics as clu_metrics

_METRIC_TYPES = (clu_metrics.Metric, clu_metrics.Collection)


@jax.jit
def _merge(merged: Any, metric: Any) -> Any:
    return merged.merge(metric)


class MetricList(list):
    """Per-step `clu.metrics` values: a list with the merge over all steps (`merged`)."""

    def merged(self) -> Any:
        """All steps' metrics merged in order, on the device: one compiled merge of two
        serves every loop length."""
        if not self:
            raise ValueError("No metric to merge: the loop ran no step")
        return functools.reduce(_merge, self)

    def compute(self) -> Any:
        """The metric over all steps: ``merged().compute()``."""
        return self.merged().compute()


def append(loop_outputs: dict[str, list[Any]], step_outputs: dict[str, Any] | None
           ) -> dict[str, list[Any]]:
    """Appends each of one step's outputs to the list of its key in `loop_outputs`."""
    for key, value in (step_outputs or {}).items():
        values = loop_outputs.get(key)
        if values is None:
            values = loop_outputs[key] = MetricList() if isinstance(value, _METRIC_TYPES) else []
        values.append(value)
    return loop_outputs
