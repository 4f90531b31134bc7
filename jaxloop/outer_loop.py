"""OuterLoop: orchestrates train loops and eval loops until training is done.

Modes:
- train only: ``outer(state, train_dataset=..., train_total_steps=..., train_loop_steps=...)``
- train + evals: add ``eval_specs=[EvalSpec(eval_ds), ...]`` with one EvalLoop per spec.
- eval only: no train loop. With a `CheckpointSpec` it evaluates every new checkpoint in the
  directory once, in step order, until the training job writes its ``STOPPED`` marker
  (`continuous_eval`, `stop_marker`); without one it evaluates the given state once. It
  returns the last eval loop's state and outputs.

Its parts, each in its own module: the evaluations and when they run (`evaluation`),
continuous evaluation over checkpoints (`continuous_eval`), the STOPPED marker a finished
run writes (`stop_marker`), and what a checkpoint holds beside the state and where a run
resumes from (`resume`). This module runs the train loops and decides when training ends.

The schedule is a function of the step: with ``train_loop_steps=n`` train loops end at
multiples of n (and at ``train_total_steps``). A resumed run keeps it (`resume`), so
evaluations, checkpoints and actions fall on the steps of the uninterrupted run (plus a
preemption's own save), and neither repeats nor loses the evaluation at its step.

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
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax

from jaxloop import actions as actions_lib
from jaxloop import async_action_context, evaluation, preemption, stop_handler, stop_marker, types
from jaxloop import continuous_eval as continuous_eval_lib
from jaxloop import debugging as debugging_lib
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import history as history_lib
from jaxloop import loop as loop_lib
from jaxloop import param_table as param_table_lib
from jaxloop import prefetch as prefetch_lib
from jaxloop import resume as resume_lib
from jaxloop import train_loop as train_loop_lib
from jaxloop.continuous_eval import CheckpointSpec
from jaxloop.evaluation import STOP_LOOP, EvalContext, EvalSpec, Evaluations, LoopEndEvaluations

Output = types.Output
State = types.TrainState
# Where they lived before (google/jaxloop's `_STOP_FILE_NAME`; the docs' `stop_marker_path`).
_STOP_FILE_NAME = stop_marker.FILE_NAME
stop_marker_path = stop_marker.path
DEFAULT_ITERATE_INTERVAL_SECS = continuous_eval_lib.DEFAULT_ITERATE_INTERVAL_SECS

log = logging.getLogger(__name__)


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
        Keras' ``BackupAndRestore`` does), when it is at or after the given state's step;
        it logs "Resumed from step N of DIR". False: train from the given state. Either
        way a run whose checkpoint action could save nothing (its directory holds a later
        checkpoint) raises a ValueError before training (`resume.Resumer`).

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
        self._state: State | None = None
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
        # The scalars of every loop this OuterLoop ran, across calls (`jaxloop.history`).
        self.history = history_lib.History()
        self._logged_layouts: list[Any] = []
        self._evals = Evaluations(self._eval_loops, self._ahead)
        if train_loop is not None:
            self._at_loop_end = LoopEndEvaluations(train_loop, self._evals)
            self._metadata = resume_lib.ResumeMetadata(
                train_loop, [train_loop, *self._eval_loops], self.history, self._at_loop_end)
            self._resumer = resume_lib.Resumer(train_loop, self._metadata, resume,
                                               checkpoint_spec)

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
        specs = self._evals.check_specs(eval_specs)
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

    def _evaluate_only(self, state: State, specs: list[EvalSpec]) -> tuple[State, Output | None]:
        if not self._eval_loops:
            raise ValueError("OuterLoop has neither a train loop nor eval loops")
        if self._checkpoint_spec is None:
            context = EvalContext(False, loop_lib.host_step(state), 1)
            results, _ = self._evals.run(state, specs, context)
            return state, evaluation.last(results)
        return continuous_eval_lib.ContinuousEval(self._checkpoint_spec, self._evals)(state, specs)

    def _report_rewind(self, step: int) -> None:
        """Says which steps of the history a run started at an earlier step replaces."""
        later = self.history.steps_after(step)
        if later is not None:
            log.warning(
                "Training from step %d, before the end of this OuterLoop's history: what it "
                "holds at steps %d-%d (%s) is replaced by this run's values as they are "
                "recorded. Copy outer.history.as_dict() first to keep it, or continue from "
                "outer.state.", step, later[0], later[1], ", ".join(later[2]))

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
        if self._checkpoint_spec is not None and jax.process_index() == 0:
            # An earlier run's marker would end a continuous evaluator of this one.
            stop_marker.remove_stale(self._checkpoint_spec.checkpoint_dir)
        given = state
        # A run resumed inside a loop finishes that loop first, to its boundary.
        state, align, step, evals_pending = self._resumer.restore(
            state, iterator, loop_steps)
        if not align and self._ended == (step, True) and loop_steps and step % loop_steps:
            # The live state of this OuterLoop's last call, which a Stop ended inside a loop:
            # finish that loop, as a resume does,
            # so evaluations and actions stay on the steps and loops of an uninterrupted run.
            align = True
            train_loop.loop_count = max(train_loop.loop_count - 1, 0)
        self._ended = None
        self._state = state
        self._resumer.check_saves(step)
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
        at_end = self._at_loop_end
        at_end.specs = specs
        # History, early-stopping progress and where the loop stands travel in the
        # checkpoints' JSON item (a best-k action on the train loop included).
        for action in train_loop.end_actions:
            if isinstance(action, actions_lib.CheckpointAction):
                action.set_resume_metadata(self._metadata)
        self._metadata.start_call()
        with (
            preemption.handling_preemption(),
            train_loop.prefetching(iterator, self._ahead(train_loop)),
            contextlib.closing(progress),
            at_end.installed(),
        ):
            if evals_pending:
                # The evaluations that followed the restored checkpoint in the earlier run
                # are not in it (early-stopping progress included): run them again first,
                # also when the run has finished (the evaluation at its last step).
                stop = at_end.evaluate(state, step)
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
                self._metadata.start_loop(num_steps, full is not None and num_steps < full)
                at_end.result = None
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
                if at_end.result is not None:
                    stop = at_end.result  # they ran before the loop's checkpoint
                elif advanced:
                    # (A train loop whose end does not run its end actions.)
                    stop = at_end.evaluate(state, step)
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
        # (As google/jaxloop does: whether a train or eval loop asked to stop.)
        return state, None if outputs is None else {**outputs, STOP_LOOP: bool(stop)}

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
        self._ended = (step, self._metadata.loop_partial())
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
            stop_marker.write(self._checkpoint_spec.checkpoint_dir, step)
