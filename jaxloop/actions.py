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
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxloop import agreement, checkpoint, stop_handler, triggers, types
from jaxloop import loop as loop_lib
from jaxloop.step_number_writer import LocalFileStepNumberWriter, StepNumberWriter

Output = types.Output
State = types.TrainState
MetricType = types.MetricType
MetricWithMetadata = types.MetricWithMetadata
MetricMonitoringStopHandler = stop_handler.MetricMonitoringStopHandler
StopTrainingError = stop_handler.StopTrainingError

log = logging.getLogger(__name__)


class Action:
    """Base class for actions: holds the interval (or a `triggers.Trigger`, which then
    decides when it fires, in global train steps or seconds) and defines the call signature.

    Example::

        SummaryAction(writer).with_trigger(triggers.Trigger(at_steps=(1, 10), every_secs=60))
    """

    def __init__(self, interval: int = 1, trigger: triggers.Trigger | None = None):
        if not isinstance(interval, int) or interval <= 0:
            raise ValueError(f"`interval` must be a positive integer, got {interval!r}")
        self._interval = interval
        self.with_trigger(trigger)

    @property
    def interval(self) -> int:
        return self._interval

    @property
    def trigger(self) -> triggers.Trigger | None:
        """What decides when this action fires (None: every `interval`)."""
        return getattr(self, "_trigger", None)

    def with_trigger(self, trigger: triggers.Trigger | None) -> Action:
        """Has `trigger` decide when this action fires; returns the action."""
        if trigger is not None and not isinstance(trigger, triggers.Trigger):
            raise TypeError(f"`trigger` must be a triggers.Trigger, got {trigger!r}")
        self._trigger = trigger
        return self

    def __call__(self, state: State, outputs: Output | None, **kwargs: Any) -> Any:
        raise NotImplementedError("Action subclasses implement __call__(state, outputs, **kw)")


def fetch(value: Any) -> Any:
    """Host copy of `value`. An array that spans other processes' devices and is not
    replicated is gathered first (a collective: every process must call this, as every
    process runs the loops' actions).

    Example::

        logits = np.asarray(fetch(outputs['logits'][-1]))  # whole, on every process
    """
    if (
        isinstance(value, jax.Array)
        and not value.is_fully_addressable
        and not value.is_fully_replicated
    ):
        return multihost_utils.process_allgather(value, tiled=True)
    return jax.device_get(value)


def _is_number(x: Any) -> bool:
    # Shape and dtype are metadata: nothing is copied from the device to decide. This runs
    # for every step's outputs at a loop's end, so the common dtypes are told by their kind.
    if isinstance(x, bool | int | float | np.number):
        return True
    dtype = getattr(x, "dtype", None)
    if dtype is None or np.size(x) != 1:
        return False
    kind = np.dtype(dtype).kind
    # bfloat16 and the float8 types are numpy 'V' (void) kinds: jnp knows them as floats.
    return kind in "biuf" or (kind == "V" and jnp.issubdtype(dtype, jnp.floating))


def _all_numbers(values: Sequence[Any]) -> bool:
    """Whether every value is a number (`_is_number`), deciding once per distinct type,
    dtype and shape: a loop's per-step list has thousands of entries of one kind."""
    kinds = {(type(v), getattr(v, "dtype", None), getattr(v, "shape", None)): v for v in values}
    return all(_is_number(v) for v in kinds.values())


# Per-step scalars are stacked on the devices in groups of this many before their transfer.
_STACK_GROUP = 128


@jax.jit
def _stack_scalars(values: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.reshape(v, ()) for v in values])


