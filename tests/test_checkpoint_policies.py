"""Checkpoint policies: time-based saves (agreed across processes) and warm starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, checkpoint, data, train_loop

REPO = Path(__file__).resolve().parents[1]


class ManualClock:
    """A clock the test moves by hand: `clock=` is CheckpointAction's own parameter."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _train(tmp_path: Path, action_factory, loops: int = 6, on_loop=None):
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=None, async_save=False)
    action = action_factory(manager)
    saved = []

    class Record(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            if on_loop is not None:
                on_loop()
            saved.append(bool(action(state, outputs, **kwargs)))

    loop = train_loop.TrainLoop(step, end_actions=[Record()])
    state = step.initialize_model([1, 16])
    dataset = iter(data.GlobalBatchDataset(toy_data(128), 16, seed=1))
    for _ in range(loops):
        state, _ = loop(state, dataset, num_steps=2)
    manager.close()
    return saved, checkpoint.all_steps(tmp_path / "ckpt"), state


def test_time_based_saves_happen_when_due(tmp_path):
    clock = ManualClock()

    def advance():
        clock.now += 100.0  # each loop "takes" 100 s

    saved, steps, _ = _train(
        tmp_path, lambda m: actions.CheckpointAction(m, every_secs=250, clock=clock),
        on_loop=advance,
    )
    # Due at 300 s (loop 3, step 6) and 600 s (loop 6, step 12): counted from the last save.
    assert saved == [False, False, True, False, False, True]
    assert steps == [6, 12]


def test_time_based_save_ignores_the_managers_step_policy(tmp_path):
    clock = ManualClock()
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    state = step.initialize_model([1, 16])
    manager = checkpoint.make_manager(
        tmp_path / "ckpt", max_to_keep=None, async_save=False, save_interval_steps=1000
    )
    action = actions.CheckpointAction(manager, every_secs=60, clock=clock)
    assert action(state.replace(step=3), None) is False  # not due yet
    clock.now = 61.0
    assert action(state.replace(step=7), None) is True  # due: saved off the step grid
    assert action(state.replace(step=7), None) is False  # no double save, no time reset
    clock.now = 100.0
    assert action(state.replace(step=9), None) is False  # 39 s since the save at 61 s
    # A forced save (preemption) saves and restarts the time.
    assert action(state.replace(step=10), None, force=True) is True
    clock.now = 140.0
    assert action(state.replace(step=11), None) is False
    manager.close()
    assert checkpoint.all_steps(tmp_path / "ckpt") == [7, 10]


def test_default_checkpoint_action_saves_every_call(tmp_path):
    saved, steps, _ = _train(tmp_path, lambda m: actions.CheckpointAction(m), loops=3)
    assert saved == [True, True, True]
    assert steps == [2, 4, 6]


@pytest.mark.parametrize("bad", [0, -5, "600", True])
def test_every_secs_must_be_positive(tmp_path, bad):
    manager = checkpoint.make_manager(tmp_path / "ckpt", async_save=False)
    with pytest.raises(ValueError, match="every_secs"):
        actions.CheckpointAction(manager, every_secs=bad)
    manager.close()


def _process_env(devices: int, **extra: str) -> dict[str, str]:
    from test_multiprocess import process_env  # noqa: PLC0415

    return process_env(devices, **extra)


POLICY_JOB = REPO / "tests" / "checkpoint_policy_job.py"
POLICY_JOB_TIMEOUT = 180


@pytest.mark.slow
@pytest.mark.timeout(POLICY_JOB_TIMEOUT + 60)
def test_two_processes_follow_process_zeros_clock(tmp_path):
    """Process 1's clock says a save is due at every loop, process 0's only at loops 3 and
    6: both processes save exactly where process 0 says (no hang, same checkpoints)."""
    from test_multiprocess import free_port, read_logs, started, wait_all  # noqa: PLC0415

    port = free_port()
    envs = [
        _process_env(4, JAXLOOP_COORDINATOR=f"127.0.0.1:{port}", JAXLOOP_NUM_PROCESSES="2",
                     JAXLOOP_PROCESS_ID=str(i))
        for i in range(2)
    ]
    command = [sys.executable, str(POLICY_JOB), str(tmp_path)]
    with started([command] * 2, envs, tmp_path / "logs") as procs:
        try:
            codes = wait_all(procs, POLICY_JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"time-based checkpoint job still running after {POLICY_JOB_TIMEOUT} s")
        logs = read_logs(tmp_path / "logs", 2)
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{log.stderr[-4000:]}"
    results = [json.loads((tmp_path / f"result-{i}.json").read_text()) for i in range(2)]
    assert [r["process_count"] for r in results] == [2, 2]
    for r in results:
        assert r["saved"] == [False, False, True, False, False, True], r
        assert r["checkpoints"] == [6, 12], r
        assert r["step"] == 12
