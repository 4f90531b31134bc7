"""OuterLoop's parts used on their own: a checkpoint action saves what the loop's owner gives
it to save, continuous evaluation runs without an OuterLoop, and the names users import
from `outer_loop` are the parts' own."""

import jax
import optax
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, eval_loop, outer_loop, train_loop
from jaxloop.checkpointing import checkpoint
from jaxloop.orchestration.continuous_eval import CheckpointSpec, ContinuousEval
from jaxloop.orchestration.evaluation import STOP_LOOP, EvalContext, EvalSpec, Evaluations
from jaxloop.orchestration.stop_marker import FILE_NAME

DATA = toy_data(64)
BATCHES = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 64, 16)]


class Progress(actions.Action):
    """A user's own bookkeeping: the steps of the loop ends it saw, saved beside the state
    (read at each checkpoint)."""

    def __init__(self):
        super().__init__(1)
        self.steps = []

    def save(self):
        return {"my_progress": {"steps": list(self.steps)}}

    def __call__(self, state, outputs, **kwargs):
        self.steps.append(int(state.step))


def test_checkpoints_hold_the_resume_metadata_and_continuous_eval_reads_each_once(tmp_path):
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=None)
    progress = Progress()
    saver = actions.CheckpointAction(manager)
    loop = train_loop.TrainLoop(step, end_actions=[progress, saver])
    state = step.initialize_model([1, 16])
    with loop.phases(checkpoint_meta=progress.save):
        for _ in range(2):
            state, _ = loop(state, iter(BATCHES), num_steps=2)
    manager.wait_until_finished()
    # Read at each save, after the actions before it: the value of that checkpoint's loop.
    assert checkpoint.read_meta(tmp_path / "ckpt", 2)["my_progress"] == {"steps": [2]}
    meta = checkpoint.read_meta(tmp_path / "ckpt", 4)
    assert meta["my_progress"] == {"steps": [2, 4]} and meta["loop_count"] == 2
    state, _ = loop(state, iter(BATCHES), num_steps=2)
    manager.wait_until_finished()
    assert "my_progress" not in checkpoint.read_meta(tmp_path / "ckpt", 6)
    manager.close()

    # An evaluator without an OuterLoop: every checkpoint once, in step order.
    seen = Progress()
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP())
    evals = Evaluations([eval_loop.EvalLoop(evaluate, end_actions=[seen])], ahead=lambda lp: 0)
    evaluator = ContinuousEval(
        CheckpointSpec(tmp_path / "ckpt", iterate_stop_fn=lambda: True), evals)
    last, outputs = evaluator(evaluate.initialize_model([1, 16]),
                              [EvalSpec(dataset=BATCHES[:1])])
    assert seen.steps == [2, 4, 6]
    assert int(last.step) == 6 and "loss" in outputs


def test_the_names_imported_from_outer_loop_are_the_parts_own():
    assert outer_loop.EvalSpec is EvalSpec and outer_loop.EvalContext is EvalContext
    assert outer_loop.STOP_LOOP == STOP_LOOP == "jaxloop/stop_loop"
    assert outer_loop.CheckpointSpec is CheckpointSpec
    assert outer_loop._STOP_FILE_NAME == FILE_NAME == "STOPPED"
    assert str(outer_loop.stop_marker_path("/run/checkpoints")) == "/run/checkpoints.STOPPED"
