"""Triggers: actions fired at global train steps (every n, at steps, first n, first n of
this process, every x seconds), step-level and loop-level."""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import optax
import orbax.checkpoint as ocp
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, outer_loop, train_loop
from jaxloop.hooks import triggers

DATA = toy_data(n=16, din=8)
BATCH = {"x": DATA["x"][:8], "y": DATA["y"][:8]}


class StepRecorder(actions.Action):
    """Records the state's step at each call (the global train step)."""

    def __init__(self, trigger=None):
        super().__init__(trigger=trigger)
        self.steps = []

    def __call__(self, state, outputs, **kwargs):
        self.steps.append(int(state.step))


def make_step(end_actions=(), begin_actions=()):
    return ClassifierStep(jax.random.key(0), LinenMLP(hidden=8), optax.sgd(0.1), train=True,
                          end_actions=list(end_actions), begin_actions=list(begin_actions))


def batches():
    return itertools.repeat(BATCH)


def train(step, loop_steps, loops, end_actions=(), **loop_kwargs):
    state = step.initialize_model([1, 8])
    loop = train_loop.TrainLoop(step, end_actions=list(end_actions), **loop_kwargs)
    data = batches()
    for _ in range(loops):
        state, _ = loop(state, data, num_steps=loop_steps)
    return state


@pytest.mark.parametrize("k", [1, 4])
def test_step_action_every_n_counts_global_steps_across_loops(k):
    # Loops of 5 steps: per-loop numbers would fire at 3 of each loop; global ones at 3, 6, 9.
    every = StepRecorder(triggers.Trigger(every_n_steps=3))
    train(make_step(end_actions=[every]), 5, 2, steps_per_execution=k)
    assert every.steps == [3, 6, 9]


def test_step_action_at_steps_and_first_n_steps():
    at = StepRecorder(triggers.Trigger(at_steps=(2, 7)))
    first = StepRecorder(triggers.Trigger(first_n_steps=3))
    both = StepRecorder(triggers.Trigger(first_n_steps=2, at_steps=(9,)))
    train(make_step(end_actions=[at, first, both]), 4, 3)
    assert at.steps == [2, 7]
    assert first.steps == [1, 2, 3]
    assert both.steps == [1, 2, 9]


def test_begin_action_fires_before_the_step():
    # A begin action sees the state before step 4 runs: its step is 3.
    before = StepRecorder(triggers.Trigger(at_steps=(4,)))
    train(make_step(begin_actions=[before]), 3, 2)
    assert before.steps == [3]


def test_loop_action_fires_at_the_end_of_loops_that_ran_a_matching_step():
    every = StepRecorder(triggers.Trigger(every_n_steps=4))
    at = StepRecorder(triggers.Trigger(at_steps=(5,)))
    interval = StepRecorder()  # no trigger: every loop, as before
    train(make_step(), 3, 4, end_actions=[every, at, interval])
    assert every.steps == [6, 9, 12]  # the loops holding steps 4, 8 and 12
    assert at.steps == [6]
    assert interval.steps == [3, 6, 9, 12]


def test_every_secs_fires_after_the_time_has_passed():
    now = [0.0]
    timed = StepRecorder(triggers.Trigger(every_secs=20, clock=lambda: now[0]))

    class Tick(actions.Action):  # the clock advances 4 s per step
        def __call__(self, state, outputs, **kwargs):
            now[0] += 4.0

    train(make_step(end_actions=[Tick(), timed]), 4, 5)
    # Decided once per loop, at its first step (after that step's tick): at 4, 20 (fires),
    # 36, 52 (fires) and 68 s; never at a loop's later steps.
    assert timed.steps == [5, 13]


@pytest.mark.parametrize("k", [1, 4])
def test_every_secs_on_a_step_action_with_fused_steps(k):
    # The clock advances one second each time it is read: read once per loop (plus once
    # when it fires), the planned executions and the fired actions agree.
    ticks = itertools.count()
    timed = StepRecorder(triggers.Trigger(every_secs=2, clock=lambda: float(next(ticks))))
    step = make_step(end_actions=[timed])
    state = train(step, 3, 8, steps_per_execution=k)
    assert int(state.step) == 24
    assert timed.steps == [4, 10, 16, 22]  # the first step of every other loop


def test_first_n_process_steps_restarts_with_the_process(tmp_path):
    def run(total):
        # What a restarted script does: new objects, resuming from the checkpoints.
        check = StepRecorder(triggers.Trigger(first_n_process_steps=2))
        step = make_step(end_actions=[check])
        manager = ocp.CheckpointManager(tmp_path / "ckpt")
        loop = train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)])
        outer = outer_loop.OuterLoop(
            loop, checkpoint_spec=outer_loop.CheckpointSpec(tmp_path / "ckpt"), progress=False)
        state = step.abstract_state([1, 8])
        outer(state, batches(), train_total_steps=total, train_loop_steps=3)
        manager.wait_until_finished()
        manager.close()
        return check.steps

    assert run(6) == [1, 2]
    assert run(12) == [7, 8]  # the first two steps after the restored step 6


@pytest.mark.parametrize("kwargs, message", [
    ({}, "needs a condition"),
    ({"every_n_steps": 0}, "every_n_steps"),
    ({"at_steps": (3, -1)}, "at_steps"),
    ({"every_secs": -2}, "every_secs"),
    ({"first_n_process_steps": 1.5}, "first_n_process_steps"),
])
def test_bad_trigger_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        triggers.Trigger(**kwargs)
    with pytest.raises(TypeError, match="triggers.Trigger"):
        StepRecorder().with_trigger(5)


# -- two processes ---------------------------------------------------------------------------

JOB = Path(__file__).resolve().parent / "sched_job.py"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_secs_fires_at_the_same_steps_on_two_processes(tmp_path):
    from test_multiprocess import run_job  # noqa: PLC0415

    results = run_job("every_secs", tmp_path, job=JOB)
    # Process 1's clock runs 3x as fast as process 0's: on its own it would fire more often.
    assert results[0]["loop"] == results[1]["loop"] and results[0]["loop"]
    assert results[0]["step"] == results[1]["step"] and results[0]["step"]
    assert results[0]["loop"] != list(range(4, 25, 4))  # not every loop: time decided
    # Issue 44.3: the host waits once per loop for each time condition (the step-level one
    # at the loop's first step, the loop-level one at its end), not at every step's look.
    for result in results:
        counts = result["exchanges"]
        assert [b - a for a, b in zip([0, *counts[:5]], counts[:6], strict=True)] == [2] * 6, counts
