"""A script run by tests/test_debugging.py (not a test module): trains a toy model under
OuterLoop(post_mortem=True) with an action that raises at the end of the second loop."""

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import optax  # noqa: E402
from models import ClassifierStep, LinenMLP, toy_data  # noqa: E402

from jaxloop import actions, outer_loop, train_loop  # noqa: E402


class Failing(actions.Action):
    def __call__(self, state, outputs, **kwargs):
        step_in_action = int(state.step)
        if step_in_action >= 4:
            raise RuntimeError(f"action failed at step {step_in_action}")


step = ClassifierStep(jax.random.key(0), LinenMLP(hidden=8), optax.sgd(0.1), train=True)
outer = outer_loop.OuterLoop(train_loop.TrainLoop(step, end_actions=[Failing()]),
                             progress=False, post_mortem=True)
outer(step.initialize_model([1, 8]), itertools.repeat(toy_data(16, din=8)),
      train_total_steps=6, train_loop_steps=2)
