"""A loop's outputs: one list per key, one entry per step (a fused execution's kept stacked
until read: `StepList`); `clu.metrics` values go to a `MetricList`, whose `compute()` merges
them over the loop.

Example::

    outputs = append({}, {'loss': loss, 'accuracy': Accuracy.from_model_output(...)})
    outputs['loss'][0]               # step 1's loss
    outputs['accuracy'].compute()    # over the whole loop
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
from clu import metrics as clu_metrics

_METRIC_TYPES = (clu_metrics.Metric, clu_metrics.Collection)


def entry(stacked: Any, index: int) -> Any:
    """Step `index` of an execution's stacked outputs (a static slice: ``x[i]`` would send
    the index to the devices first)."""
    return jax.tree.map(lambda x: jax.lax.index_in_dim(x, index, keepdims=False), stacked)


@jax.jit
def unstack(outputs: Any) -> list[Any]:
    """An execution's stacked outputs as k per-step outputs, split in one dispatch."""
    size = len(jax.tree.leaves(outputs)[0]) if jax.tree.leaves(outputs) else 0
    return [jax.tree.map(lambda x, i=i: x[i], outputs) for i in range(size)]


@jax.jit
def _merge(merged: Any, metric: Any) -> Any:
    return merged.merge(metric)


class StepList(list):
    """Per-step values of one output: a list whose entries from fused executions stay
    stacked on the devices (as the execution returned them) until read. ``len()`` and
    reading one entry slice nothing else; any other use settles the list first, one split
    per execution (`unstack`). A pytree node as a plain list is.

    Example::

        losses = StepList()
        losses.extend_stacked(stacked_losses, 5)   # the first 5 of an execution of k
        len(losses), losses[-1]                    # 5, step 5's loss
    """

    # (stacked value, steps) after the list's own entries; a tuple until the first.
    _stacked: Any = ()

    def extend_stacked(self, stacked: Any, count: int) -> None:
        """Appends the first `count` steps of a value stacked on a leading axis."""
        if not self._stacked:
            self._stacked = []
        self._stacked.append((stacked, count))

    def _settle(self) -> None:
        if self._stacked:
            chunks, self._stacked = self._stacked, []
            for stacked, count in chunks:
                list.extend(self, unstack(stacked)[:count])

    def __len__(self) -> int:
        return list.__len__(self) + sum(count for _, count in self._stacked)

    def __getitem__(self, index: Any) -> Any:
        if not self._stacked or not isinstance(index, int):
            self._settle()
            return list.__getitem__(self, index)
        # Counted from the first stacked entry (IndexError as a list's): below 0 are its own.
        index = range(len(self))[index] - list.__len__(self)
        for stacked, count in self._stacked:
            if index < count:
                return list.__getitem__(self, index) if index < 0 else entry(stacked, index)
            index -= count
        raise AssertionError("unreachable")

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._settle()
        return type(self), (list(self),)


def _settling(name: str) -> Any:
    method = getattr(list, name)

    @functools.wraps(method)
    def settled(self: StepList, *args: Any, **kwargs: Any) -> Any:
        self._settle()
        return method(self, *args, **kwargs)

    return settled


# Every other read or change of the list sees its entries.
for _name in ("__iter__", "__reversed__", "__contains__", "__eq__", "__ne__", "__lt__",
              "__le__", "__gt__", "__ge__", "__repr__", "__add__", "__iadd__", "__mul__",
              "__rmul__", "__imul__", "__setitem__", "__delitem__", "append", "extend",
              "insert", "pop", "remove", "index", "count", "sort", "reverse", "copy",
              "clear"):
    setattr(StepList, _name, _settling(_name))
StepList.__radd__ = lambda self, other: list(other) + list(self)
jax.tree_util.register_pytree_node(
    StepList, lambda values: (list(values), None), lambda _, values: StepList(values))


class MetricList(StepList):
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


def extend_stacked(loop_outputs: dict[str, list[Any]], stacked: Mapping[str, Any], count: int
                   ) -> dict[str, list[Any]]:
    """Appends the first `count` steps of an execution's stacked outputs to the per-key
    lists of `loop_outputs`, kept stacked (`StepList`) until read."""
    for key, value in stacked.items():
        values = loop_outputs.get(key, [])
        if not isinstance(values, StepList):  # new, or single steps' list before
            kind = MetricList if isinstance(value, _METRIC_TYPES) else StepList
            values = loop_outputs[key] = kind(values)
        values.extend_stacked(value, count)
    return loop_outputs
