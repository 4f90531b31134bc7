"""Resuming training: `Resumer` gives an `OuterLoop`'s checkpoints what they save beside the
state (early-stopping progress, whether the loop ended before its boundary or its evaluations
are still to run, the name of the history file, appended to so no checkpoint grows with the
run), restores the latest checkpoint and refuses a run whose checkpoint action saves nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax

from jaxloop import actions as actions_lib
from jaxloop import types
from jaxloop.checkpointing import checkpoint
from jaxloop.checkpointing.checkpoint_actions import savers
from jaxloop.engine import host_count
from jaxloop.launch import agreement
from jaxloop.metrics import history as history_lib
from jaxloop.orchestration import log
from jaxloop.state import model_state

if TYPE_CHECKING:
    from jaxloop.orchestration.continuous_eval import CheckpointSpec

State = types.TrainState

EARLY_STOPPING_META = "early_stopping"
EVALS_PENDING_META = "evals_pending"
HISTORY_META = "history"
HISTORY_FILE = "file"  # HISTORY_META's one key: the name of the history file (when saved)
# Whether the checkpoint's loop ended before its boundary: the resumed run finishes it.
LOOP_PARTIAL_META = "loop_partial"


def resumed_loop_count(meta: dict[str, Any], step: int,
                       loop_steps: int | None) -> tuple[int | None, bool]:
    """(the loop count to resume with, whether the checkpoint is inside a loop): the saved
    count less a loop the checkpoint cut short, else ``step // loop_steps``, else None.
    ``resumed_loop_count({}, step=250, loop_steps=100)`` is ``(2, True)``."""
    saved = meta.get("loop_count")
    if saved is None:
        count = step // loop_steps if loop_steps else None
        return count, bool(loop_steps) and step % loop_steps != 0
    count = int(saved)
    partial = meta.get(LOOP_PARTIAL_META)
    if partial is None:
        # Earlier releases did not say; their count includes a loop cut off the boundary.
        partial = bool(loop_steps) and step % loop_steps != 0 and count == step // loop_steps + 1
    return (max(count - 1, 0) if partial else count), bool(partial)


def latest_step(directory: Any) -> int | None:
    """The latest checkpoint's step in `directory` (None: none), as process 0 lists it."""
    steps = agreement.agreed(lambda: checkpoint.all_steps(directory),
                             phase=f"listing of the checkpoints in {directory}")
    return max(steps) if steps else None


