"""Debugging switches: steps without jit (same results as jit), post-mortem on an error."""

from __future__ import annotations

import itertools
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import outer_loop, train_loop
from jaxloop.diagnostics import debugging

HERE = Path(__file__).resolve().parent
DATA = toy_data(16, din=8)


class ConcreteStep(ClassifierStep):
    """Reads its loss on the host inside `run`: possible only when run is not traced."""

    seen: list

    def run(self, state, batch):
        state, outputs = super().run(state, batch)
        self.seen.append(float(outputs["loss"]))  # a print or breakpoint() would work too
        return state, outputs


def train(disable_jit, cls=ConcreteStep):
    step = cls(jax.random.key(0), LinenMLP(hidden=8), optax.sgd(0.1), train=True)
    step.seen = []
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step), progress=False,
                                 disable_jit=disable_jit)
    state, outputs = outer(step.initialize_model([1, 8]), itertools.repeat(DATA),
                           train_total_steps=4, train_loop_steps=2)
    return step, state, outputs


def test_disable_jit_runs_run_eagerly_with_the_jitted_results(monkeypatch):
    step, state, outputs = train(disable_jit=True)
    assert len(step.seen) == 4 and int(state.step) == 4
    np.testing.assert_allclose(step.seen[-2:], [float(x) for x in outputs["loss"]], rtol=1e-6)
    with pytest.raises(jax.errors.ConcretizationTypeError):
        train(disable_jit=False)  # traced: the host cannot read the loss inside run
    # The environment switch does the same, and jit is back on after the call.
    monkeypatch.setenv(debugging.ENV_DISABLE_JIT, "1")
    step2, state2, _ = train(disable_jit=None)
    assert len(step2.seen) == 4
    monkeypatch.delenv(debugging.ENV_DISABLE_JIT)
    _, jitted, jitted_outputs = train(disable_jit=None, cls=ClassifierStep)
    for a, b, c in zip(*(jax.tree.leaves(s.params) for s in (state, state2, jitted)),
                       strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose([float(x) for x in outputs["loss"]],
                               [float(x) for x in jitted_outputs["loss"]], rtol=1e-5)
    monkeypatch.setenv(debugging.ENV_DISABLE_JIT, "maybe")
    with pytest.raises(ValueError, match="JAXLOOP_DISABLE_JIT"):
        train(disable_jit=None)


@pytest.mark.tf
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_guide_example_without_jit_matches_jit(tmp_path):
    results = []
    for flag in ("0", "1"):
        out = tmp_path / f"results-{flag}.json"
        env = dict(os.environ, TMPDIR=str(tmp_path), JAXLOOP_DISABLE_JIT=flag)
        env.pop("XLA_FLAGS", None)
        proc = subprocess.run(
            [sys.executable, str(HERE / "guide" / "run_guide_results.py"), "1", str(out)],
            capture_output=True, text=True, timeout=500, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ("jit is disabled" in proc.stderr) == (flag == "1")
        results.append(json.loads(out.read_text()))
    jitted, eager = results
    assert jitted["step"] == eager["step"] == 100
    np.testing.assert_allclose(eager["loss"], jitted["loss"], rtol=1e-5)
    for a, b in zip(eager["params"], jitted["params"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def run_in_terminal(command, env, answers: bytes, timeout=120.0) -> tuple[int, str]:
    """Runs `command` with a pseudo-terminal as its standard streams (an interactive
    session), typing `answers`; returns its exit code and everything it printed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    os.write(master, answers)
    output = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running after {timeout} s:\n{output.decode(errors='replace')}")
    return code, output.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_post_mortem_stops_in_the_failing_action_when_interactive():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, str(HERE / "debug_job.py")]
    code, output = run_in_terminal(command, env, b"p 'value:', step_in_action\nq\n")
    assert code != 0 and "action failed at step 4" in output
    assert "Entering the post-mortem debugger" in output and "(Pdb)" in output
    assert "'value:', 4" in output  # the debugger was at the frame that raised
    # Not interactive (a batch job: no terminal): the error alone, no debugger.
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode != 0 and "action failed at step 4" in proc.stderr
    assert "(Pdb)" not in proc.stdout + proc.stderr
