"""Continuous evaluation skips only checkpoints that are gone; any other checkpoint that
does not restore is an error naming its step and the cause."""

import os
import shutil

import jax
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, eval_loop, outer_loop, train_loop
from jaxloop.checkpointing import checkpoint

DATA = toy_data(64)
BATCHES = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 64, 16)]


def forever():
    while True:
        yield from BATCHES


@pytest.fixture
def ckpt_dir(tmp_path):
    """Checkpoints at steps 2, 4 and 6 of a small classifier, written by jaxloop."""
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=None)
    outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(
        step, end_actions=[actions.CheckpointAction(manager)]))(
            step.initialize_model([1, 16]), forever(), train_total_steps=6, train_loop_steps=2)
    manager.close()
    return tmp_path / "ckpt"


class Seen(actions.Action):
    def __init__(self):
        super().__init__(1)
        self.steps = []

    def __call__(self, state, outputs, **kwargs):
        self.steps.append(int(state.step))


def evaluate(ckpt_dir, model=None, before=()):
    """One pass of a continuous evaluator over the checkpoints there; the steps it saw."""
    seen = Seen()
    step = ClassifierStep(jax.random.key(0), model or LinenMLP())
    evaluator = outer_loop.OuterLoop(
        eval_loops=[eval_loop.EvalLoop(step, end_actions=[*before, seen])],
        checkpoint_spec=outer_loop.CheckpointSpec(ckpt_dir, iterate_stop_fn=lambda: True))
    evaluator(step.initialize_model([1, 16]), eval_specs=[outer_loop.EvalSpec(BATCHES[:1])])
    return seen.steps


@pytest.mark.slow
def test_a_corrupt_checkpoint_that_is_not_the_newest_is_an_error_naming_its_step(ckpt_dir):
    for root, _, files in os.walk(ckpt_dir / "4" / "state"):
        for name in files:
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"Checkpoint step 4 in .* failed to restore") as err:
        evaluate(ckpt_dir)
    assert "process 0: " in str(err.value) and err.value.__cause__ is not None  # the cause


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_an_error_naming_the_step_and_the_leaf(ckpt_dir):
    with pytest.raises(ValueError, match=r"step 2 .*leaf params/dense1/\S+ has shape"):
        evaluate(ckpt_dir, model=LinenMLP(hidden=8))


@pytest.mark.slow
def test_a_checkpoint_deleted_after_the_listing_is_skipped(ckpt_dir):
    class DeleteNext(actions.Action):
        """What the trainer's max_to_keep does between the evaluator's listing and read."""

        def __call__(self, state, outputs, **kwargs):
            if int(state.step) == 2:
                shutil.rmtree(ckpt_dir / "4")

    assert evaluate(ckpt_dir, before=[DeleteNext()]) == [2, 6]
