"""Actions: host-side work run at loop boundaries (summaries, checkpoints, early stopping).

An action is any callable ``action(state, outputs, **kwargs)`` with a positive ``interval``;
loops call it every ``interval`` loops (steps, when given to a `Step`). Keyword arguments
from an `ActionLoop` are ``loop``, ``loop_count`` and ``first_step``; accept ``**kwargs``
so new ones never break an action.

Example, a custom action that logs the learning rate::

    class LogLearningRate(actions.Action):
        def __init__(self, schedule, writer, interval=1):
            super().__init__(interval)
            self._schedule, self._writer = schedule, writer

        def __call__(self, state, outputs, **kwargs):
            step = int(state.step)
            self._writer.write_scalars(step, {'lr': self._schedule(step)})
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxloop import checkpoint, stop_handler, types

Output = types.Output
State = types.TrainState
MetricType = types.MetricType
MetricWithMetadata = types.MetricWithMetadata
MetricMonitoringStopHandler = stop_handler.MetricMonitoringStopHandler
StopTrainingError = stop_handler.StopTrainingError

log = logging.getLogger(__name__)


class Action:
    """Base class for actions: holds the interval and defines the call signature."""

    def __init__(self, interval: int = 1):
        if not isinstance(interval, int) or interval <= 0:
            raise ValueError(f"`interval` must be a positive integer, got {interval!r}")
        self._interval = interval

    @property
    def interval(self) -> int:
        return self._interval

    def __call__(self, state: State, outputs: Output | None, **kwargs: Any) -> Any:
        raise NotImplementedError("Action subclasses implement __call__(state, outputs, **kw)")


def _host_value(value: Any) -> Any:
    """A loop output as host data: clu metrics computed, lists stacked, arrays fetched.

    A per-step list of same-shaped device arrays is stacked on the device first, so it
    comes back in one transfer instead of one per step.
    """
    if hasattr(value, "compute") and callable(value.compute):
        value = value.compute()
    if (
        isinstance(value, list)
        and len(value) > 1
        and all(isinstance(v, jax.Array) for v in value)
        and len({(v.shape, v.dtype) for v in value}) == 1
    ):
        return list(np.asarray(jax.device_get(jnp.stack(value))))
    return jax.device_get(value)


def scalar_summary(value: Any) -> float | None:
    """One number for an output (the mean of a per-step list), or None if not scalar."""
    value = _host_value(value)
    if isinstance(value, list | tuple):
        if not value or any(np.size(v) != 1 for v in value):
            return None
        return float(np.mean([np.asarray(v, np.float64) for v in value]))
    if np.size(value) != 1 or not np.issubdtype(np.asarray(value).dtype, np.number):
        return None
    return float(np.asarray(value, np.float64).reshape(()))


def scalar_metrics(outputs: Output | None) -> dict[str, float]:
    """The scalar outputs of a loop reduced to floats (means of per-step lists)."""
    metrics = {}
    for key, value in (outputs or {}).items():
        if isinstance(value, MetricWithMetadata) or key.startswith("jaxloop/stop"):
            continue
        number = scalar_summary(value)
        if number is not None:
            metrics[key] = number
    return metrics


class SummaryAction(Action):
    """Writes loop outputs with a clu-style metric writer.

    - A per-step list of scalars from a train loop is written value by value at the step
      numbers it was produced at (``first_step + 1 ... state.step``); when the steps do
      not line up (eval loops, whose state does not advance) its mean is written at
      ``state.step``.
    - Plain scalars (such as the loop's statistics) and clu metrics (computed) are written
      at ``state.step``.
    - `MetricWithMetadata` values go to the writer method of their type (images,
      histograms, text, audio, video); for a per-step list the latest value is written.
    - Other arrays (per-example logits, say) are not summaries and are skipped.

    Args:
      summary_writer: any writer with clu's `MetricWriter` methods (`jaxloop.writers` or
        clu's own writers).
      interval: write every `interval` loops.
      flush_each_call: flush the writer after each write (the file is then readable at once).
    """

    def __init__(self, summary_writer: Any, interval: int = 1, flush_each_call: bool = False):
        super().__init__(interval)
        self._summary_writer = summary_writer
        self._flush_each_call = flush_each_call

    @property
    def summary_writer(self) -> Any:
        return self._summary_writer

    def _write_typed(self, step: int, key: str, metric: MetricWithMetadata) -> None:
        value = np.asarray(jax.device_get(metric.value))
        meta = dict(metric.metadata)
        writer = self._summary_writer
        if metric.type == MetricType.SCALAR:
            writer.write_scalars(step, {key: value})
        elif metric.type == MetricType.IMAGE:
            writer.write_images(step, {key: value})
        elif metric.type == MetricType.HISTOGRAM:
            writer.write_histograms(step, {key: value})
        elif metric.type == MetricType.TEXT:
            text = value.item() if value.size == 1 else value.tolist()
            writer.write_texts(step, {key: text.decode() if isinstance(text, bytes) else str(text)})
        elif metric.type == MetricType.AUDIO:
            writer.write_audios(step, {key: value}, sample_rate=int(meta.get("sample_rate", 16000)))
        elif metric.type == MetricType.VIDEO:
            writer.write_videos(step, {key: value})
        else:
            raise ValueError(f"Output {key!r} has unsupported metric type {metric.type}")

    def __call__(
        self, state: State, outputs: Output | None, first_step: int | None = None, **kwargs: Any
    ) -> None:
        if not outputs:
            return
        step = int(state.step)
        per_step: dict[int, dict[str, float]] = {}
        at_step: dict[str, float] = {}
        for key, value in outputs.items():
            if isinstance(value, list | tuple) and value and isinstance(
                value[-1], MetricWithMetadata
            ):
                value = value[-1]
            if isinstance(value, MetricWithMetadata):
                self._write_typed(step, key, value)
                continue
            host = _host_value(value)
            if isinstance(host, list | tuple):
                if not host or any(np.size(v) != 1 for v in host):
                    continue
                numbers = [float(np.asarray(v, np.float64).reshape(())) for v in host]
                if first_step is not None and step - first_step == len(numbers):
                    for i, number in enumerate(numbers):
                        per_step.setdefault(first_step + 1 + i, {})[key] = number
                else:
                    at_step[key] = float(np.mean(numbers))
            elif isinstance(host, Mapping):  # a clu Collection computes to a dict
                at_step.update({f"{key}/{k}": float(v) for k, v in host.items()
                                if np.size(v) == 1})
            elif np.size(host) == 1 and np.issubdtype(np.asarray(host).dtype, np.number):
                at_step[key] = float(np.asarray(host, np.float64).reshape(()))
        for s in sorted(per_step):
            self._summary_writer.write_scalars(s, per_step[s])
        if at_step:
            self._summary_writer.write_scalars(step, at_step)
        if self._flush_each_call:
            self._summary_writer.flush()


class CheckpointAction(Action):
    """Saves the whole training state with the user's orbax `CheckpointManager`.

    The save is asynchronous when the manager is (orbax copies the arrays off the device
    before `save` returns, so training continues while the files are written). The state's
    `dataset_state` is filled from the train iterator when it can report its position, and
    the loop count is saved too, so a resumed run reads the same batches and fires actions
    on the same loops. Scalar outputs are passed as metrics (for `best_fn` policies).

    Example::

        manager = ocp.CheckpointManager(workdir / 'ckpt',
                                        options=ocp.CheckpointManagerOptions(max_to_keep=3))
        train_loop = TrainLoop(step, end_actions=[CheckpointAction(manager, interval=5)])
    """

    def __init__(self, ckpt_manager: ocp.CheckpointManager, interval: int = 1):
        super().__init__(interval)
        self._ckpt_manager = ckpt_manager
        self._meta: dict[str, Any] = {}

    @property
    def ckpt_manager(self) -> ocp.CheckpointManager:
        return self._ckpt_manager

    def add_meta(self, name: str, provider: Any) -> None:
        """Saves ``provider()`` (JSON-serialisable) under `name` in each checkpoint's
        metadata, e.g. `OuterLoop` saves its early-stopping progress this way."""
        self._meta[name] = provider

    def __call__(
        self,
        state: State,
        outputs: Output | None,
        loop: Any = None,
        force: bool = False,
        **kwargs: Any,
    ) -> bool:
        """Saves `state` at its step; `force` saves even where the manager's policy would
        skip this step (preemption)."""
        step = int(state.step)
        from jaxloop import data  # noqa: PLC0415 (grain loads only when checkpointing)

        dataset = getattr(loop, "dataset", None)
        position = getattr(loop, "data_position", None)  # knows about prefetched batches
        dataset_state = position(dataset) if callable(position) else data.iterator_state(dataset)
        if dataset_state is not None:
            state = state.replace(dataset_state=dataset_state)
        meta = {"loop_count": getattr(loop, "loop_count", None)}
        meta.update({name: provider() for name, provider in self._meta.items()})
        saved = checkpoint.save(
            self._ckpt_manager, step, state, meta=meta, metrics=scalar_metrics(outputs),
            force=force,
        )
        if saved:
            log.info("Saving checkpoint for step %d to %s.", step, self._ckpt_manager.directory)
        return saved


class BestCheckpointAction(CheckpointAction):
    """Keeps the best k checkpoints by an eval metric, beside the latest ones.

    Put it on an eval loop; each evaluation offers the state with the eval outputs as
    metrics, and the manager (from `checkpoint.make_best_manager`) keeps the best k. These
    checkpoints are for picking a model, so no data position or loop count is saved.

    Example::

        best = checkpoint.make_best_manager(workdir / 'best', 'accuracy', mode='max', k=2)
        eval_loop = EvalLoop(eval_step, end_actions=[BestCheckpointAction(best)])
        state = checkpoint.restore_best(state, workdir / 'best', 'accuracy', mode='max')
    """

    def __call__(
        self, state: State, outputs: Output | None, loop: Any = None, force: bool = False,
        **kwargs: Any,
    ) -> bool:
        if int(state.step) in self._ckpt_manager.all_steps():
            return False  # several evals after one train loop: the first one is offered
        return super().__call__(state.replace(dataset_state=None), outputs, force=force)


class EarlyStoppingAction(Action):
    """Stops training when a monitored metric stops improving (or becomes NaN).

    Raises `StopTrainingError` (carrying the best step and metric); `OuterLoop` catches it
    and ends training cleanly. Put it on an eval loop's end actions. The metric is the
    mean of the loop's per-step values (or the computed clu metric). The messages are
    google/jaxloop's: a missing metric is a warning ("... is not available in the outputs
    dictionary ..."), a NaN raises "Metric '<name>' was NaN", and patience running out
    raises "Early stopping triggered for metric '<name>'".

    The handler's progress (best value, best step, patience left) goes into the
    checkpoints of an `OuterLoop`'s train loop and comes back on resume (`state_dict`).

    Example::

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
        """The handler's progress, JSON-serialisable (saved with checkpoints)."""
        return self._handler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores progress saved by `state_dict`."""
        self._handler.load_state_dict(state)

    def __call__(self, state: State, outputs: Output | None, **kwargs: Any) -> Output | None:
        step = int(state.step)
        if outputs is None or self.monitored_metric not in outputs:
            log.warning(
                "Early stopping action '%s' is monitoring metric '%s' which is not available "
                "in the outputs dictionary. Available metrics are: %s",
                type(self).__name__,
                self.monitored_metric,
                sorted(outputs) if outputs is not None else None,
            )
            return outputs
        metric = scalar_summary(outputs[self.monitored_metric])
        if metric is None:
            raise ValueError(
                f"EarlyStoppingAction monitors {self.monitored_metric!r}, but that output is "
                "not a scalar (nor a list of per-step scalars)"
            )
        if math.isnan(metric):
            log.error(
                "[EarlyStoppingAction] Metric '%s' is NaN at step %d. Stopping training.",
                self.monitored_metric,
                step,
            )
            best, best_step = self._handler.get_best_info()
            raise StopTrainingError(
                f"Metric '{self.monitored_metric}' was NaN",
                best_step=best_step,
                best_metric=best,
            )
        self._handler.update_state(metric, step)
        if self._handler.should_stop():
            best, best_step = self._handler.get_best_info()
            log.info(
                "[EarlyStoppingAction] Stopping training at step %d. Metric '%s' did not "
                "improve for %d cycles. Best metric %.4f at step %d.",
                step,
                self.monitored_metric,
                self._handler.wait,
                best,
                best_step,
            )
            raise StopTrainingError(
                f"Early stopping triggered for metric '{self.monitored_metric}'",
                best_step=best_step,
                best_metric=best,
            )
        return outputs


class StepNumberFileWriter:
    """Writes the latest step number to a file, atomically (for external schedulers)."""

    def __init__(self, path: str | os.PathLike[str]):
        self._path = os.fspath(path)

    def write(self, step: int) -> None:
        tmp = f"{self._path}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{step}\n")
        os.replace(tmp, self._path)


class StepNumberAction(Action):
    """Reports the state's step to a writer with a ``write(step)`` method.

    Example::

        StepNumberAction(StepNumberFileWriter(workdir / 'step.txt'))
    """

    def __init__(self, step_writer: Any, interval: int = 1):
        super().__init__(interval)
        self._step_writer = step_writer

    def __call__(self, state: State, outputs: Output | None = None, **kwargs: Any) -> None:
        self._step_writer.write(int(state.step))


class ProgressAction(Action):
    """A progress bar (tqdm.auto: a widget in notebooks, a bar in terminals).

    Shows step/total, steps per second and the latest value of `metric`, updated at each
    loop end (never per step, which would need a host sync). `enabled=None` shows it only
    when the output is interactive.

    Example::

        TrainLoop(step, end_actions=[ProgressAction(total_steps=1000)])
    """

    def __init__(
        self,
        total_steps: int | None = None,
        metric: str = "loss",
        interval: int = 1,
        enabled: bool | None = None,
        desc: str = "train",
    ):
        super().__init__(interval)
        self._total = total_steps
        self._metric = metric
        self._enabled = enabled
        self._desc = desc
        self._bar: Any = None

    @staticmethod
    def _interactive() -> bool:
        # A notebook kernel (widget) or a terminal; never a log file or a test run, and no
        # tqdm object (nor its monitor thread) is created when not shown.
        return "ipykernel" in sys.modules or sys.stderr.isatty()

    def __call__(self, state: State, outputs: Output | None, **kwargs: Any) -> None:
        if self._enabled is None:
            self._enabled = self._interactive()
        if not self._enabled:
            return
        step = int(state.step)
        if self._bar is None:
            from tqdm.auto import tqdm  # noqa: PLC0415 (only when a bar is shown)

            self._bar = tqdm(total=self._total, initial=kwargs.get("first_step") or 0,
                             desc=self._desc, unit="step", dynamic_ncols=True)
        bar = self._bar
        bar.update(max(step - bar.n, 0))
        postfix = {}
        values = (outputs or {}).get(self._metric)
        if isinstance(values, list) and values:
            postfix[self._metric] = f"{float(jax.device_get(values[-1])):.4g}"
        rate = (outputs or {}).get("jaxloop/steps_per_sec")
        if rate is not None:
            postfix["steps/s"] = f"{float(rate):.1f}"
        bar.set_postfix(postfix, refresh=True)

    def close(self) -> None:
        """Closes the bar (OuterLoop does this when training ends)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