def _host_scalars(values: list[Any]) -> list[float]:
    """Host copies of a per-step list of scalars: arrays of one dtype are stacked on the
    devices in groups of `_STACK_GROUP` (one program, the last group padded) so that a
    loop of n steps makes n / 128 transfers, not n (each a device-to-host copy on an
    accelerator)."""
    host = None
    if (
        len(values) > 8
        and jax.process_count() == 1  # a program here would be a collective: fetch gathers
        and all(isinstance(v, jax.Array) for v in values)
        and len({v.dtype for v in values}) == 1
    ):
        groups = [values[start:start + _STACK_GROUP]
                  for start in range(0, len(values), _STACK_GROUP)]
        try:
            stacked = [_stack_scalars(g + [g[-1]] * (_STACK_GROUP - len(g))) for g in groups]
            host = np.concatenate(jax.device_get(stacked))[:len(values)]
        except ValueError:  # scalars on different devices (a list from two placements)
            pass
    if host is None:
        host = fetch(values)
    return np.asarray(host, np.float64).reshape(-1).tolist()


def _computed(value: Any) -> Any:
    if hasattr(value, "compute") and callable(value.compute):
        return value.compute()  # clu metrics: computed on the device
    return value


def _scalar_values(value: Any) -> float | list[float] | dict[str, float] | None:
    """The scalar content of a loop output as host floats, or None when it has none.

    Scalars are picked from shapes before any transfer, so a per-example array (logits,
    say) is never copied to the host, and in a multi-process job never fetched from devices
    of other processes. A per-step list of scalars comes back
    in one `device_get`. A clu Collection (a dict once computed) gives its scalar entries.
    """
    value = _computed(value)
    if isinstance(value, Mapping):
        picked = {k: v for k, v in value.items() if _is_number(v)}
        return {k: float(np.asarray(v, np.float64).reshape(()))
                for k, v in fetch(picked).items()}
    if isinstance(value, list | tuple):
        if not value or not _all_numbers(value):
            return None
        return _host_scalars(list(value))
    if _is_number(value):
        return float(np.asarray(fetch(value), np.float64).reshape(()))
    return None


def _mean(numbers: Sequence[float], weights: Sequence[float] | None) -> float:
    if weights is not None and len(weights) == len(numbers) and sum(weights) > 0:
        return float(np.average(np.asarray(numbers, np.float64), weights=weights))
    return float(np.mean(np.asarray(numbers, np.float64)))


def example_weights(loop: Any = None) -> list[float] | None:
    """The per-step example counts of `loop`'s last run as floats (an `EvalLoop` keeps
    them beside its outputs, see `EvalLoop.example_counts`), or None for a loop that keeps
    none (a train loop) or no loop.

    Example::

        def __call__(self, state, outputs, loop=None, **kwargs):
            weights = actions.example_weights(loop)   # [16.0, 16.0, 8.0]
    """
    counts = getattr(loop, "example_counts", None)
    if not counts:
        return None
    weights = _scalar_values(list(counts))
    return weights if isinstance(weights, list) else None


def scalar_summary(value: Any, weights: Sequence[float] | None = None) -> float | None:
    """One number for an output (the mean of a per-step list), or None if not scalar.

    With `weights` (one per step, e.g. the examples in each batch) a per-step list gives
    the weighted mean, i.e. the mean over examples rather than over batches.
    Non-scalar outputs are recognised from their shapes and never copied to the host.
    """
    host = _scalar_values(value)
    if isinstance(host, list):
        return _mean(host, weights)
    return host if isinstance(host, float) else None


def scalar_metrics(
    outputs: Output | None, weights: Sequence[float] | None = None, *, loop: Any = None
) -> dict[str, float]:
    """The scalar outputs of a loop reduced to floats.

    A per-step list gives its mean; a clu Collection gives ``key/name`` entries. Given the
    loop that produced `outputs` (an action has it as its ``loop`` keyword), an eval
    loop's means weight each step by its real examples (`example_weights`): the mean over
    examples. `weights` gives the per-step weights directly instead.

    Example::

        _, outputs = eval_loop(state, eval_batches)
        actions.scalar_metrics(outputs, loop=eval_loop)   # {'loss': 0.31, 'accuracy': 0.9}
    """
    if weights is None:
        weights = example_weights(loop)
    metrics = {}
    for key, value in (outputs or {}).items():
        if isinstance(value, MetricWithMetadata) or key.startswith("jaxloop/stop"):
            continue
        if isinstance(value, list | tuple) and value and isinstance(value[-1], MetricWithMetadata):
            continue
        host = _scalar_values(value)
        if isinstance(host, list):
            metrics[key] = _mean(host, weights)
        elif isinstance(host, float):
            metrics[key] = host
        elif isinstance(host, dict):
            metrics.update({f"{key}/{k}": v for k, v in host.items()})
    return metrics


