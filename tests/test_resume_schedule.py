"""A resumed run keeps the uninterrupted run's schedule (issue #23, points 3, 8 and 10).

Written from the user's side: what a user sees is which loop count a resumed run starts
from, what the checkpoint directory holds, and at which steps evaluations and checkpoints
happen after a preemption.
"""

import os

import jax
import optax
import orbax.checkpoint as ocp
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, outer_loop, stop_handler
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import train_loop as train_loop_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.launch import preemption

DATA = toy_data(256)
BATCHES = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 256, 16)]


def forever():
    while True:
        yield from BATCHES


class Recorder(actions.Action):
    """Records (step, loop_count) at each call."""

    def __init__(self, interval=1):
        super().__init__(interval)
        self.calls = []

    def __call__(self, state, outputs, loop_count=None, **kwargs):
        self.calls.append((int(state.step), loop_count))


class PreemptAtStep:
    """A step action that asks for preemption (what the SIGTERM handler does) once the
    `at`-th step of this run has run."""

    interval = 1

    def __init__(self, at=None):
        self.at, self.seen = at, 0

    def __call__(self, state, outputs, **kwargs):
        self.seen += 1
        if self.seen == self.at:
            preemption.request()


def train_step(preempt_at=None):
    return ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          train=True, end_actions=[PreemptAtStep(preempt_at)])


def eval_step():
    return ClassifierStep(jax.random.key(0), LinenMLP())


def guide_manager(directory):
    """The guide's manager: one unnamed PyTree item, so no jaxloop metadata is saved."""
    return ocp.CheckpointManager(
        directory, ocp.Checkpointer(ocp.PyTreeCheckpointHandler()),
        ocp.CheckpointManagerOptions(max_to_keep=3))


# --- 3. a checkpoint without jaxloop's metadata resumes with the step's loop count ---------


@pytest.mark.parametrize("writer", ["orbax", "checkpoint_action"])
def test_a_guide_checkpoint_at_step_100_resumes_at_loop_10(tmp_path, writer):
    step = train_step()
    state = step.initialize_model([1, 16])
    state = state.replace(step=state.step + 100)
    manager = guide_manager(tmp_path / "ckpt")
    if writer == "orbax":  # a user, or google/jaxloop's CheckpointAction
        manager.save(100, args=ocp.args.PyTreeSave(state))
    else:  # jaxloop's CheckpointAction on the guide's manager: one item, no metadata
        assert actions.CheckpointAction(manager)(state, None)
    manager.wait_until_finished()
    manager.close()
    assert checkpoint.read_meta(tmp_path / "ckpt", 100) == {}

    rec = Recorder()
    tl = train_loop_lib.TrainLoop(train_step(), end_actions=[rec])
    outer = outer_loop.OuterLoop(train_loop=tl,
                                 checkpoint_spec=outer_loop.CheckpointSpec(tmp_path / "ckpt"))
    final, _ = outer(train_step().initialize_model([1, 16]), forever(),
                     train_total_steps=120, train_loop_steps=10)
    assert int(final.step) == 120
    # Loops 11 and 12 (steps 100-110 and 110-120), as in an uninterrupted run.
    assert rec.calls == [(110, 11), (120, 12)]
    assert tl.loop_count == 120 // 10


# --- 8. the checkpoint directory holds checkpoints only -------------------------------------


def train_with_checkpoints(ckpt_dir, total):
    """Trains to `total` in loops of 2, checkpointing each loop, resuming from `ckpt_dir`."""
    manager = checkpoint.make_manager(ckpt_dir, max_to_keep=None)
    step = train_step()
    tl = train_loop_lib.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)])
    outer = outer_loop.OuterLoop(train_loop=tl,
                                 checkpoint_spec=outer_loop.CheckpointSpec(ckpt_dir))
    outer(step.initialize_model([1, 16]), forever(), train_total_steps=total,
          train_loop_steps=2)
    manager.close()


def evaluated_steps(ckpt_dir):
    """The checkpoints a continuous evaluator reads before the training job's marker ends
    it (it would wait forever without one)."""
    rec = Recorder()
    evaluator = outer_loop.OuterLoop(
        eval_loops=[eval_loop_lib.EvalLoop(eval_step(), end_actions=[rec])],
        checkpoint_spec=outer_loop.CheckpointSpec(ckpt_dir, iterate_interval_secs=0.01))
    evaluator(eval_step().initialize_model([1, 16]),
              eval_specs=[outer_loop.EvalSpec(BATCHES[:1])])
    return [s for s, _ in rec.calls]


