"""TrainLoop: the loop that updates the model. Example::

    train_loop = TrainLoop(train_step, end_actions=[summary_action, ckpt_action])
    state, outputs = train_loop(state, train_iterator, num_steps=100)
    train_loop = TrainLoop(train_step, steps_per_execution=16)  # 16 steps per compiled call
"""

from __future__ import annotations

import logging
from typing import Any

from jaxloop import action_loop, loop, types
from jaxloop import step as step_lib

Loop = loop.Loop
Output = types.Output
State = types.TrainState
Step = step_lib.Step

log = logging.getLogger(__name__)


class TrainLoop(action_loop.ActionLoop):
    """An `ActionLoop` (same arguments) whose step must be a training step."""

    def __init__(self, step: step_lib.Step, *args: Any, **kwargs: Any):
        if not getattr(step, "train", True):
            raise ValueError("TrainLoop needs a step constructed with train=True")
        super().__init__(step, *args, **kwargs)

    def save_checkpoint(self, state: types.TrainState, outputs: types.Output | None) -> bool:
        """Saves `state` now with this loop's first `CheckpointAction` (not a best-k one)
        unless its step is saved, and waits; returns whether this step is saved (False, with
        a warning, without such an action). A stopped run calls it before it ends."""
        # Here: a train loop without checkpoints never imports orbax.
        from jaxloop.checkpointing.checkpoint_actions import savers  # noqa: PLC0415

        step = loop.host_step(state)
        for action in savers(self.end_actions)[:1]:
            if step not in action.ckpt_manager.all_steps():
                action(state, outputs, loop=self, force=True, context=self.action_context())
            action.wait_until_finished()
            return step in action.ckpt_manager.all_steps()
        log.warning("Stopped at step %d, but no CheckpointAction saves the state: nothing "
                    "was saved.", step)
        return False