class Resumer:
    """The module's bookkeeping for `train_loop` (`loops`: whose `EarlyStoppingAction`s
    save their progress; `evals_ran`: whether the current train loop's evaluations ran).
    The outer loop says where the train loop stands (`start_call`, `start_loop`)."""

    def __init__(self, train_loop: Any, loops: Sequence[Any], history: history_lib.History,
                 evals_ran: Callable[[], bool], resume: bool,
                 checkpoint_spec: CheckpointSpec | None):
        self._train_loop, self._loops, self._history = train_loop, loops, history
        self._evals_ran, self._resume, self._spec = evals_ran, resume, checkpoint_spec
        self._planned_steps: int | None = None
        self._cut_by_total = False

    def start_call(self) -> None:
        """No loop of this call has run yet (a stop now is at a loop boundary)."""
        self._planned_steps, self._cut_by_total = 0, False

    def start_loop(self, planned_steps: int | None, cut_by_total: bool) -> None:
        """A train loop of `planned_steps` starts; `cut_by_total`: ``train_total_steps`` cuts it."""
        self._planned_steps, self._cut_by_total = planned_steps, cut_by_total

    def loop_partial(self) -> bool:
        """Whether the last train loop ended before its boundary (preempted, or cut)."""
        loop, planned = self._train_loop, self._planned_steps
        return self._cut_by_total or (
            bool(loop.preempted) if planned is None else loop.num_steps_run < planned)

    def early_stopping_actions(self) -> list[actions_lib.EarlyStoppingAction]:
        return [a for lp in self._loops if lp is not None for a in lp.end_actions
                if isinstance(a, actions_lib.EarlyStoppingAction)]

    def save(self) -> dict[str, Any]:
        """The JSON values a checkpoint saves now, beside the data position and loop count;
        process 0 brings the history file beside each checkpoint directory up to date."""
        partial = self.loop_partial()
        paths = [history_lib.file_path(a.ckpt_manager.directory)
                 for a in savers(self._train_loop.end_actions)]
        if jax.process_index() == 0:
            for path in paths:
                self._history.save_file(path)
        return {
            EARLY_STOPPING_META: [a.state_dict() for a in self.early_stopping_actions()],
            HISTORY_META: {HISTORY_FILE: paths[0].name if paths else None},
            LOOP_PARTIAL_META: partial,
            # Pending only for a save at a loop's end before its evaluations ran.
            EVALS_PENDING_META: not partial and not self._evals_ran(),
        }

    def _take_back(self, meta: dict[str, Any], step: int, loop_steps: int | None,
                   directory: Any) -> bool:
        """Takes back the checkpoint's loop count, early-stopping progress and history;
        whether the evaluations after it are still to run."""
        loop_count, partial = resumed_loop_count(meta, step, loop_steps)
        if loop_count is not None:
            self._train_loop.resume_count(loop_count)
        saved = meta.get(EARLY_STOPPING_META) or []
        for action, progress in zip(self.early_stopping_actions(), saved, strict=False):
            action.load_state_dict(progress)
        saved = meta.get(HISTORY_META)
        if isinstance(saved, dict) and set(saved) == {HISTORY_FILE}:
            path = history_lib.file_path(directory)  # beside the one resumed from
            if not self._history.load_file(path, step):
                log.warning("The history of the checkpoint at step %d is not in %s: "
                            "outer.history starts empty.", step, path)
                self._history.load_state_dict({})
        else:
            self._history.load_state_dict(saved)  # earlier releases: in the metadata
        # A checkpoint inside a loop has no evaluations after it.
        return bool(meta.get(EVALS_PENDING_META)) and not partial

    def directory(self) -> Any:
        """Where training resumes from: the CheckpointSpec's directory, else the train
        loop's checkpoint action's (None: nowhere, or `resume=False`)."""
        if not self._resume or self._spec is not None:
            return self._spec.checkpoint_dir if self._resume else None
        directories = (getattr(a.ckpt_manager, "directory", None)
                       for a in savers(self._train_loop.end_actions))
        return next((d for d in directories if d is not None), None)

    def restore(self, state: State, iterator: Iterator[Any], loop_steps: int | None
                ) -> tuple[State, bool, int, bool]:
        """The state to train from, whether it came from a checkpoint, its step, and
        whether the evaluations after that checkpoint are still to run. A given state
        ahead of the latest checkpoint is kept."""
        step = self._train_loop.step
        for action in savers(self._train_loop.end_actions):
            action.wait_until_finished()
        # An abstract state has no step: it is restored into place, or initialised.
        given = None if model_state.is_abstract(state) else host_count.host_step(state)
        directory = self.directory()
        latest = None if directory is None else latest_step(directory)
        if directory is None or (latest is not None and given is not None and given > latest):
            if directory is not None:
                log.info("Training from the given state (step %d), ahead of the latest "
                         "checkpoint in %s (step %d).", given, directory, latest)
            latest = None
        else:
            state, meta = checkpoint.restore(
                state, directory, step=latest, partitioner=step.partitioner,
                skip_optimizer=not step.train,
                transforms=self._spec.transforms if self._spec else None, dataset=iterator)
        state = step.materialize(state)
        if latest is None:
            return state, False, host_count.host_step(state) if given is None else given, False
        return state, True, latest, self._take_back(meta, latest, loop_steps, directory)

    def check_saves(self, step: int) -> None:
        """A ValueError before training where the train loop's checkpoint action would save
        nothing: its directory holds a checkpoint after `step`."""
        for action in savers(self._train_loop.end_actions):
            directory = getattr(action.ckpt_manager, "directory", None)
            latest = None if directory is None else latest_step(directory)
            if latest is not None and latest > step:
                how = ("resuming is off (OuterLoop(resume=False))" if not self._resume else
                       f"this run resumed from {self._spec.checkpoint_dir}")
                raise ValueError(
                    f"This run would save no checkpoint until after step {latest}: it starts "
                    f"at step {step}, its CheckpointAction saves to {directory}, which holds "
                    f"a checkpoint at step {latest}, and orbax saves only steps after the "
                    f"latest ({how}). Resume from that directory (OuterLoop's default, "
                    "resume=True, with no CheckpointSpec elsewhere), save to a new "
                    "directory, or delete its checkpoints.")
