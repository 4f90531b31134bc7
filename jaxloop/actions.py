"""Actions: host-side work run at loop boundaries (summaries, checkpoints, early stopping).

An action is any callable ``action(state, outputs, **kwargs)`` with a positive ``interval``;
loops call it with the keywords ``loop``, ``loop_count``, ``first_step`` and ``context`` (an
`ActionContext`). `CheckpointAction`, `BestCheckpointAction` and `ProgressAction` load on
first use, so importing the loops imports no orbax. Example, logging the learning rate::

    class LogLearningRate(actions.Action):
        def __call__(self, state, outputs, context=None, **kwargs):
            writer.write_scalars(context.step, {'lr': schedule(context.step)})
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxloop import stop_handler, types
from jaxloop.engine import host_count
from jaxloop.hooks.action import Action, ActionContext
from jaxloop.metrics import history, metric_values

# Re-exported: users call these as ``actions.scalar_metrics`` etc. (google/jaxloop's names).
from jaxloop.metrics.metric_values import example_weights, fetch, scalar_metrics, scalar_summary
from jaxloop.step_number_writer import LocalFileStepNumberWriter, StepNumberWriter

if TYPE_CHECKING:  # at run time `__getattr__` loads them
    from jaxloop.checkpointing.checkpoint_actions import BestCheckpointAction, CheckpointAction
    from jaxloop.metrics.progress import ProgressAction

Output = types.Output
State = types.TrainState
MetricType = types.MetricType
Scalar = types.Scalar
PyTree = Any
ApplyFn = Callable[[PyTree, PyTree], PyTree]
MetricWithMetadata = types.MetricWithMetadata
MetricMonitoringStopHandler = stop_handler.MetricMonitoringStopHandler
StopTrainingError = stop_handler.StopTrainingError

log = logging.getLogger(__name__)

_ELSEWHERE = {"ProgressAction": "jaxloop.metrics.progress", **dict.fromkeys(
    ["CheckpointAction", "BestCheckpointAction"], "jaxloop.checkpointing.checkpoint_actions")}

__all__ = [
    "Action", "ActionContext", "BestCheckpointAction", "CheckpointAction", "EarlyStoppingAction",
    "MetricMonitoringStopHandler", "MetricType", "MetricWithMetadata", "ProgressAction",
    "StepNumberAction", "StepNumberFileWriter", "StopTrainingError", "SummaryAction",
    "deferred_writes", "example_weights", "fetch", "scalar_metrics", "scalar_summary",
]


def __getattr__(name: str) -> Any:
    """The actions of `_ELSEWHERE`, imported when first asked for (PEP 562)."""
    if name in _ELSEWHERE:
        value = getattr(importlib.import_module(_ELSEWHERE[name]), name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_ELSEWHERE})


# SummaryActions holding values not written yet, while a `deferred_writes` block is open.
_deferring: dict[int, SummaryAction] = {}
_open_blocks = 0


@contextlib.contextmanager
def deferred_writes() -> Iterator[None]:
    """While open, a `SummaryAction` writes a loop's values once the device has computed them
    (one loop late with several processes, as MaxText does), the rest when the outermost
    block ends, so a loop end waits for nothing. `OuterLoop` trains inside one; by hand::

        with actions.deferred_writes():
            for _ in range(10):
                state, _ = train_loop(state, batches, num_steps=100)
    """
    global _open_blocks
    _open_blocks += 1
    failing = True
    try:
        yield
        failing = False
    finally:
        _open_blocks -= 1
        pending = [] if _open_blocks else [_deferring.pop(k) for k in list(_deferring)]
        for action in pending:  # the outermost block writes and flushes what is left
            try:
                action.write_pending()
                action.summary_writer.flush()
            except Exception:
                if not failing:
                    raise
                # Ended by an exception, which is the news: this error is logged.
                log.exception("SummaryAction could not write its last values")


class SummaryAction(Action):
    """Writes loop outputs with a clu-style metric writer (`jaxloop.metrics.writers` or clu's).

    A train loop's per-step scalars are written at their own steps; otherwise (eval loops)
    their mean over examples, like plain scalars and clu metrics, at ``state.step``.
    `MetricWithMetadata` values go to the writer method of their type (audio is a
    ValueError); per-step lists of other arrays are skipped. Every process runs it: give
    the others a writer that drops values. Inside `deferred_writes` values not computed yet
    are written later. `flush_each_call`: flush the writer after each write.
    """

    def __init__(self, summary_writer: Any, interval: int = 1, flush_each_call: bool = False):
        super().__init__(interval)
        self._summary_writer, self._flush_each_call = summary_writer, flush_each_call
        # (step, outputs, first_step, example counts) of the calls not written yet.
        self._pending: list[tuple[int, Output, int | None, list[Any] | None]] = []

    @property
    def summary_writer(self) -> Any:
        return self._summary_writer

    _METHODS = {MetricType.HISTOGRAM: "write_histograms", MetricType.IMAGE: "write_images",
                MetricType.VIDEO: "write_videos", MetricType.TEXT: "write_texts"}
    SUPPORTED_TYPES = (MetricType.SCALAR, *_METHODS)

    def __call__(self, state: State, outputs: Output | None, first_step: int | None = None,
                 loop: Any = None, **kwargs: Any) -> None:
        if not outputs:
            return
        items = {}
        for key, value in outputs.items():
            if isinstance(value, list | tuple) and value and isinstance(
                    value[-1], MetricWithMetadata):
                value = value[-1]
            if isinstance(value, MetricWithMetadata) and value.type not in self.SUPPORTED_TYPES:
                raise ValueError(
                    f"Output {key!r} has metric type {value.type}, which SummaryAction does "
                    f"not write; supported: {[t.name for t in self.SUPPORTED_TYPES]}")
            # A list copied (the loop's may grow), device scalars stacked now.
            items[key] = history.stacked(list(value)) if type(value) is list else value
        counts = getattr(loop, "example_counts", None)
        self._pending.append((host_count.host_step(state), items, first_step,
                              list(counts) if counts else None))
        pending = self._pending
        if not _open_blocks:
            self._write_first(len(pending))
        elif jax.process_count() == 1:  # what the device has computed, in order
            self._write_first(next((i for i, p in enumerate(pending)
                                    if not history.is_ready(p[1:])), len(pending)))
        else:  # one call late, so that every process reads (maybe a collective) at one call
            self._write_first(len(pending) - 1)
        if self._pending:
            _deferring[id(self)] = self

    def _write_first(self, count: int) -> None:
        if count <= 0:
            return
        written, self._pending = self._pending[:count], self._pending[count:]
        for step, outputs, first_step, counts in written:
            self._write(step, outputs, first_step, counts)
        if self._flush_each_call:
            self._summary_writer.flush()

    def write_pending(self) -> None:
        """Writes the values of the calls not written yet, waiting for the device if need be."""
        self._write_first(len(self._pending))

    def _write(self, step: int, outputs: Output, first_step: int | None,
               counts: list[Any] | None) -> None:
        weights = metric_values.scalar_values(counts) if counts else None
        weights = weights if isinstance(weights, list) else None
        per_step: dict[int, dict[str, float]] = {}
        at_step: dict[str, Any] = {}
        typed: dict[MetricType, dict[str, Any]] = {}
        for key, value in outputs.items():
            if isinstance(value, MetricWithMetadata) and value.type == MetricType.SCALAR:
                value = value.value  # written with the plain scalars, as one of them
            if isinstance(value, MetricWithMetadata):
                array = np.asarray(fetch(value.value))
                if value.type == MetricType.TEXT:
                    text = array.item() if array.size == 1 else array.tolist()
                    array = text.decode() if isinstance(text, bytes) else str(text)
                typed.setdefault(value.type, {})[key] = array
                continue
            host = (value.read() if isinstance(value, history.Stacked)
                    else metric_values.scalar_values(value))  # None for per-example arrays
            if isinstance(host, list):
                if first_step is not None and step - first_step == len(host):
                    for s, number in enumerate(host, first_step + 1):
                        per_step.setdefault(s, {})[key] = number
                else:
                    at_step[key] = metric_values.mean(host, weights)
            elif isinstance(host, dict):  # a clu Collection computes to a dict
                at_step.update({f"{key}/{k}": v for k, v in host.items()})
            elif isinstance(host, float) or not isinstance(value, list | tuple):
                # (Not a number: the reference's bare usage, the writer decides.)
                at_step[key] = value if host is None else host
        for metric_type, values in typed.items():
            getattr(self._summary_writer, self._METHODS[metric_type])(step, values)
        for s in sorted(per_step):
            self._summary_writer.write_scalars(s, per_step[s])
        if at_step:
            self._summary_writer.write_scalars(step, at_step)


class EarlyStoppingAction(Action):
    """Stops training when a monitored metric stops improving (or becomes NaN).

    Raises `StopTrainingError`, which `OuterLoop` catches. The metric is any name
    `scalar_metrics` reports (``'metrics/accuracy'`` for a clu Collection ``'metrics'``);
    its progress is saved with `OuterLoop`'s checkpoints. Example::

        handler = MetricMonitoringStopHandler('loss', min_delta=1e-3, patience=2)
        eval_loop = EvalLoop(eval_step, end_actions=[EarlyStoppingAction(handler)])
    """

    def __init__(self, handler: MetricMonitoringStopHandler, interval: int = 1):
        super().__init__(interval)
        self._handler = handler
        self.monitored_metric = handler.monitored_metric

    @property
    def handler(self) -> MetricMonitoringStopHandler:
        return self._handler

    def state_dict(self) -> dict[str, Any]:
        """The handler's progress as JSON (saved with checkpoints; `load_state_dict`)."""
        return self._handler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._handler.load_state_dict(state)

    def __call__(self, state: State, outputs: Output | None, loop: Any = None,
                 **kwargs: Any) -> Output | None:
        step = host_count.host_step(state)
        name = self.monitored_metric
        if outputs is not None and name in outputs:
            metric = scalar_summary(outputs[name], example_weights(loop))
        else:
            reported = scalar_metrics(outputs, loop=loop)
            if name not in reported:
                log.warning(
                    "Early stopping action '%s' is monitoring metric '%s' which is not "
                    "available in the outputs dictionary. Available metrics are: %s",
                    type(self).__name__, name,
                    sorted({*(outputs or {}), *reported}) if outputs is not None else None)
                return outputs
            metric = reported[name]
        if metric is None:
            raise ValueError(f"EarlyStoppingAction monitors {name!r}, but that output is not "
                             "a scalar (nor a list of per-step scalars)")
        nan = math.isnan(metric)
        if not nan:
            self._handler.update_state(metric, step)
            if not self._handler.should_stop():
                return outputs
        best, best_step = self._handler.get_best_info()
        if nan:
            log.error("[EarlyStoppingAction] Metric '%s' is NaN at step %d. Stopping "
                      "training.", name, step)
        else:
            log.info("[EarlyStoppingAction] Stopping training at step %d. Metric '%s' did "
                     "not improve for %d cycles. Best metric %.4f at step %d.",
                     step, name, self._handler.wait, best, best_step)
        raise StopTrainingError(f"Metric '{name}' was NaN" if nan else
                                f"Early stopping triggered for metric '{name}'",
                                best_step=best_step, best_metric=best)


StepNumberFileWriter = LocalFileStepNumberWriter
"""The step-number file writer (an alias of `step_number_writer.LocalFileStepNumberWriter`)."""


class StepNumberAction(Action):
    """Reports the state's step to a `StepNumberWriter` (anything with ``write(step)``)."""

    def __init__(self, step_writer: StepNumberWriter, interval: int = 1):
        super().__init__(interval)
        if not callable(getattr(step_writer, "write", None)):
            raise TypeError(
                "StepNumberAction needs a StepNumberWriter (an object with write(step_number)), "
                f"got {step_writer!r}")
        self._step_writer = step_writer

    @property
    def step_writer(self) -> StepNumberWriter:
        return self._step_writer

    def __call__(self, state: State, outputs: Output | None = None, **kwargs: Any) -> None:
        self._step_writer.write(host_count.host_step(state))
