"""Checkpoint actions: the train state saved at loop ends (`CheckpointAction`), and the best
k states by an eval metric (`BestCheckpointAction`), in a module of their own as the only
actions that import orbax (users write ``actions.CheckpointAction``). Example::

    manager = checkpoint.make_manager(workdir / 'ckpt')
    train_loop = TrainLoop(step, end_actions=[actions.CheckpointAction(manager, interval=5)])
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orbax.checkpoint as ocp

from jaxloop import types
from jaxloop.checkpointing import checkpoint
from jaxloop.engine import host_count
from jaxloop.hooks import triggers
from jaxloop.hooks.action import Action, ActionContext
from jaxloop.metrics.metric_values import scalar_metrics

Output = types.Output
State = types.TrainState

# The logger of `actions.py`, so logging configured for it still applies.
log = logging.getLogger("jaxloop.actions")


class CheckpointAction(Action):
    """Saves the training state with the user's orbax `CheckpointManager`, with the data
    position, loop count and owner's metadata of the loop's `ActionContext` (none when
    called without one, as google/jaxloop's loops do); scalar outputs are its metrics.
    `meta` adds JSON values (or a function returning them). With `every_secs` (a
    `triggers.Trigger`) it saves only that often, whatever the manager's policy. Example::

        CheckpointAction(manager, interval=1, every_secs=600)  # at most every ten minutes
    """

    def __init__(self, ckpt_manager: ocp.CheckpointManager, interval: int = 1,
                 meta: Mapping[str, Any] | Any = None, every_secs: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(interval)
        self._time = None if every_secs is None else triggers.Trigger(
            every_secs=every_secs, clock=clock)
        self._ckpt_manager, self._extra_meta = ckpt_manager, meta
        self._warned_no_position = self._warned_later = False
        self._saving_step: int | None = None  # the step of a save that may still be running

    @property
    def every_secs(self) -> float | None:
        return None if self._time is None else self._time.every_secs

    @property
    def ckpt_manager(self) -> ocp.CheckpointManager:
        return self._ckpt_manager

    def wait_until_finished(self) -> None:
        """Waits for the save in progress; one that failed raises its error here, with a
        note naming the step and the directory (the state of that step is not saved)."""
        try:
            self._ckpt_manager.wait_until_finished()
        except Exception as e:
            self._note_failure(e, self._saving_step)
            raise
        finally:
            self._saving_step = None

    def _note_failure(self, error: BaseException, step: int | None) -> None:
        """Adds to `error` which checkpoint it lost and that the training state is live."""
        which = "a checkpoint" if step is None else f"the checkpoint of step {step}"
        error.add_note(
            f"Saving {which} to {self._ckpt_manager.directory} failed: it is not saved. The "
            "training state is still live (OuterLoop.state, or the state you passed): fix the "
            "directory, or save to another one, and continue from it.")

    def save(self, step: int, state: State, outputs: Output | None = None) -> bool:
        """Saves `state` alone as the manager's one PyTree item (google/jaxloop's way). A
        subclass overriding it saves its own way in `__call__`, without the data position."""
        return self._ckpt_manager.save(
            step, args=ocp.args.PyTreeSave(state), metrics=scalar_metrics(outputs))

    def __call__(self, state: State, outputs: Output | None, loop: Any = None,
                 force: bool = False, context: ActionContext | None = None,
                 **kwargs: Any) -> bool:
        """Saves `state` at its step; `force` overrides the manager's policy (preemption)."""
        step = host_count.host_step(state)
        if not self._ckpt_manager.is_saving_in_progress():
            # A finished background save that failed raises here, on the loop's thread.
            self.wait_until_finished()
        if self._time is not None:
            if force:
                self._time.restart()
            elif (not self._time.fires(step, phase="checkpoint time policy")
                    or step in self._ckpt_manager.all_steps()):
                return False
            force = True  # the time policy decides, not the manager's step policy
        if context is None and callable(getattr(loop, "action_context", None)):
            context = loop.action_context()  # called with loop= alone
        extra = self._extra_meta() if callable(self._extra_meta) else self._extra_meta
        meta = {**(extra or {}), "loop_count": context and context.loop_count}
        position = context and context.data_position
        if context is not None:
            iterator = context.loop.dataset
            if position is None and iterator is not None and not self._warned_no_position:
                from jaxloop import data  # noqa: PLC0415 (grain loads only when checkpointing)

                self._warned_no_position = True
                log.warning(
                    "The train iterator (%s) cannot report its position, so checkpoints hold no "
                    "data position: a resumed run will replay the data from the start. Use a "
                    "grain dataset or data.GlobalBatchDataset to resume the data exactly.",
                    data.describe_iterator(iterator))
            if context.checkpoint_meta and (force or self._ckpt_manager.should_save(step)):
                meta.update(context.checkpoint_meta())
        try:
            if type(self).save is not CheckpointAction.save:
                saved = self.save(step, state, outputs)  # code written against the reference
            else:
                saved = checkpoint.save(self._ckpt_manager, step, state, meta=meta,
                                        metrics=scalar_metrics(outputs, loop=loop), force=force,
                                        dataset_state=position)
        except OSError as e:
            # orbax may raise the failure of the save still in progress, before this one.
            self._note_failure(e, step if self._saving_step is None else self._saving_step)
            self._saving_step = None
            raise
        if saved:
            self._saving_step = step
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
    """Keeps the best k checkpoints by an eval metric (`checkpoint.make_best_manager`'s
    manager decides), on an eval loop; no data position is saved. Example::

        best = checkpoint.make_best_manager(workdir / 'best', 'accuracy', mode='max', k=2)
        eval_loop = EvalLoop(eval_step, end_actions=[BestCheckpointAction(best)])
        state = checkpoint.restore_best(state, workdir / 'best', 'accuracy', mode='max')
    """

    def __call__(self, state: State, outputs: Output | None, loop: Any = None,
                 force: bool = False, **kwargs: Any) -> bool:
        if host_count.host_step(state) in self._ckpt_manager.all_steps():
            return False  # several evals after one train loop: the first one is offered
        # Reduced here, by the eval loop's example counts; no context: no data position or count.
        return super().__call__(state, scalar_metrics(outputs, loop=loop), force=force)


def savers(actions: Iterable[Any]) -> list[CheckpointAction]:
    """The actions of `actions` that save a state to resume from (not best-k ones)."""
    return [a for a in actions
            if isinstance(a, CheckpointAction) and not isinstance(a, BestCheckpointAction)]