class SummaryAction(Action):
    """Writes loop outputs with a clu-style metric writer.

    - A per-step list of scalars from a train loop is written value by value at the step
      numbers it was produced at (``first_step + 1 ... state.step``); when the steps do
      not line up (eval loops, whose state does not advance) its mean is written at
      ``state.step``. An eval loop's mean weights each batch by its real examples (its
      ``mask`` sum, else its size: `EvalLoop.example_counts`, read from the ``loop``
      keyword the loop calls its actions with), so a smaller or padded last batch counts
      for what it holds: the mean over examples, not the mean of batch means.
    - Plain scalars (such as the loop's statistics) and clu metrics (computed) are written
      at ``state.step``.
    - `MetricWithMetadata` values go to the writer method of their type (images,
      histograms, text, video; scalars join the plain scalars), one call per type; for a
      per-step list the latest value is written. Another type (audio) is a ValueError,
      raised before anything is written, as in the reference: write audio with the
      writer's ``write_audios``.
    - A per-step list of other arrays (per-example logits, say) is not a summary and is
      skipped; scalars are recognised from shapes, so such lists are never copied to the
      host. Any other bare value goes to ``write_scalars`` as it is, as in the reference
      (a step-level action given per-example logits hands them to the writer, which
      decides: jaxloop's writers refuse them with an error naming the key and shape).

    In a multi-process job every process runs the loops and so this action (give the
    non-main processes a writer that drops or logs values): scalars are replicated and
    read locally; a `MetricWithMetadata` image or histogram spread over several processes
    is gathered whole (`multihost_utils.process_allgather`, a collective) before writing.

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

    SUPPORTED_TYPES = (MetricType.SCALAR, MetricType.HISTOGRAM, MetricType.IMAGE,
                       MetricType.VIDEO, MetricType.TEXT)

    def _write_typed(self, step: int, typed: dict[MetricType, dict[str, Any]]) -> None:
        writer = self._summary_writer
        methods = {MetricType.HISTOGRAM: "write_histograms", MetricType.IMAGE: "write_images",
                   MetricType.VIDEO: "write_videos"}
        for metric_type, values in typed.items():
            if metric_type == MetricType.TEXT:
                texts = {}
                for key, value in values.items():
                    text = value.item() if value.size == 1 else value.tolist()
                    texts[key] = text.decode() if isinstance(text, bytes) else str(text)
                writer.write_texts(step, texts)
            else:
                getattr(writer, methods[metric_type])(step, values)

    def __call__(
        self, state: State, outputs: Output | None, first_step: int | None = None,
        loop: Any = None, **kwargs: Any,
    ) -> None:
        if not outputs:
            return
        step = loop_lib.host_step(state)
        weights = example_weights(loop)
        per_step: dict[int, dict[str, float]] = {}
        at_step: dict[str, Any] = {}
        typed: dict[MetricType, dict[str, Any]] = {}
        items = []
        for key, value in outputs.items():
            if isinstance(value, list | tuple) and value and isinstance(
                value[-1], MetricWithMetadata
            ):
                value = value[-1]
            if isinstance(value, MetricWithMetadata) and value.type not in self.SUPPORTED_TYPES:
                raise ValueError(
                    f"Output {key!r} has metric type {value.type}, which SummaryAction does "
                    f"not write; supported: {[t.name for t in self.SUPPORTED_TYPES]}"
                )
            items.append((key, value))
        for key, value in items:
            if isinstance(value, MetricWithMetadata) and value.type == MetricType.SCALAR:
                value = value.value  # written with the plain scalars, as one of them
            if isinstance(value, MetricWithMetadata):
                # Gathered whole from every process (`fetch`), so process 0's writer sees
                # the global value a 1-process job would.
                typed.setdefault(value.type, {})[key] = np.asarray(fetch(value.value))
                continue
            host = _scalar_values(value)  # None for per-example arrays: never fetched
            if isinstance(host, list):
                if first_step is not None and step - first_step == len(host):
                    for i, number in enumerate(host):
                        per_step.setdefault(first_step + 1 + i, {})[key] = number
                else:
                    at_step[key] = _mean(host, weights)
            elif isinstance(host, dict):  # a clu Collection computes to a dict
                at_step.update({f"{key}/{k}": v for k, v in host.items()})
            elif isinstance(host, float):
                at_step[key] = host
            elif not isinstance(value, list | tuple):
                at_step[key] = value  # the reference's bare usage: the writer decides
        self._write_typed(step, typed)
        for s in sorted(per_step):
            self._summary_writer.write_scalars(s, per_step[s])
        if at_step:
            self._summary_writer.write_scalars(step, at_step)
        if self._flush_each_call:
            self._summary_writer.flush()


class CheckpointAction(Action):
    """Saves the whole training state with the user's orbax `CheckpointManager`.

    The save is asynchronous when the manager is (orbax copies the arrays off the device
    before `save` returns, so training continues while the files are written). A save that
    fails in the background is raised on the loop's thread at this action's next call (or
    by the next save, or `OuterLoop`'s final wait): orbax re-raises it from the manager's
    `wait_until_finished`, once. The train iterator's position (when it can report one)
    and the loop count are saved beside the state, so a resumed run reads the same batches
    and fires actions on the same loops. An iterator that cannot report its position (a
    generator, a tf.data iterator) is named in a warning at the first checkpoint: a resume
    replays its data from the start. Scalar outputs are passed as metrics (for `best_fn`
    policies); per-example outputs are recognised by shape and never copied to the host.

    Example::

        manager = ocp.CheckpointManager(workdir / 'ckpt',
                                        options=ocp.CheckpointManagerOptions(max_to_keep=3))
        train_loop = TrainLoop(step, end_actions=[CheckpointAction(manager, interval=5)])

    `meta` adds JSON values to every checkpoint's metadata (a mapping, or a function
    returning one), e.g. a tracker's run id: ``meta={'tracker_run_id': writer.run_id}``.

    Time-based saves: with `every_secs`, the action still looks every `interval` loops, but
    saves there only when `every_secs` seconds have passed since its last save (or since it
    was made), whatever the manager's step policy says. Process 0's `clock` decides and every
    process follows it (one broadcast per call in a multi-process job), so all processes save
    the same steps. A forced save (preemption) always saves and restarts the time. Example,
    look every loop, save at most every ten minutes::

        CheckpointAction(manager, interval=1, every_secs=600)
    """

    def __init__(
        self,
        ckpt_manager: ocp.CheckpointManager,
        interval: int = 1,
        meta: Mapping[str, Any] | Any = None,
        every_secs: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(interval)
        if every_secs is not None and (
            isinstance(every_secs, bool)
            or not isinstance(every_secs, (int, float))
            or not every_secs > 0
        ):
            raise ValueError(
                f"`every_secs` must be a positive number of seconds, got {every_secs!r}"
            )
        if not callable(clock):
            raise TypeError(f"`clock` must be a callable returning seconds, got {clock!r}")
        self._every_secs = every_secs
        self._clock = clock
        self._last_save_time = clock()
        self._ckpt_manager = ckpt_manager
        self._warned_no_position = False
        self._warned_later = False  # said once that a later checkpoint blocks saving
        self._extra_meta = meta
        self._resume_metadata: Any = None

    @property
    def every_secs(self) -> float | None:
        return self._every_secs

    def _time_due(self) -> bool:
        """Whether a time-based save is due: process 0's clock decides for every process
        (each calls the action at the same loop boundaries, so each reaches the agreement)."""
        return bool(agreement.agreed(
            lambda: self._clock() - self._last_save_time >= self._every_secs))

    @property
    def ckpt_manager(self) -> ocp.CheckpointManager:
        return self._ckpt_manager

    def save(self, step: int, state: State, outputs: Output | None = None) -> bool:
        """Saves `state` alone at `step` as the manager's one PyTree item, with the scalar
        outputs as metrics: the reference's building block, for a manager made the
        reference's way. A subclass that overrides it saves its own way in `__call__`;
        otherwise `__call__` also saves the data position and loop count (`checkpoint.save`).

        Example::

            CheckpointAction(ocp.CheckpointManager(path)).save(0, {'a': 0})
        """
        return self._ckpt_manager.save(
            step, args=ocp.args.PyTreeSave(state), metrics=scalar_metrics(outputs))

    def set_resume_metadata(self, metadata: Any) -> None:
        """Saves ``metadata.save()`` (a dict of JSON values) in each checkpoint's metadata,
        beside the data position and loop count: an `OuterLoop` gives its
        `resume.ResumeMetadata` (history, early-stopping progress, where the loop stands)
        this way. None: no more of it."""
        self._resume_metadata = metadata

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
        step = loop_lib.host_step(state)
        if not self._ckpt_manager.is_saving_in_progress():
            # A finished background save that failed raises here, on the loop's thread.
            self._ckpt_manager.wait_until_finished()
        if self._every_secs is not None and not force:
            if not self._time_due() or step in self._ckpt_manager.all_steps():
                return False
            force = True  # the time policy decides, not the manager's step policy
        if self._every_secs is not None:
            self._last_save_time = self._clock()
        from jaxloop import data  # noqa: PLC0415 (grain loads only when checkpointing)

        iterator = getattr(loop, "dataset", None)
        position = getattr(loop, "data_position", None)  # knows about prefetched batches
        dataset_state = (
            position(iterator) if callable(position) else data.iterator_state(iterator)
        )
        if dataset_state is None and iterator is not None and not self._warned_no_position:
            self._warned_no_position = True
            log.warning(
                "The train iterator (%s) cannot report its position, so checkpoints hold no "
                "data position: a resumed run will replay the data from the start. Use a "
                "grain dataset or data.GlobalBatchDataset to resume the data exactly.",
                data.describe_iterator(iterator),
            )
        extra = self._extra_meta() if callable(self._extra_meta) else self._extra_meta
        meta = {**(extra or {}), "loop_count": getattr(loop, "loop_count", None)}
        if self._resume_metadata is not None:
            meta.update(self._resume_metadata.save())
        if type(self).save is not CheckpointAction.save:
            saved = self.save(step, state, outputs)  # code written against the reference
        else:
            saved = checkpoint.save(
                self._ckpt_manager, step, state, meta=meta,
                metrics=scalar_metrics(outputs, loop=loop),
                force=force, dataset_state=dataset_state,
            )
        if saved:
            log.info("Saving checkpoint for step %d to %s.", step, self._ckpt_manager.directory)
        elif not self._warned_later:
            latest = self._ckpt_manager.latest_step()  # the manager's own record: no listing
            if latest is not None and latest > step:
                self._warned_later = True
                log.warning(
                    "CheckpointAction saves nothing at step %d: %s already holds a later "
                    "checkpoint (step %d), and orbax saves only steps after the latest. Use a "
                    "new directory, or resume from it (OuterLoop's checkpoint_spec).",
                    step, self._ckpt_manager.directory, latest)
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
        if loop_lib.host_step(state) in self._ckpt_manager.all_steps():
            return False  # several evals after one train loop: the first one is offered
        # The metrics reduced here, where the eval loop's example counts weight its means;
        # the loop itself is not passed on (its data position and count are not saved).
        return super().__call__(state, scalar_metrics(outputs, loop=loop), force=force)


class EarlyStoppingAction(Action):
    """Stops training when a monitored metric stops improving (or becomes NaN).

    Raises `StopTrainingError` (carrying the best step and metric); `OuterLoop` catches it
    and ends training cleanly. Put it on an eval loop's end actions. The metric is the
    mean of the loop's per-step values (or the computed clu metric); any name that
    `scalar_metrics` reports works, e.g. ``'metrics/accuracy'`` for the ``accuracy`` member
    of a clu Collection output ``'metrics'``. The messages are
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

    def __call__(self, state: State, outputs: Output | None, loop: Any = None,
                 **kwargs: Any) -> Output | None:
        step = loop_lib.host_step(state)
        name = self.monitored_metric
        if outputs is not None and name in outputs:
            metric = scalar_summary(outputs[name], example_weights(loop))  # over examples
        else:
            # Any name `scalar_metrics` reports, such as a clu Collection's ``key/member``.
            reported = scalar_metrics(outputs, loop=loop)
            if name not in reported:
                log.warning(
                    "Early stopping action '%s' is monitoring metric '%s' which is not "
                    "available in the outputs dictionary. Available metrics are: %s",
                    type(self).__name__,
                    name,
                    sorted({*(outputs or {}), *reported}) if outputs is not None else None,
                )
                return outputs
            metric = reported[name]
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


