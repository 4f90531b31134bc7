"""OuterLoop: orchestrates train loops and eval loops until training is done.

Modes:
- train only: ``outer(state, train_dataset=..., train_total_steps=..., train_loop_steps=...)``
- train + evals: add ``eval_specs=[EvalSpec(eval_ds), ...]`` with one EvalLoop per spec.
- eval only: no train loop. With a `CheckpointSpec` it evaluates every new checkpoint in the
  directory once, in step order (continuous eval), until the training job writes its
  ``STOPPED`` marker (beside the checkpoint directory, see `stop_marker_path`) or
  ``iterate_stop_fn()`` says stop; without one it evaluates the given state once. It
  returns the last eval loop's state and outputs. A checkpoint the trainer's
  ``max_to_keep`` deletes before it is read (its directory is gone) is skipped with a
  warning; one that is there but does not restore (a corrupt file, another model's shapes)
  is a ValueError naming its step and the cause.

With several processes every decision that gates a collective is process 0's, taken by all
(`agreement`): which checkpoint training resumes from, which checkpoints continuous eval
reads, whether the marker or ``iterate_stop_fn()`` ends it, and whether a checkpoint that
failed to restore on any process is gone (skipped) or an error; so every process evaluates
the same steps.

The schedule is a function of the step: with ``train_loop_steps=n`` train loops end at
multiples of n (and at ``train_total_steps``). A resumed run keeps it: the loop count comes
back from the checkpoint (``step // n`` for one without jaxloop's metadata, such as the
guide's single-item manager writes), and from a checkpoint saved inside a loop (a
preemption's) the resumed run finishes that loop, to the next multiple of n; so
evaluations, checkpoints and actions fall on the steps of the uninterrupted run (plus the
preemption's own save). A train loop's evaluations run first among its end actions, so
the checkpoint saved at its end holds them (in the history and the early-stopping
progress): a resumed run neither repeats nor loses the evaluation at its step.

Training ends at ``train_total_steps``, when the train iterator is exhausted (with a
warning, after evaluating at the step reached), when a train or eval loop puts a truthy
``STOP_LOOP`` in its outputs, or when an action raises `StopTrainingError` (early
stopping); a stop by Ctrl-C or a preemption raises instead (`preemption.Interrupted` /
`preemption.Preempted`, see `OuterLoop`). It returns the state and the outputs of the last
train loop that advanced the step, with ``outputs[STOP_LOOP]`` telling whether a
train or eval loop asked to stop (as google/jaxloop does).

Example::

    outer = OuterLoop(train_loop=train_loop, eval_loops=[eval_loop])
    state, outputs = outer(
        state,
        train_dataset=train_iter,
        train_total_steps=1000,
        train_loop_steps=100,
        eval_specs=[EvalSpec(dataset=eval_ds, num_steps=50)],
    )
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
from etils import epath

from jaxloop import actions as actions_lib
from jaxloop import agreement, async_action_context, checkpoint, preemption, stop_handler, types
from jaxloop import debugging as debugging_lib
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import history as history_lib
from jaxloop import loop as loop_lib
from jaxloop import param_table as param_table_lib
from jaxloop import prefetch as prefetch_lib
from jaxloop import step as step_lib
from jaxloop import train_loop as train_loop_lib

Output = types.Output
State = types.TrainState

STOP_LOOP = "jaxloop/stop_loop"
_STOP_FILE_NAME = "STOPPED"
_EARLY_STOPPING_META = "early_stopping"
_EVALS_PENDING_META = "evals_pending"
_HISTORY_META = "history"
# Whether the checkpoint's loop ended before its boundary (a preemption inside a loop, or
# ``train_total_steps`` off a multiple of ``train_loop_steps``): its saved loop count then
# includes a loop that the resumed run finishes.
_LOOP_PARTIAL_META = "loop_partial"
DEFAULT_ITERATE_INTERVAL_SECS = 10.0
# How long continuous eval waits for the directory of a checkpoint that failed to restore to
# disappear (a deletion under way) before it takes the failure for an error.
_DELETION_SECS = 5.0

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalContext:
    """What `EvalSpec.should_eval_fn` is told when deciding whether to evaluate."""

    is_continuous_eval: bool
    step_num: int
    loop_count: int


@dataclasses.dataclass
class EvalSpec:
    """One evaluation: its data and when to run it.

    Args:
      dataset: an iterable (list, tf.data/grain/tfds dataset, ...) iterated afresh for
        every evaluation.
      dataset_iterator: alternatively, one iterator that successive evaluations continue.
      num_steps: steps per evaluation (None: until the dataset ends).
      eval_loop_interval: evaluate every this many train loops (default every loop).
      should_eval_fn: ``fn(EvalContext) -> bool``; overrides `eval_loop_interval`.
    """

    dataset: Iterable[Any] | None = None
    dataset_iterator: Iterator[Any] | None = None
    num_steps: int | None = None
    eval_loop_interval: int | None = None
    should_eval_fn: Callable[[EvalContext], bool] | None = None

    def __post_init__(self) -> None:
        if self.dataset is None and self.dataset_iterator is None:
            raise ValueError("EvalSpec needs a dataset (or a dataset_iterator)")
        if self.num_steps is not None and self.num_steps <= 0:
            raise ValueError(f"EvalSpec.num_steps must be positive, got {self.num_steps}")
        if self.eval_loop_interval is not None and self.eval_loop_interval <= 0:
            raise ValueError(
                f"EvalSpec.eval_loop_interval must be positive, got {self.eval_loop_interval}"
            )

    def iterator(self) -> Iterator[Any]:
        """The batches for one evaluation."""
        if self.dataset_iterator is not None:
            return self.dataset_iterator
        from jaxloop import data  # noqa: PLC0415 (grain is only needed with datasets)

        return data.as_iterator(self.dataset)

    def should_eval(self, context: EvalContext) -> bool:
        if self.should_eval_fn is not None:
            return bool(self.should_eval_fn(context))
        interval = self.eval_loop_interval or 1
        return context.is_continuous_eval or context.loop_count % interval == 0


@dataclasses.dataclass
class CheckpointSpec:
    """Where checkpoints live, for resuming training and for continuous evaluation.

    Args:
      checkpoint_dir: the orbax checkpoint directory.
      iterate_interval_secs: continuous eval looks for new checkpoints every this many
        seconds (a pause between listings of a possibly remote directory).
      iterate_stop_fn: ``fn() -> bool``, asked by continuous eval whenever it has
        evaluated every checkpoint there is; True ends it (with several processes, process
        0 asks and every process follows). By default it ends when the training job has
        written its ``STOPPED`` marker (at `stop_marker_path` ``(checkpoint_dir)``, or
        inside the directory where earlier releases and google/jaxloop write it).
        ``lambda: True`` evaluates the checkpoints present once and returns.
      transforms: orbax restore transforms, passed to `Step.restore_model` (see
        `checkpoint.restore`), e.g. ``{r'params/head/.*': ocp.Transform(use_fallback=True)}``.
    """

    checkpoint_dir: Any
    iterate_interval_secs: float = DEFAULT_ITERATE_INTERVAL_SECS
    iterate_stop_fn: Callable[[], bool] | None = None
    transforms: Any = None

    def __post_init__(self) -> None:
        if not self.iterate_interval_secs >= 0:
            raise ValueError(
                f"iterate_interval_secs must be >= 0 seconds, got {self.iterate_interval_secs}"
            )


def stop_marker_path(checkpoint_dir: Any) -> epath.Path:
    """Where a finished training run marks its checkpoint directory as complete.

    The marker is a sibling of the directory (``<dir>.STOPPED``: ``/run/checkpoints`` gives
    ``/run/checkpoints.STOPPED``), so the directory itself holds only what orbax writes
    (its step folders) and code that lists it counts checkpoints only. A directory with no
    parent to put it in (a file-system or bucket root) keeps it inside, as ``STOPPED``.
    """
    path = epath.Path(checkpoint_dir)
    parent = path.parent
    if not path.name or parent == path or (not parent.name and "://" in str(path)):
        return path / _STOP_FILE_NAME
    return parent / f"{path.name}.{_STOP_FILE_NAME}"


def _marker_paths(checkpoint_dir: Any) -> list[epath.Path]:
    """The marker's place, then its place inside the directory (earlier jaxloop releases
    and google/jaxloop write it there)."""
    return list(dict.fromkeys([stop_marker_path(checkpoint_dir),
                               epath.Path(checkpoint_dir) / _STOP_FILE_NAME]))


def _marker_step(directory: epath.Path) -> int | None:
    """The step recorded in the STOPPED marker, -1 for a marker without one, None if none."""
    for marker in _marker_paths(directory):
        try:
            text = marker.read_text()
        except FileNotFoundError:
            continue
        match = re.search(r"step (\d+)", text)
        return int(match.group(1)) if match else -1
    return None


def _resumed_loop_count(meta: dict[str, Any], step: int,
                        loop_steps: int | None) -> tuple[int | None, bool]:
    """(the loop count to resume with, whether the checkpoint is inside a loop).

    The count is jaxloop's saved one where the metadata has it, less the loop the
    checkpoint cut short (the resumed run finishes that loop); else ``step // loop_steps``
    (checkpoints saved without jaxloop's metadata), or None when neither is known.
    """
    saved = meta.get("loop_count")
    if saved is None:
        count = step // loop_steps if loop_steps else None
        return count, bool(loop_steps) and step % loop_steps != 0
    count = int(saved)
    partial = meta.get(_LOOP_PARTIAL_META)
    if partial is None:
        # Earlier releases did not say; their count includes a loop cut off the boundary.
        partial = bool(loop_steps) and step % loop_steps != 0 and count == step // loop_steps + 1
    return (max(count - 1, 0) if partial else count), bool(partial)


class OuterLoop:
    """Runs train loops and eval loops (see the module docstring for the modes).

    Args:
      train_loop: the TrainLoop, or None for eval-only use.
      eval_loops: one EvalLoop per EvalSpec passed at call time.
      checkpoint_spec: restore from / evaluate the checkpoints in this directory.
      progress: show a progress bar (None: only when interactive).
      prefetch: batches to read and prepare in a background thread while the current step
        runs (0: none), through `Loop.prefetching`: preprocessed, and placed on the devices
        where that pays (`prefetch.places_ahead`: off CPUs). None: `prefetch.default_size`
        (2 where batches are placed ahead, else 0). The loops still receive
        the very iterator you pass (custom loops may check it, read its attributes, call
        its methods), and its saved position counts only the batches trained on.
      disable_jit / post_mortem: debugging switches (`jaxloop.debugging`): steps run
        without jit; an error in a step or action enters the post-mortem debugger in an
        interactive session. None: from ``JAXLOOP_DISABLE_JIT`` / ``JAXLOOP_POST_MORTEM``.
      resume: resume training from the latest checkpoint of `checkpoint_spec`'s directory,
        or without one, of the directory the train loop's `CheckpointAction` saves to (as
        Keras' ``BackupAndRestore`` resumes from its own directory); it logs "Resumed from
        step N of DIR". A checkpoint is read when it is at or after the given state's step
        (a live state ahead of the directory, one whose save is still being written, is
        kept). False: train from the given state; a run whose checkpoint action could then
        save nothing (its directory holds a later checkpoint, and orbax saves only steps
        after the latest) raises a ValueError before training.

    The latest live state is `state`: the state a call returned, or where Ctrl-C or a
    preemption stopped it. A notebook's "continue" cell is always
    ``state, _ = outer(outer.state, ...)``, however the previous call ended.

    Stopping: Ctrl-C (a notebook's Stop) ends training at the next step boundary (an
    evaluation at its next batch), SIGTERM or `preemption.request()` at the next step (the
    same step on every process). The run saves with the train loop's checkpoint action if
    it has one, then raises `preemption.Interrupted` (a `KeyboardInterrupt`, so "Run all"
    stops) or `preemption.Preempted` (a `SystemExit` with status 143 when uncaught), each
    carrying the live state, its step and whether it was saved. `preempted` is then True
    and `stopped_state` holds the live state (None after a run that was not stopped);
    `state` holds it either way.

    Example, a notebook's cells::

        outer = OuterLoop(TrainLoop(train_step), [EvalLoop(eval_step)])
        state, _ = outer(state, train_dataset=it, train_total_steps=500,
                         eval_specs=[EvalSpec(dataset=eval_ds)])  # Stop, or it finishes
        state, _ = outer(outer.state, train_dataset=it, train_total_steps=1000,
                         eval_specs=[EvalSpec(dataset=eval_ds)])  # run it again: goes on
    """

    def __init__(
        self,
        train_loop: train_loop_lib.TrainLoop | None = None,
        eval_loops: Sequence[eval_loop_lib.EvalLoop] | None = None,
        checkpoint_spec: CheckpointSpec | None = None,
        progress: bool | None = None,
        prefetch: int | None = None,
        disable_jit: bool | None = None,
        post_mortem: bool | None = None,
        resume: bool = True,
    ):
        self._debugging = (disable_jit, post_mortem)
        if not isinstance(resume, bool):
            raise TypeError(f"resume must be True or False, got {resume!r}")
        self._resume = resume
        self._state: State | None = None
        # Per eval spec: whether an evaluation that read no batch was reported.
        self._warned_empty: set[int] = set()
        # The train loop's evaluations, run among its end actions (`_EvalsAtLoopEnd`): None
        # until they run in the current loop, then whether they asked to stop.
        self._loop_evals: bool | None = None
        self._specs: list[EvalSpec] = []
        # (the step the last training call ended at, whether inside a loop)
        self._ended: tuple[int, bool] | None = None
        if prefetch is not None and prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self._train_loop = train_loop
        self._prefetch = prefetch
        self.preempted = False
        self.stopped_state: State | None = None
        self._eval_loops = list(eval_loops or [])
        self._checkpoint_spec = checkpoint_spec
        self._progress = progress
        self._evals_pending = False
        self._planned_steps: int | None = None
        self._cut_by_total = False
        # The scalars of every loop this OuterLoop ran, across calls (`jaxloop.history`).
        self.history = history_lib.History()
        self._logged_layouts: list[Any] = []

    @property
    def train_loop(self) -> train_loop_lib.TrainLoop | None:
        return self._train_loop

    @property
    def state(self) -> State | None:
        """The latest live state: what the last call returned, or the state where Ctrl-C or
        a preemption stopped it (None before the first call).

        Unlike `stopped_state` it is never None after a call, so a notebook's "continue"
        cell can be run any number of times::

            state, _ = outer(outer.state, train_dataset=it, train_total_steps=1000,
                             eval_specs=[EvalSpec(dataset=eval_ds)])
        """
        return self._state

    @property
    def eval_loops(self) -> list[eval_loop_lib.EvalLoop]:
        return self._eval_loops

    def _ahead(self, loop: Any) -> int:
        """How many batches `loop` reads ahead: the size given, else by its step's devices."""
        return self._prefetch if self._prefetch is not None else prefetch_lib.default_size(
            loop.step)

    def _check_eval_specs(self, eval_specs: Sequence[EvalSpec] | None) -> list[EvalSpec]:
        specs = list(eval_specs or [])
        if len(specs) != len(self._eval_loops):
            raise ValueError(
                f"OuterLoop has {len(self._eval_loops)} eval loops but was given "
                f"{len(specs)} eval specs; pass one EvalSpec per eval loop"
            )
        for i, spec in enumerate(specs):
            if not isinstance(spec, EvalSpec):
                raise TypeError(f"eval_specs[{i}] must be an EvalSpec, got {type(spec)}")
        return specs

    def _run_evals(
        self, state: State, specs: Sequence[EvalSpec], context: EvalContext
    ) -> tuple[list[Output | None], bool]:
        results: list[Output | None] = []
        stop = False
        for index, (loop, spec) in enumerate(zip(self._eval_loops, specs, strict=True)):
            if not spec.should_eval(context):
                results.append(None)
                continue
            batches = spec.iterator()
            # Batches read ahead would be lost to the next evaluation of a shared iterator.
            ahead = self._ahead(loop) if spec.dataset_iterator is None else 0
            with loop.prefetching(batches, ahead):
                _, outputs = loop(state, batches, num_steps=spec.num_steps)
            if getattr(loop, "num_steps_run", None) == 0 and not preemption.requested():
                self._report_empty(index, spec, context.step_num)
            results.append(outputs)
            stop = stop or bool((outputs or {}).get(STOP_LOOP, False))
        return results, stop

    def _report_empty(self, index: int, spec: EvalSpec, step: int) -> None:
        """Says, once per spec, that an evaluation read no batch, and why: an iterator
        given as `EvalSpec.dataset` is used up by the first evaluation, and every later
        one would silently report nothing new."""
        if index in self._warned_empty:
            return
        self._warned_empty.add(index)
        if spec.dataset_iterator is not None:
            cause = "its dataset_iterator is exhausted"
        elif isinstance(spec.dataset, Iterator):
            cause = (f"its dataset is an iterator ({type(spec.dataset).__name__}), which an "
                     "earlier evaluation used up")
        else:
            cause = "its dataset is empty"
        log.warning(
            "eval_specs[%d]: the evaluation at step %d read no batch: %s, so this and later "
            "evaluations have no results (the progress bar keeps the last ones). Pass an "
            "iterable that every evaluation reads afresh as EvalSpec(dataset=...): a list, "
            "a tf.data or grain dataset.", index, step, cause)

    def __call__(
        self,
        state: State,
        train_dataset: Iterator[Any] | Iterable[Any] | None = None,
        train_total_steps: int | None = None,
        train_loop_steps: int | None = None,
        eval_specs: Sequence[EvalSpec] | None = None,
        log_train_total_steps: bool = True,
    ) -> tuple[State, Output | None]:
        """Runs training and evaluation.

        Returns, as google/jaxloop does: when training, the final state and the outputs of
        the last train loop that advanced the step, with ``outputs[STOP_LOOP]`` set to
        whether a train or eval loop asked to stop; when only evaluating, the last eval
        loop's state and outputs.
        """
        specs = self._check_eval_specs(eval_specs)
        if self._train_loop is None:
            with (self.history.recording(None, self._eval_loops),
                  debugging_lib.session(*self._debugging)):
                state, outputs = self._evaluate_only(state, specs)
                self._state = state
                return state, outputs
        if train_dataset is None:
            raise ValueError("OuterLoop has a train loop but no train_dataset was given")
        for name, value in (("train_total_steps", train_total_steps),
                            ("train_loop_steps", train_loop_steps)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        with (self.history.recording(self._train_loop, self._eval_loops),
              debugging_lib.session(*self._debugging)):
            return self._train(
                state, train_dataset, train_total_steps, train_loop_steps, specs,
                log_train_total_steps,
            )

    def _early_stopping_actions(self) -> list[actions_lib.EarlyStoppingAction]:
        loops = [self._train_loop, *self._eval_loops]
        return [
            a for lp in loops if lp is not None for a in lp.end_actions
            if isinstance(a, actions_lib.EarlyStoppingAction)
        ]

    def _early_stopping_meta(self) -> list[dict[str, Any]]:
        return [a.state_dict() for a in self._early_stopping_actions()]

    def _loop_partial(self) -> bool:
        """Whether the train loop that just ran ended before its boundary: cut short (by a
        preemption) or by ``train_total_steps``. Read for the checkpoint metadata while
        the loop's end actions run, and by a preemption's save right after."""
        loop = self._train_loop
        planned = self._planned_steps
        short = bool(loop.preempted) if planned is None else loop.num_steps_run < planned
        return self._cut_by_total or short

    def _train_checkpoint_actions(self) -> list[actions_lib.CheckpointAction]:
        """The train loop's actions that save the state to resume from (not best-k ones)."""
        return [a for a in self._train_loop.end_actions
                if isinstance(a, actions_lib.CheckpointAction)
                and not isinstance(a, actions_lib.BestCheckpointAction)]

    @staticmethod
    def _latest(directory: Any) -> int | None:
        # Process 0's listing decides for every process (a shared directory may show
        # processes different contents at the same moment).
        steps = agreement.agreed(lambda: checkpoint.all_steps(directory))
        return max(steps) if steps else None

    def _resume_directory(self) -> Any:
        """Where training resumes from: the CheckpointSpec's directory, else the train
        loop's checkpoint action's (None: nowhere, or `resume=False`)."""
        if not self._resume:
            return None
        if self._checkpoint_spec is not None:
            return self._checkpoint_spec.checkpoint_dir
        for action in self._train_checkpoint_actions():
            directory = getattr(action.ckpt_manager, "directory", None)
            if directory is not None:
                return directory
        return None

    def _restore(self, state: State, iterator: Iterator[Any], loop_steps: int | None
                 ) -> tuple[State, bool, int]:
        """The state to train from, whether it came from a checkpoint, and its step."""
        self._evals_pending = False
        step = self._train_loop.step
        for action in self._train_checkpoint_actions():
            # A save still being written (a Stop's) is listed once it is finished.
            action.ckpt_manager.wait_until_finished()
        # The call's one read of the state's step (a loop boundary); an abstract state
        # (`Step.abstract_state`) has none: it is restored straight into place, or
        # initialised by the step when there is nothing to restore.
        given = None if step_lib.is_abstract(state) else loop_lib.host_step(state)
        directory = self._resume_directory()
        latest = None if directory is None else self._latest(directory)
        if directory is None or (latest is not None and given is not None and given > latest):
            if directory is not None:
                log.info("Training from the given state (step %d), ahead of the latest "
                         "checkpoint in %s (step %d).", given, directory, latest)
            state = step.materialize(state)
            return state, False, loop_lib.host_step(state) if given is None else given
        spec = self._checkpoint_spec
        # One read: the arrays, and the host data that lives beside them (the iterator
        # takes its position here, the loop its count and early stopping its progress below).
        restored, meta = checkpoint.restore(
            state, directory, step=latest, partitioner=step.partitioner,
            skip_optimizer=not step.train, transforms=spec.transforms if spec else None,
            dataset=iterator)
        restored = step.materialize(restored)
        if latest is None:
            return restored, False, loop_lib.host_step(restored) if given is None else given
        loop_count, partial = _resumed_loop_count(meta, latest, loop_steps)
        if loop_count is not None:
            self._train_loop.loop_count = loop_count
        saved = meta.get(_EARLY_STOPPING_META) or []
        for action, progress in zip(self._early_stopping_actions(), saved, strict=False):
            action.load_state_dict(progress)
        self.history.load_state_dict(meta.get(_HISTORY_META))
        # A checkpoint inside a loop has no evaluations after it (earlier releases said so
        # at a preemption inside a loop).
        self._evals_pending = bool(meta.get(_EVALS_PENDING_META)) and not partial
        return restored, True, latest

    def _check_saves(self, step: int) -> None:
        """Fails before training where the train loop's checkpoint action would save
        nothing: its directory holds a checkpoint after `step` (orbax saves only steps
        after the latest), so the run would train and keep none of it."""
        for action in self._train_checkpoint_actions():
            directory = getattr(action.ckpt_manager, "directory", None)
            latest = None if directory is None else self._latest(directory)
            if latest is not None and latest > step:
                how = ("resuming is off (OuterLoop(resume=False))" if not self._resume else
                       f"this run resumed from {self._checkpoint_spec.checkpoint_dir}")
                raise ValueError(
                    f"This run would save no checkpoint until after step {latest}: it starts "
                    f"at step {step}, its CheckpointAction saves to {directory}, which holds "
                    f"a checkpoint at step {latest}, and orbax saves only steps after the "
                    f"latest ({how}). Resume from that directory (OuterLoop's default, "
                    "resume=True, with no CheckpointSpec elsewhere), save to a new "
                    "directory, or delete its checkpoints.")

    def _report_rewind(self, step: int) -> None:
        """Says which steps of the history a run started at an earlier step replaces."""
        later = self.history.steps_after(step)
        if later is not None:
            log.warning(
                "Training from step %d, before the end of this OuterLoop's history: what it "
                "holds at steps %d-%d (%s) is replaced by this run's values as they are "
                "recorded. Copy outer.history.as_dict() first to keep it, or continue from "
                "outer.state.", step, later[0], later[1], ", ".join(later[2]))

    def _evals_at_loop_end(self, state: State, outputs: Output | None,
                           first_step: int | None) -> None:
        """The evaluations of the train loop that is ending, run first among its end
        actions, before its checkpoint action (`_EvalsAtLoopEnd`)."""
        loop = self._train_loop
        if (loop.preempted or preemption.requested() or not loop.num_steps_run
                or (outputs or {}).get(STOP_LOOP)):
            return  # a stop (the outer loop ends the run), or no new step to evaluate
        step = (first_step or 0) + loop.num_steps_run
        stop = self._evaluate(state, step)
        if not preemption.requested():  # (cut short by Ctrl-C: pending in the checkpoint)
            self._loop_evals = stop

    def _evaluate(self, state: State, step: int) -> bool:
        """Runs the evaluations due after the train loop at `step`; whether to stop."""
        try:
            _, stop = self._run_evals(
                state, self._specs, EvalContext(False, step, self._train_loop.loop_count))
        except stop_handler.StopTrainingError as e:
            log.info("Training stopped by an eval action: %s", e)
            stop = True
        return stop

    @contextlib.contextmanager
    def _evaluating_before_saves(self) -> Iterator[None]:
        """Puts the evaluations first among the train loop's end actions (after the
        history's recorder): the checkpoint of a loop's end then holds that loop's
        evaluation (history, early-stopping progress), so a resumed run neither loses the
        evaluation at its last step nor writes it twice. (Before the user's own actions,
        so that none of them, e.g. a timing span around the checkpoint action, encloses
        the evaluations.)"""
        end_actions = self._train_loop.end_actions
        runner = _EvalsAtLoopEnd(self)
        first = next((i for i, a in enumerate(end_actions)
                      if not isinstance(a, history_lib._Recorder)), len(end_actions))
        end_actions.insert(first, runner)
        try:
            yield
        finally:
            end_actions.remove(runner)

    def _train(
        self,
        state: State,
        train_dataset: Any,
        total_steps: int | None,
        loop_steps: int | None,
        specs: list[EvalSpec],
        log_total_steps: bool,
    ) -> tuple[State, Output | None]:
        from jaxloop import data  # noqa: PLC0415

        train_loop = self._train_loop
        iterator = data.as_iterator(train_dataset)
        self._remove_stale_marker()
        given = state
        # A run resumed inside a loop finishes that loop first, to its boundary.
        state, align, step = self._restore(state, iterator, loop_steps)
        if not align and self._ended == (step, True) and loop_steps and step % loop_steps:
            # The live state of this OuterLoop's last call, which a Stop ended inside a loop:
            # finish that loop, as a resume does,
            # so evaluations and actions stay on the steps and loops of an uninterrupted run.
            align = True
            train_loop.loop_count = max(train_loop.loop_count - 1, 0)
        self._ended = None
        self._state = state
        self._check_saves(step)
        self._report_rewind(step)
        layout = jax.tree.structure(state)
        if layout not in self._logged_layouts:
            # Once per state structure, not at every call of a notebook's training cell.
            param_table_lib.log_table(state)  # process 0 logs the state's layout
            self._logged_layouts.append(layout)
        # A state restored or built here is this run's own: the train loop donates it
        # without a copy. The caller's own state is copied once by the first train loop.
        owned = state is not given
        if log_total_steps:
            log.info("Training from step %d to %s.", step, total_steps)
        if total_steps is not None and step >= total_steps:
            log.warning("Nothing to train: the state is at step %d and train_total_steps is "
                        "%d (raise train_total_steps to train further).", step, total_steps)
        progress = actions_lib.ProgressAction(total_steps=total_steps, enabled=self._progress,
                                              history=self.history)
        outputs: Output | None = None
        stop = False
        self.preempted = False
        self.stopped_state = None
        self._specs = specs
        # Early-stopping progress travels in the checkpoints' JSON item.
        ckpt_actions = [a for a in train_loop.end_actions
                        if isinstance(a, actions_lib.CheckpointAction)]
        for action in ckpt_actions:
            action.add_meta(_EARLY_STOPPING_META, self._early_stopping_meta)
            action.add_meta(_HISTORY_META, self.history.state_dict)
            action.add_meta(_LOOP_PARTIAL_META, self._loop_partial)
            # A checkpoint at a loop's end is written after that loop's evaluations; one
            # inside a loop (a preemption's) has none after it; a preemption's right after
            # a loop's end is written before them (they did not run).
            action.add_meta(_EVALS_PENDING_META,
                            lambda: not self._loop_partial() and self._loop_evals is None)
        # No loop of this call has run yet (a stop now is at a loop boundary).
        self._planned_steps, self._cut_by_total = 0, False
        with (
            preemption.handling_preemption(),
            train_loop.prefetching(iterator, self._ahead(train_loop)),
            contextlib.closing(progress),
            self._evaluating_before_saves(),
        ):
            if self._evals_pending:
                # The evaluations that followed the restored checkpoint in the earlier run
                # are not in it (early-stopping progress included): run them again first,
                # also when the run has finished (the evaluation at its last step).
                stop = self._evaluate(state, step)
                if preemption.requested():  # Ctrl-C during them
                    self._stop(state, outputs)
            while not stop and (total_steps is None or step < total_steps):
                num_steps = loop_steps
                if align and loop_steps and step % loop_steps:
                    num_steps = loop_steps - step % loop_steps
                align = False
                full = num_steps
                if total_steps is not None:
                    num_steps = min(num_steps or total_steps, total_steps - step)
                self._planned_steps = num_steps
                self._cut_by_total = full is not None and num_steps < full
                self._loop_evals = None
                try:
                    if owned:
                        train_loop.adopt(state)
                    state, new_outputs = train_loop(state, iterator, num_steps=num_steps)
                    owned = True
                except stop_handler.StopTrainingError as e:
                    log.info("Training stopped by an action: %s", e)
                    # The state the action saw, at its step: the one passed in was donated.
                    if e.state is not None:
                        state = e.state
                        self._state = state
                    stop = True
                    break
                self._state = state
                # A loop that ran no step (the data ended at a loop boundary) does not
                # replace the outputs of the last one that trained.
                new_step = loop_lib.host_step(state)
                advanced = new_step != step
                if advanced or outputs is None:
                    outputs = new_outputs
                step = new_step
                progress(state, new_outputs, first_step=train_loop.first_step)
                if train_loop.preempted or preemption.requested():
                    self._stop(state, new_outputs)
                if (new_outputs or {}).get(STOP_LOOP):
                    stop = True
                    break
                if self._loop_evals is not None:
                    stop = self._loop_evals  # they ran before the loop's checkpoint
                elif advanced:
                    # (A train loop whose end does not run its end actions.)
                    stop = self._evaluate(state, step)
                if preemption.requested():  # Ctrl-C during the evaluations
                    self._stop(state, new_outputs)
                if train_loop.dataset_exhausted:
                    log.warning("The train dataset is exhausted at step %d; stopping (after "
                                "evaluating at that step).", step)
                    break
        # Ended by train_total_steps or the data, not stopped: a later call starts its loops
        # at this step, as the reference does.
        self._ended = (step, False)
        self._finish(step)
        return state, self._with_stop(outputs, stop)

    @staticmethod
    def _with_stop(outputs: Output | None, stop: bool) -> Output | None:
        if outputs is None:
            return None
        outputs = dict(outputs)
        outputs[STOP_LOOP] = bool(stop)
        return outputs

    def _remove_stale_marker(self) -> None:
        """A STOPPED marker left by an earlier run (here or, from earlier releases, inside
        the checkpoint directory) would end a continuous evaluator of this one, so a
        starting training run removes it."""
        if self._checkpoint_spec is None or jax.process_index() != 0:
            return
        for marker in _marker_paths(self._checkpoint_spec.checkpoint_dir):
            if marker.exists():
                log.info("Removing the STOPPED marker of an earlier run: %s", marker)
                marker.unlink(missing_ok=True)

    def _writers_and_managers(self) -> tuple[list[Any], list[Any]]:
        loops = [self._train_loop, *self._eval_loops]
        all_actions = [a for lp in loops if lp is not None for a in lp.end_actions]
        writers = [a.summary_writer for a in all_actions if hasattr(a, "summary_writer")]
        managers = [a for a in all_actions if isinstance(a, actions_lib.CheckpointAction)]
        return writers, managers

    def _stop(self, state: State, outputs: Output | None) -> None:
        """Ends a run stopped by Ctrl-C or a preemption at this step boundary: saves (with
        the train loop's checkpoint action), flushes the writers, then raises
        `preemption.Interrupted` or `preemption.Preempted` with the live state."""
        self.preempted = True
        self.stopped_state = state
        self._state = state
        step = loop_lib.host_step(state)
        self._ended = (step, self._loop_partial())
        saved = self._train_loop.save_checkpoint(state, outputs)
        writers, _ = self._writers_and_managers()
        for writer in writers:
            writer.flush()
        log.warning("Stopped at step %d; %s.", step,
                    "a checkpoint was saved" if saved else "nothing was saved")
        raise preemption.stopped(state, step, saved)

    def _finish(self, step: int) -> None:
        """Waits for checkpoint writes, flushes writers, marks training as finished."""
        writers, ckpt_actions = self._writers_and_managers()
        for action in ckpt_actions:
            action.ckpt_manager.wait_until_finished()
        for writer in writers:
            writer.flush()
        async_action_context.get_async_action_context().check_exceptions_and_raise()
        if self._checkpoint_spec is not None and jax.process_index() == 0:
            # Beside the checkpoint directory, not in it: code that lists the directory
            # finds only checkpoints there.
            marker = stop_marker_path(self._checkpoint_spec.checkpoint_dir)
            marker.parent.mkdir(parents=True, exist_ok=True)
            # The step lets an evaluator tell this marker from a stale one (a checkpoint
            # newer than it belongs to a later run).
            marker.write_text(f"training finished at step {step}\n")

    def _evaluate_only(self, state: State, specs: list[EvalSpec]) -> tuple[State, Output | None]:
        if not self._eval_loops:
            raise ValueError("OuterLoop has neither a train loop nor eval loops")
        spec = self._checkpoint_spec
        if spec is None:
            context = EvalContext(False, loop_lib.host_step(state), 1)
            results, _ = self._run_evals(state, specs, context)
            return state, _last(results)
        directory = epath.Path(spec.checkpoint_dir)
        seen: set[int] = set()
        loop_count = 0
        outputs: Output | None = None
        while True:
            # Process 0 lists (orbax's finalized steps) and every process evaluates what it
            # found. The marker is read before listing: a checkpoint finished before the
            # marker was written is then always in the listing that follows.
            marker, steps = agreement.agreed(
                lambda: (_marker_step(directory), checkpoint.all_steps(directory))
            )
            for ckpt_step in sorted(set(steps) - seen):
                seen.add(ckpt_step)
                restored = self._restore_for_eval(state, directory, ckpt_step)
                if restored is None:
                    continue
                loop_count += 1
                results, _ = self._run_evals(
                    restored, specs, EvalContext(True, ckpt_step, loop_count)
                )
                outputs = _last(results) or outputs
                state = restored
            if spec.iterate_stop_fn is not None:
                if agreement.agreed(lambda: bool(spec.iterate_stop_fn())):
                    return state, outputs
            elif marker is not None and (marker < 0 or marker >= max(seen, default=-1)):
                # (A marker older than a checkpoint was left by an earlier run.)
                return state, outputs
            time.sleep(spec.iterate_interval_secs)

    def _restore_for_eval(self, state: State, directory: epath.Path, step: int) -> State | None:
        """The checkpoint at `step` restored into `state`, or None (on every process) when
        its directory is gone (the trainer's max_to_keep removed it meanwhile).

        Raises:
          ValueError: the checkpoint is there but does not restore (a corrupt file, another
            model's shapes), naming the step and the cause, on every process.
        """
        restored, error = None, None
        try:
            restored = self._eval_loops[0].step.restore_model(
                state, directory, step=step, transforms=self._checkpoint_spec.transforms
            )
        except Exception as e:  # every process must learn of it before deciding anything
            error = e
        failures = agreement.gathered(None if error is None else f"{type(error).__name__}: {error}")
        if not any(failures):
            return restored
        causes = "; ".join(f"process {i}: {text}" for i, text in enumerate(failures) if text)
        # Process 0 looks, and every process skips or raises alike.
        if agreement.agreed(lambda: _deleted(directory, step)):
            log.warning("Checkpoint step %d in %s was deleted before it could be evaluated "
                        "(max_to_keep?); skipping it. (%s)", step, directory, causes)
            return None
        raise ValueError(f"Checkpoint step {step} in {directory} failed to restore for "
                         f"evaluation: {causes}") from error


class _EvalsAtLoopEnd(actions_lib.Action):
    """Runs an `OuterLoop`'s evaluations as the first of its train loop's end actions,
    before the checkpoint action (see `OuterLoop._evaluating_before_saves`)."""

    def __init__(self, outer: OuterLoop):
        super().__init__(interval=1)
        self._outer = outer

    def __call__(self, state: State, outputs: Output | None, first_step: int | None = None,
                 **kwargs: Any) -> None:
        self._outer._evals_at_loop_end(state, outputs, first_step)


def _deleted(directory: epath.Path, step: int) -> bool:
    """Whether checkpoint `step` has left `directory`, or is leaving it: a deletion
    (max_to_keep's) removes the files first and the step's directory last, so a read that
    failed midway may still see it for a moment."""
    deadline = time.monotonic() + _DELETION_SECS
    while step in checkpoint.all_steps(directory):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _last(results: Sequence[Output | None]) -> Output | None:
    """The outputs of the last eval loop that ran."""
    ran = [r for r in results if r is not None]
    return ran[-1] if ran else None
