"""TrainLoop: the loop that updates the model.

Example::

    train_loop = TrainLoop(train_step, end_actions=[summary_action, ckpt_action])
    state, outputs = train_loop(state, train_iterator, num_steps=100)

    # 16 steps per compiled call: same results, far less per-step dispatch for small steps.
    train_loop = TrainLoop(train_step, steps_per_execution=16)
    # Or let the loop time its first executions and pick the size.
    train_loop = TrainLoop(train_step, steps_per_execution='auto')
"""

from __future__ import annotations

import logging
from typing import Any

from jaxloop import action_loop, loop, types
from jaxloop import step as step_lib

log = logging.getLogger(__name__)


class TrainLoop(action_loop.ActionLoop):
    """An ActionLoop whose step must be a training step (``step.train`` is True).

    Arguments are those of `ActionLoop`: ``begin_actions``, ``end_actions``,
    ``stat_names``, ``global_batch_size``, ``max_steps_in_flight`` and
    ``steps_per_execution`` (default 1: steps that run k at a time in one compiled
    `jax.lax.scan`, with bit-identical results; ``'auto'`` measures and picks k; see
    `loop.Loop` for the rules).
    """

    def __init__(self, step: step_lib.Step, *args: Any, **kwargs: Any):
        if not getattr(step, "train", True):
            raise ValueError("TrainLoop needs a step constructed with train=True")
        super().__init__(step, *args, **kwargs)

    def save_checkpoint(self, state: types.TrainState, outputs: types.Output | None) -> bool:
        """Saves `state` now with this loop's first `CheckpointAction` (not a best-k one),
        unless its step is saved already, and waits for the write. Returns whether a
        checkpoint of this step exists; False, with a warning, when no action saves the
        state. A stopped run (Ctrl-C, preemption) calls it before it ends.

        Example::

            if not train_loop.save_checkpoint(state, outputs):
                print('nothing saved')
        """
        # Here, not at the top: a train loop without checkpoints never imports orbax.
        from jaxloop import checkpoint_actions  # noqa: PLC0415

        step = loop.host_step(state)
        for action in self.end_actions:
            if (isinstance(action, checkpoint_actions.CheckpointAction)
                    and not isinstance(action, checkpoint_actions.BestCheckpointAction)):
                if step not in action.ckpt_manager.all_steps():
                    action(state, outputs, loop=self, force=True)
                action.ckpt_manager.wait_until_finished()
                return step in action.ckpt_manager.all_steps()
        log.warning("Stopped at step %d, but no CheckpointAction saves the state: nothing "
                    "was saved.", step)
        return False
