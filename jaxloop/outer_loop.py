"""OuterLoop: runs train loops and eval loops until training is done.

Training ends at ``train_total_steps``, when the train data runs out, when a loop outputs a
truthy ``STOP_LOOP`` or when an action raises `StopTrainingError`. Without a train loop it
evaluates the given state once, or with a `CheckpointSpec` each checkpoint of a directory::

    outer = OuterLoop(train_loop=train_loop, eval_loops=[eval_loop])
    state, outputs = outer(state, train_dataset=train_iter, train_total_steps=1000,
                           train_loop_steps=100, eval_specs=[EvalSpec(dataset=eval_ds)])
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

from jaxloop import actions as actions_lib
from jaxloop import async_action_context, stop_handler, types
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import loop as loop_lib
from jaxloop import step as step_lib
from jaxloop import train_loop as train_loop_lib
from jaxloop.checkpointing.checkpoint_actions import savers
from jaxloop.data import read_ahead
from jaxloop.diagnostics import debugging as debugging_lib
from jaxloop.diagnostics import param_table as param_table_lib
from jaxloop.engine import host_count
from jaxloop.launch import preemption
from jaxloop.metrics import history as history_lib
from jaxloop.orchestration import continuous_eval, evaluation, stop_marker
from jaxloop.orchestration import resume as resume_lib
from jaxloop.orchestration.continuous_eval import CheckpointSpec
from jaxloop.orchestration.evaluation import STOP_LOOP, EvalContext, EvalSpec

Loop = loop_lib.Loop
Output = types.Output
State = types.TrainState
Step = step_lib.Step
STAT_PREFIX = "jaxloop"
ShouldEvalFn = Callable[[EvalContext], bool]
"""`EvalSpec.should_eval_fn`: given the `EvalContext`, whether to evaluate."""
# google/jaxloop's and the docs' names.
_STOP_FILE_NAME = stop_marker.FILE_NAME
stop_marker_path = stop_marker.path
DEFAULT_ITERATE_INTERVAL_SECS = continuous_eval.DEFAULT_ITERATE_INTERVAL_SECS

log = logging.getLogger(__name__)


class OuterLoop:
    """Runs train loops and eval loops. Train loops end at multiples of
    ``train_loop_steps``, also in a resumed run. Its own phases (the `history`, evaluations,
    resume metadata) run before a loop's end actions (`ActionLoop.phases`), never in them.

    Args:
      eval_loops: one EvalLoop per EvalSpec passed at call time.
      checkpoint_spec: restore from / evaluate the checkpoints in this directory.
      progress: show a progress bar (None: only when interactive).
      prefetch: batches read ahead in a thread (`Loop.prefetching`; None: a default).
      disable_jit / post_mortem: `diagnostics.debugging` switches (None: from
        ``JAXLOOP_DISABLE_JIT`` / ``JAXLOOP_POST_MORTEM``).
      resume: resume from the latest checkpoint of `checkpoint_spec`'s directory, else of
        the train loop's `CheckpointAction`'s, at or after the given state's step.

    Ctrl-C, SIGTERM or `preemption.request()` stop training at a step boundary: the run
    saves, then raises `preemption.Interrupted` or `.Preempted` carrying the live state (also
    `stopped_state`); ``outer(outer.state, ...)`` continues, however the last call ended.
    """

    def __init__(self, train_loop: train_loop_lib.TrainLoop | None = None,
                 eval_loops: Sequence[eval_loop_lib.EvalLoop] | None = None,
                 checkpoint_spec: CheckpointSpec | None = None, progress: bool | None = None,
                 prefetch: int | None = None, disable_jit: bool | None = None,
                 post_mortem: bool | None = None, resume: bool = True):
        if not isinstance(resume, bool):
            raise TypeError(f"resume must be True or False, got {resume!r}")
        if prefetch is not None and prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self._debugging = (disable_jit, post_mortem)
        self._train_loop, self._eval_loops = train_loop, list(eval_loops or [])
        self._checkpoint_spec, self._progress, self._prefetch = checkpoint_spec, progress, prefetch
        self._state: State | None = None
        self.preempted, self.stopped_state = False, None
        self._ended: tuple[int, bool] | None = None  # the last call's step, inside a loop?
        self.history = history_lib.History()
        self._logged_layouts: list[Any] = []
        self._train_source: tuple[Any, Iterator[Any]] | None = None
        # The step whose evaluations an error or a stop cut short, to run first next call.
        self._evals_owed: int | None = None
        self._evals = evaluation.Evaluations(self._eval_loops, self._ahead)
        self._specs: list[EvalSpec] = []
        self._evals_stop: bool | None = None  # None until the current loop's evals ran
        if train_loop is not None:
            self._resumer = resume_lib.Resumer(
                train_loop, [train_loop, *self._eval_loops], self.history,
                lambda: self._evals_stop is not None, resume, checkpoint_spec)

    @property
    def train_loop(self) -> train_loop_lib.TrainLoop | None:
        return self._train_loop

    @property
    def state(self) -> State | None:
        """The latest live state: what the last call returned, or where Ctrl-C or a
        preemption stopped it (None before the first call)."""
        return self._state

    @property
    def eval_loops(self) -> list[eval_loop_lib.EvalLoop]:
        return self._eval_loops

    def _ahead(self, loop: Any) -> int:
        return read_ahead.default_size(loop.step) if self._prefetch is None else self._prefetch

    def __call__(self, state: State, train_dataset: Iterator[Any] | Iterable[Any] | None = None,
                 train_total_steps: int | None = None, train_loop_steps: int | None = None,
                 eval_specs: Sequence[EvalSpec] | None = None,
                 log_train_total_steps: bool = True, train_steps: int | None = None,
                 ) -> tuple[State, Output | None]:
        """Runs training and evaluation; returns the final state and the outputs of the last
        train loop that advanced the step, with ``outputs[STOP_LOOP]`` set to whether a loop
        asked to stop (when only evaluating, the last eval loop's state and outputs).
        ``train_total_steps`` is the step to train to; ``train_steps=n`` instead trains n
        more steps from where training goes on (the given state's step, or a resumed one's)."""
        specs = self._evals.check_specs(eval_specs)
        if self._train_loop is None:
            if not self._eval_loops:
                raise ValueError("OuterLoop has neither a train loop nor eval loops")
            with self._phases():
                if self._checkpoint_spec is not None:
                    evaluate = continuous_eval.ContinuousEval(self._checkpoint_spec, self._evals)
                    self._state, outputs = evaluate(state, specs)
                else:
                    context = EvalContext(False, host_count.host_step(state), 1)
                    outputs = evaluation.last(self._evals.run(state, specs, context)[0])
                    self._state = state
            return self._state, outputs
        if train_dataset is None:
            raise ValueError("OuterLoop has a train loop but no train_dataset was given")
        if train_steps is not None and train_total_steps is not None:
            raise ValueError("Pass train_total_steps (the step to train to) or train_steps (how "
                             f"many more), not both: got {train_total_steps} and {train_steps}")
        for name, value in (("train_total_steps", train_total_steps),
                            ("train_loop_steps", train_loop_steps), ("train_steps", train_steps)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        with self._phases():
            return self._train(state, train_dataset, train_total_steps, train_loop_steps, specs,
                               log_train_total_steps, train_steps)

    @contextlib.contextmanager
    def _phases(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(debugging_lib.session(*self._debugging))
            for i, loop in enumerate(self._eval_loops):
                stack.enter_context(loop.phases(
                    [self.history.recorder(history_lib.eval_prefix(i), per_step=False)]))
            if self._train_loop is not None:
                stack.enter_context(self._train_loop.phases(
                    [self.history.recorder(history_lib.TRAIN, per_step=True),
                     self._evaluate_at_loop_end], checkpoint_meta=self._resumer.save))
            yield

    def _evaluate(self, state: State, step: int) -> bool:
        """Runs the evaluations due after the train loop at `step`; whether to stop."""
        try:
            return self._evals.run(state, self._specs,
                                   EvalContext(False, step, self._train_loop.loop_count))[1]
        except stop_handler.StopTrainingError as e:
            log.info("Training stopped by an eval action: %s", e)
            return True

    def _evaluate_at_loop_end(self, state: State, outputs: Output | None, context: Any) -> None:
        loop = self._train_loop
        if (loop.preempted or preemption.requested() or not loop.num_steps_run
                or (outputs or {}).get(STOP_LOOP)):
            return  # a stop (the run ends), or no new step to evaluate
        stop = self._evaluate(state, context.step)
        if not preemption.requested():  # (cut short by Ctrl-C: pending in the checkpoint)
            self._evals_stop = stop

    def _start(self, state: State, step: int, total_steps: int | None,
               log_total_steps: bool) -> None:
        later = self.history.steps_after(step)
        if later is not None:
            log.warning(
                "Training from step %d, before the end of this OuterLoop's history: what it "
                "holds at steps %d-%d (%s) is replaced by this run's values as they are "
                "recorded. Copy outer.history.as_dict() first to keep it, or continue from "
                "outer.state.", step, later[0], later[1], ", ".join(later[2]))
        layout = jax.tree.structure(state)
        if layout not in self._logged_layouts:
            param_table_lib.log_table(state)
            self._logged_layouts.append(layout)
        if total_steps is not None and step >= total_steps:
            log.warning("Nothing to train: the state is at step %d and train_total_steps is "
                        "%d, the step to train to%s. Pass train_steps=n to train n more "
                        "steps, or a train_total_steps above %d.", step, total_steps,
                        "" if step == total_steps else ", not a number of steps", step)
        elif log_total_steps:
            log.info("Training from step %d to %s.", step, total_steps)

    def _train(self, state: State, train_dataset: Any, total_steps: int | None,
               loop_steps: int | None, specs: list[EvalSpec], log_total_steps: bool,
               more_steps: int | None = None) -> tuple[State, Output | None]:
        from jaxloop import data  # noqa: PLC0415

        train_loop = self._train_loop
        # The same iterator again: train on the batches the last call read ahead.
        last = self._train_source
        if not (last and last[0] is train_dataset and isinstance(train_dataset, Iterator)):
            self._train_source = last = (train_dataset, data.as_iterator(train_dataset))
        iterator = last[1]
        if self._checkpoint_spec is not None and jax.process_index() == 0:
            # An earlier run's marker would end a continuous evaluator of this one.
            stop_marker.remove_stale(self._checkpoint_spec.checkpoint_dir)
        given = state
        state, align, step, evals_pending = self._resumer.restore(state, iterator, loop_steps)
        if align and callable(getattr(iterator, "set_state", None)):
            train_loop.forget_unread(iterator)  # the checkpoint's position supersedes them
        if not align and self._ended == (step, True) and loop_steps and step % loop_steps:
            # The last call was stopped inside a loop: finish that loop, as a resume does.
            align = True
            train_loop.resume_count(train_loop.loop_count, cut_short=True)
        if not align and self._evals_owed == step and self._eval_loops:
            evals_pending = True  # cut short in the last call: run them in full first
        self._evals_owed = self._ended = None
        self._state = state
        self._resumer.check_saves(step)
        if more_steps is not None:
            total_steps = step + more_steps
        self._start(state, step, total_steps, log_total_steps)
        owned = state is not given  # restored or built here: donated without a copy
        progress = actions_lib.ProgressAction(total_steps=total_steps, enabled=self._progress,
                                              history=self.history)
        self._evals.display = progress.evaluating
        outputs, stop, self._specs = None, False, specs
        self.preempted, self.stopped_state = False, None
        self._resumer.start_call()
        with (preemption.handling_preemption(),
              train_loop.prefetching(iterator, self._ahead(train_loop)),
              contextlib.closing(progress), actions_lib.deferred_writes()):
            if evals_pending:
                # The evaluations after the restored checkpoint are not in it: run them first.
                stop = self._evaluate(state, step)
                if preemption.requested():  # Ctrl-C during them
                    self._stop(state, outputs)
            while not stop and (total_steps is None or step < total_steps):
                num_steps = full = loop_steps
                if align and loop_steps and step % loop_steps:
                    num_steps = full = loop_steps - step % loop_steps
                align = False
                if total_steps is not None:
                    num_steps = min(num_steps or total_steps, total_steps - step)
                self._resumer.start_loop(num_steps, full is not None and num_steps < full)
                self._evals_stop = None
                try:
                    state, new_outputs = train_loop(train_loop.adopt(state) if owned else state,
                                                    iterator, num_steps=num_steps)
                    owned = True
                except stop_handler.StopTrainingError as e:
                    log.info("Training stopped by an action: %s", e)
                    if e.state is not None:  # (the one passed in was donated)
                        state = self._state = e.state
                    stop = True
                    self._save_at_stop(state, None)
                    break
                except BaseException:
                    self._keep_live_state()
                    raise
                self._state = state
                new_step = host_count.host_step(state)
                if train_loop.dataset_exhausted and new_step == 0:
                    raise ValueError(
                        f"The train dataset {train_dataset!r} gave no batch: it was exhausted "
                        "before step 0 (an iterator a cell already used up?). Pass a fresh "
                        "iterator, or a list (repeated for epochs: docs/notebooks.md).")
                # A loop that ran no step keeps the outputs of the last one that trained.
                advanced, step = new_step != step, new_step
                if advanced or outputs is None:
                    outputs = new_outputs
                progress(state, new_outputs, first_step=train_loop.first_step)
                if train_loop.preempted or preemption.requested():
                    self._stop(state, new_outputs)
                if (new_outputs or {}).get(STOP_LOOP):
                    stop = True
                    self._save_at_stop(state, new_outputs)
                    break
                if self._evals_stop is not None:
                    stop = self._evals_stop  # they ran before the loop's checkpoint
                elif advanced:
                    self._evals_owed = step
                    stop = self._evaluate(state, step)
                    self._evals_owed = None
                if stop:
                    self._save_at_stop(state, new_outputs)
                if preemption.requested():  # Ctrl-C during the evaluations
                    self._stop(state, new_outputs)
                if train_loop.dataset_exhausted:
                    log.warning("The train dataset is exhausted at step %d; stopping (after "
                                "evaluating at that step).", step)
                    break
        self._ended = (step, False)
        for loop in [train_loop, *self._eval_loops]:
            for action in loop.end_actions:
                if isinstance(action, actions_lib.CheckpointAction):
                    action.wait_until_finished()  # a failed save names its step and directory
        self._flush_writers()
        async_action_context.get_async_action_context().check_exceptions_and_raise()
        if self._checkpoint_spec is not None and jax.process_index() == 0:
            stop_marker.write(self._checkpoint_spec.checkpoint_dir, step)
        return state, None if outputs is None else {**outputs, STOP_LOOP: bool(stop)}

    def _keep_live_state(self) -> None:
        """After an exception in the train loop: its live state becomes `state`, the steps
        it completed join the history; the next call finishes the loop and its evaluations."""
        train_loop = self._train_loop
        if (live := train_loop.stopped_state) is None:
            return
        self._state = self.stopped_state = live
        step = host_count.host_step(live)
        self._ended = (step, True)
        first, partial = train_loop.first_step, train_loop.partial_outputs
        if first is None or step <= first:
            return
        if partial:
            self.history.record_outputs(history_lib.TRAIN, step, partial, first)
        elif partial is None and self._evals_stop is None:
            self._evals_owed = step  # the loop ended, its evaluations did not

    def _save_at_stop(self, state: State, outputs: Output | None) -> None:
        """An early stop saves where it stopped, once, whatever the actions' order."""
        if savers(self._train_loop.end_actions):
            self._train_loop.save_checkpoint(state, outputs)

    def _flush_writers(self) -> None:
        for loop in [self._train_loop, *self._eval_loops]:
            for action in loop.end_actions:
                if hasattr(action, "summary_writer"):
                    action.summary_writer.flush()

    def _stop(self, state: State, outputs: Output | None) -> None:
        """Saves, flushes the writers and raises `preemption.stopped` with the live state."""
        self.preempted = True
        self.stopped_state = self._state = state
        step = host_count.host_step(state)
        self._ended = (step, self._resumer.loop_partial())
        if not self._ended[1] and self._evals_stop is None and self._eval_loops:
            self._evals_owed = step  # stopped before or during them: the next call runs them
        saved = self._train_loop.save_checkpoint(state, outputs)
        self._flush_writers()
        log.warning("Stopped at step %d; %s.", step,
                    "a checkpoint was saved" if saved else "nothing was saved",
                    extra=preemption.STOP_NOTICE)
        raise preemption.stopped(state, step, saved)