def test_the_checkpoint_directory_holds_only_step_folders(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    train_with_checkpoints(ckpt_dir, 6)
    # What orbax writes there: one folder per step. Counting entries counts checkpoints.
    assert sorted(os.listdir(ckpt_dir), key=int) == ["2", "4", "6"]
    assert checkpoint.all_steps(ckpt_dir) == [2, 4, 6]
    # The training job still tells a continuous evaluator that it has finished.
    assert evaluated_steps(ckpt_dir) == [2, 4, 6]


def test_a_marker_inside_the_directory_still_ends_an_evaluator_and_is_removed(tmp_path):
    # Earlier jaxloop releases and google/jaxloop write STOPPED inside the directory.
    ckpt_dir = tmp_path / "checkpoints"
    manager = checkpoint.make_manager(ckpt_dir, max_to_keep=None)
    step = train_step()
    state = step.initialize_model([1, 16])
    checkpoint.save(manager, 0, state, force=True)
    manager.wait_until_finished()
    manager.close()
    (ckpt_dir / "STOPPED").write_text("")
    assert evaluated_steps(ckpt_dir) == [0]

    # A training run starting there removes it (it would end this run's evaluators early)
    # and marks its own end beside the directory.
    train_with_checkpoints(ckpt_dir, 2)
    assert not (ckpt_dir / "STOPPED").exists()
    assert sorted(os.listdir(ckpt_dir), key=int) == ["0", "2"]
    assert outer_loop.stop_marker_path(ckpt_dir) == tmp_path / "checkpoints.STOPPED"
    assert (tmp_path / "checkpoints.STOPPED").exists()


# --- 10. preemption keeps the schedule ---------------------------------------------------


def run(workdir, total=80, preempt_at=None, patience=None, every=2):
    """80 steps in loops of 10, evaluating and checkpointing every `every` loops."""
    evals = Recorder()
    eval_actions = [evals]
    if patience is not None:
        # No evaluation counts as an improvement after the first (min_delta is far above
        # any change of the eval loss): patience counts evaluations.
        handler = stop_handler.MetricMonitoringStopHandler(
            "loss", min_delta=1e6, patience=patience)
        eval_actions.append(actions.EarlyStoppingAction(handler))
    manager = checkpoint.make_manager(workdir / "ckpt", max_to_keep=None)
    ckpt = actions.CheckpointAction(manager, interval=every)
    step = train_step(preempt_at)
    tl = train_loop_lib.TrainLoop(step, end_actions=[ckpt])
    outer = outer_loop.OuterLoop(
        train_loop=tl, eval_loops=[eval_loop_lib.EvalLoop(eval_step(), end_actions=eval_actions)],
        checkpoint_spec=outer_loop.CheckpointSpec(workdir / "ckpt"))
    try:
        state, outputs = outer(
            step.initialize_model([1, 16]), forever(), train_total_steps=total,
            train_loop_steps=10,
            eval_specs=[outer_loop.EvalSpec(BATCHES[:2], num_steps=2, eval_loop_interval=every)])
    except preemption.Preempted as stop:  # the script's end on SIGTERM: status 143
        assert stop.saved and stop.code == 143
        state, outputs = stop.state, None
    manager.wait_until_finished()
    manager.close()
    return outer, state, outputs, [s for s, _ in evals.calls]


@pytest.mark.parametrize("every", [2, 1])
def test_preempted_at_step_25_and_resumed_evaluates_and_saves_on_the_same_steps(tmp_path, every):
    _, state, _, evals = run(tmp_path / "a", every=every)
    scheduled = list(range(10 * every, 81, 10 * every))  # [20, 40, 60, 80] for every=2
    assert int(state.step) == 80
    assert evals == scheduled
    assert checkpoint.all_steps(tmp_path / "a" / "ckpt") == scheduled

    outer, state, _, first = run(tmp_path / "b", preempt_at=25, every=every)
    assert outer.preempted and int(state.step) == 25
    assert first == [s for s in scheduled if s < 25]
    outer, state, _, second = run(tmp_path / "b", every=every)
    assert not outer.preempted and int(state.step) == 80
    # every=2: not [20, 35, 55, 75]; every=1: no extra evaluation at 25.
    assert first + second == scheduled
    # The uninterrupted run's checkpoints, plus the preemption's own.
    assert checkpoint.all_steps(tmp_path / "b" / "ckpt") == sorted([*scheduled, 25])
    # The first resumed loop ran only to the boundary: loops end at multiples of 10 again.
    assert outer.train_loop.loop_count == 8


def test_preempted_at_a_loop_end_runs_that_loops_evaluation_on_resume(tmp_path):
    # Stopped at step 40 (a loop end, its evaluation not yet run): the evaluation at 40 runs
    # when the run resumes, once, and the rest follows the schedule.
    outer, state, _, first = run(tmp_path, preempt_at=40)
    assert outer.preempted and int(state.step) == 40
    assert first == [20]
    _, state, _, second = run(tmp_path)
    assert first + second == [20, 40, 60, 80]
    assert checkpoint.all_steps(tmp_path / "ckpt") == [20, 40, 60, 80]


def test_early_stopping_patience_sees_the_same_evaluations_after_a_preemption(tmp_path):
    _, state, outputs, evals = run(tmp_path / "a", patience=2)
    assert outputs[outer_loop.STOP_LOOP]
    stopped_at = int(state.step)
    assert evals == [20, 40, 60] and stopped_at == 60  # best at 20, then 2 without progress

    outer, state, _, first = run(tmp_path / "b", preempt_at=25, patience=2)
    assert outer.preempted and int(state.step) == 25
    _, state, outputs, second = run(tmp_path / "b", patience=2)
    assert outputs[outer_loop.STOP_LOOP]
    assert first + second == evals
    assert int(state.step) == stopped_at


def test_a_checkpoint_of_the_previous_release_saved_inside_a_loop_resumes_on_schedule(tmp_path):
    # What release 0d51892 saved when preempted at step 25 in loops of 10: the count of the
    # loop it cut short, and "evaluations pending" (wrongly: none follow inside a loop).
    state = train_step().initialize_model([1, 16])
    state = state.replace(step=state.step + 25)
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=None)
    checkpoint.save(manager, 25, state, force=True,
                    meta={"loop_count": 3, "evals_pending": True, "early_stopping": []})
    manager.wait_until_finished()
    manager.close()
    outer, state, _, evals = run(tmp_path, total=40, every=1)
    assert int(state.step) == 40
    assert evals == [30, 40]  # no evaluation at 25; loops end at 30 and 40
    assert outer.train_loop.loop_count == 4