StepNumberFileWriter = LocalFileStepNumberWriter
"""The step-number file writer (an alias of `step_number_writer.LocalFileStepNumberWriter`)."""


class StepNumberAction(Action):
    """Reports the state's step to a `StepNumberWriter` (anything with ``write(step)``).

    Example::

        StepNumberAction(LocalFileStepNumberWriter(workdir / 'steps.txt'))
    """

    def __init__(self, step_writer: StepNumberWriter, interval: int = 1):
        super().__init__(interval)
        if not callable(getattr(step_writer, "write", None)):
            raise TypeError(
                "StepNumberAction needs a StepNumberWriter (an object with write(step_number)), "
                f"got {step_writer!r}"
            )
        self._step_writer = step_writer

    @property
    def step_writer(self) -> StepNumberWriter:
        return self._step_writer

    def __call__(self, state: State, outputs: Output | None = None, **kwargs: Any) -> None:
        self._step_writer.write(loop_lib.host_step(state))


class ProgressAction(Action):
    """A progress bar: a text bar in terminals and in notebooks without ipywidgets (no
    warning about the widget), tqdm's widget in notebooks that have it.

    Shows step/total, one rate, the latest train `metric` and, given a `history` (as
    `OuterLoop` gives its own), the latest evaluation's results with the step they were
    evaluated at (``eval at step 400: accuracy=0.98, loss=0.07``: an evaluation runs
    after the train loop that reached its step, so the bar may be further on); updated at
    each loop end (never per step, which would need a host sync). The rate is steps per
    second of wall-clock time between two updates, each taken once the loop's values are on
    the host: the first loop (which compiles) shows none. `enabled=None` shows the bar only
    when the output is interactive.

    Example::

        TrainLoop(step, end_actions=[ProgressAction(total_steps=1000)])
    """

    # tqdm's own rate and estimate would count the compilation and dispatch: left out.
    _BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    _COUNTER_FORMAT = "{desc}: {n_fmt} steps [{elapsed}{postfix}]"  # no total_steps

    def __init__(
        self,
        total_steps: int | None = None,
        metric: str = "loss",
        interval: int = 1,
        enabled: bool | None = None,
        desc: str = "train",
        history: Any = None,
    ):
        super().__init__(interval)
        self._total = total_steps
        self._metric = metric
        self._enabled = enabled
        self._desc = desc
        self._history = history
        self._bar: Any = None
        self._last: tuple[int, float] | None = None  # (step, time) of the last update
        self._postfix: dict[str, str] = {}

    @staticmethod
    def _interactive() -> bool:
        # A notebook kernel or a terminal; never a log file or a test run, and no tqdm
        # object (nor its monitor thread) is created when not shown.
        return "ipykernel" in sys.modules or sys.stderr.isatty()

    @staticmethod
    def _bar_class() -> Any:
        """tqdm's widget bar in a notebook that has ipywidgets, else its text bar (which a
        notebook shows as one line updated in place). `tqdm.auto` would warn, in every
        cell that trains, that ipywidgets is missing, before falling back to the same
        text bar."""
        import importlib.util  # noqa: PLC0415

        if "ipykernel" in sys.modules and importlib.util.find_spec("ipywidgets") is not None:
            from tqdm.auto import tqdm  # noqa: PLC0415 (only when a bar is shown)
        else:
            from tqdm.std import tqdm  # noqa: PLC0415
        return tqdm

    def _latest_eval(self) -> dict[str, str]:
        """The latest evaluation's results, keyed by the text the bar shows them under."""
        names = [n for n in self._history.names if n.startswith("eval/")]
        if not names:
            return {}
        series = {n.removeprefix("eval/"): self._history[n] for n in names}
        step = max(s.steps[-1] for s in series.values() if s.steps)
        values = ", ".join(f"{k}={s.values[-1]:.4g}" for k, s in series.items()
                           if s.steps and s.steps[-1] == step)
        return {f"eval at step {step}": values}

    def _latest(self, outputs: Output | None) -> dict[str, str]:
        """The latest train metric and evaluation results, as the bar shows them."""
        shown = {}
        if self._history is not None:
            train = self._history.latest("train")
            if self._metric in train:
                shown[self._metric] = f"{train[self._metric]:.4g}"
            return shown
        values = (outputs or {}).get(self._metric)
        if isinstance(values, list) and values:
            # The last step's value; a clu metric is computed first.
            shown[self._metric] = f"{float(jax.device_get(_computed(values[-1]))):.4g}"
        return shown

    def _show(self, refresh: bool = True) -> None:
        evaluated = self._latest_eval() if self._history is not None else {}
        parts = [f"{k}={v}" for k, v in self._postfix.items()]
        parts += [f"{k}: {v}" for k, v in evaluated.items()]
        self._bar.set_postfix_str(", ".join(parts), refresh=refresh)

    def __call__(self, state: State, outputs: Output | None, **kwargs: Any) -> None:
        if self._enabled is None:
            self._enabled = self._interactive()
        if not self._enabled:
            return
        step = loop_lib.host_step(state)
        if self._bar is None:
            self._bar = self._bar_class()(
                total=self._total, initial=kwargs.get("first_step") or 0, desc=self._desc,
                unit="step", dynamic_ncols=True,
                bar_format=self._COUNTER_FORMAT if self._total is None else self._BAR_FORMAT)
        bar = self._bar
        postfix = self._latest(outputs)  # read from the device: the loop's steps are done
        now = time.perf_counter()
        if self._last is not None and step > self._last[0] and now > self._last[1]:
            self._postfix["steps/s"] = f"{(step - self._last[0]) / (now - self._last[1]):.1f}"
        self._last = (step, now)
        self._postfix.update(postfix)
        # The step and what belongs to it shown together: the text first, then the step.
        self._show(refresh=False)
        bar.update(max(step - bar.n, 0))
        bar.refresh()

    def close(self) -> None:
        """Closes the bar (OuterLoop does this when training ends), showing the last
        evaluation's results first."""
        if self._bar is not None:
            self._show()
            self._bar.close()
            self._bar = None
