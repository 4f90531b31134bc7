"""Stopping keeps your work: Ctrl-C (a notebook's Stop) and SIGTERM end a run at a step
boundary, save if a checkpoint action exists, say whether they did, and raise so that no
code after training runs as if it had finished; the live state stays reachable.

The in-process tests send the signal to this process from a step action (the handler runs in
the main thread at that point, deterministically). The notebook tests interrupt a real
kernel with nbclient; the SIGTERM tests run a real script in a subprocess.
"""

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, eval_loop, outer_loop, train_loop
from jaxloop.checkpointing import checkpoint
from jaxloop.launch import preemption

SPEC = [1, 16]


def batches(n=16, seed=0):
    data = toy_data(n * 16, seed=seed)
    return [{k: v[i * 16:(i + 1) * 16] for k, v in data.items()} for i in range(n)]


class Kill:
    """A step action that sends this process `signum` (`times` times) on step `at`."""

    def __init__(self, at, signum=signal.SIGINT, times=1):
        self.interval, self.at, self.signum, self.times = 1, at, signum, times
        self.sent = 0

    def __call__(self, state, outputs=None, per_loop_step_number=None, **kwargs):
        self.sent += 1
        if self.sent == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


def train_step(kill=None):
    return ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True,
                          end_actions=[kill] if kill else None)


def test_ctrl_c_stops_a_bare_train_loop_with_a_live_state_and_saves(tmp_path):
    step = train_step(Kill(at=3))
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    loop = train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager,
                                                                            interval=1000)])
    state = step.initialize_model(SPEC)
    with pytest.raises(KeyboardInterrupt) as caught:
        loop(state, batches(), num_steps=16)
    stop = caught.value
    assert isinstance(stop, preemption.Interrupted)
    assert stop.step == 3 and int(stop.state.step) == 3 and stop.saved
    assert loop.stopped_state is stop.state
    assert manager.all_steps() == [3]
    # The live state continues, and the one passed in is untouched.
    more, _ = loop(stop.state, batches(), num_steps=2)
    assert int(more.step) == 5 and int(state.step) == 0
    # Handlers are restored: Python's own again.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_still_leaves_a_live_state():
    step = train_step(Kill(at=2, times=2))
    loop = train_loop.TrainLoop(step)
    with pytest.raises(preemption.Interrupted) as caught:
        loop(step.initialize_model(SPEC), batches(), num_steps=16)
    state = caught.value.state
    assert int(state.step) == 2 and not caught.value.saved
    jax.tree.map(np.asarray, state.params)  # alive


def test_stopping_without_a_checkpoint_action_says_nothing_was_saved(caplog):
    step = train_step(Kill(at=2))
    outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(step), prefetch=0)
    with caplog.at_level(logging.WARNING, logger="jaxloop"), \
            pytest.raises(preemption.Interrupted) as caught:
        outer(step.initialize_model(SPEC), train_dataset=batches() * 4, train_total_steps=60,
              train_loop_steps=5)
    assert caught.value.saved is False and outer.preempted
    assert int(outer.stopped_state.step) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any("nothing was saved" in m for m in messages), messages
    assert not any("after saving" in m for m in messages)


def test_ctrl_c_during_a_long_evaluation_stops_at_the_next_batch(tmp_path):
    kill = Kill(at=3)
    read = []

    class EvalBatches:
        def __iter__(self):
            for i in range(10_000):
                read.append(i)
                yield batches(1, seed=i)[0]

    evaluate = ClassifierStep(jax.random.key(0), LinenMLP(), end_actions=[kill])
    step = train_step()
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    outer = outer_loop.OuterLoop(
        train_loop=train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)]),
        eval_loops=[eval_loop.EvalLoop(evaluate)], prefetch=0)
    with pytest.raises(preemption.Interrupted) as caught:
        outer(step.initialize_model(SPEC), train_dataset=batches() * 4, train_total_steps=60,
              train_loop_steps=5, eval_specs=[outer_loop.EvalSpec(dataset=EvalBatches())])
    assert len(read) <= 4  # not the 10,000 of a whole evaluation
    assert caught.value.step == 5 and caught.value.saved and manager.all_steps() == [5]


def test_request_raises_preempted_a_system_exit_with_status_143(tmp_path):
    class Request:
        interval = 1

        def __call__(self, state, outputs=None, **kwargs):
            if int(state.step) == 4:
                preemption.request()

    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          train=True, end_actions=[Request()])
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    outer = outer_loop.OuterLoop(
        train_loop=train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)]))
    with pytest.raises(SystemExit) as caught:
        outer(step.initialize_model(SPEC), train_dataset=batches() * 4, train_total_steps=60,
              train_loop_steps=10)
    assert isinstance(caught.value, preemption.Preempted) and caught.value.code == 143
    assert outer.preempted and caught.value.step == 4 and 4 in manager.all_steps()


# -- a real script that gets SIGTERM ---------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import jax, optax
    from models import ClassifierStep, LinenMLP, toy_data
    from jaxloop import actions, outer_loop, train_loop
    from jaxloop.checkpointing import checkpoint
    from jaxloop.launch import preemption

    workdir, catch = sys.argv[1], sys.argv[2] == "catch"

    class Ready(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            open(os.path.join(workdir, "READY"), "w").close()

    data = toy_data(256)
    batches = [{{k: v[i:i + 16] for k, v in data.items()}} for i in range(0, 256, 16)]
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    manager = checkpoint.make_manager(os.path.join(workdir, "ckpt"))
    outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(
        step, end_actions=[Ready(), actions.CheckpointAction(manager, interval=10**6)]))

    def forever():
        while True:
            yield from batches

    try:
        outer(step.initialize_model([1, 16]), train_dataset=forever(),
              train_total_steps=10**9, train_loop_steps=5)
    except preemption.Preempted as stop:
        if not catch:
            raise
        print(json.dumps({{"preempted": outer.preempted, "step": stop.step,
                           "saved": stop.saved, "steps": manager.all_steps()}}))
        sys.exit(0)
    print("AFTER TRAINING")
""")


def run_until_sigterm(tmp_path, mode):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (tmp_path / "READY").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the job never finished a loop"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


@pytest.mark.slow
def test_sigterm_saves_and_exits_143_without_running_code_after_training(tmp_path):
    code, out, err = run_until_sigterm(tmp_path, "raise")
    assert code == 143, err[-3000:]
    assert "AFTER TRAINING" not in out
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    assert len(manager.all_steps()) == 1  # the preemption's own save


@pytest.mark.slow
def test_sigterm_caught_reads_preempted_and_the_saved_step(tmp_path):
    code, out, err = run_until_sigterm(tmp_path, "catch")
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["preempted"] is True and result["saved"] is True
    assert result["steps"] == [result["step"]] and result["step"] >= 5


# -- a real notebook kernel, interrupted -------------------------------------------------------

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from test_notebooks import kernel_env  # noqa: E402, F401 (the fixture: a kernel on this Python)

SETUP = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import jax, optax
    from models import ClassifierStep, LinenMLP, toy_data
    from jaxloop import actions, eval_loop, outer_loop, train_loop
    from jaxloop.checkpointing import checkpoint

    data = toy_data(256)
    batches = [{{k: v[i:i + 16] for k, v in data.items()}} for i in range(0, 256, 16)]

    def forever():
        while True:
            yield from batches

    presses = [0]

    class Ready(actions.Action):
        # Says a loop ended, and counts the Stop presses on their way to jaxloop's handler
        # (an action runs in the main thread, where signal handlers are set).
        def __call__(self, state, outputs, **kwargs):
            handler = signal.getsignal(signal.SIGINT)
            if not hasattr(handler, "counts"):
                def counting(signum, frame):
                    handler(signum, frame)
                    presses[0] += 1
                    open(f"PRESS-{{presses[0]}}", "w").close()

                counting.counts = True
                signal.signal(signal.SIGINT, counting)
            open("READY", "w").close()

    def held(n):
        # Eight batches, then none until `n` Stop presses were taken: each press lands while
        # training waits for its data, never after the cell ended, whatever the machine's speed.
        yield from batches[:8]
        presses[0] = 0
        open("HELD", "w").close()
        while presses[0] < n:
            time.sleep(0.01)
        yield from forever()

    read_at = [0.0]

    class SlowEval:  # a long evaluation: 2,000 batches of 20 ms
        def __iter__(self):
            open("EVALUATING", "w").close()
            for i in range(2000):
                time.sleep(0.02)
                read_at[0] = time.time()
                yield batches[i % len(batches)]

    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP())
    manager = checkpoint.make_manager("ckpt")  # relative, as a notebook writes it
    outer = outer_loop.OuterLoop(
        train_loop=train_loop.TrainLoop(
            step, end_actions=[Ready(), actions.CheckpointAction(manager, interval=10**6)]),
        eval_loops=[eval_loop.EvalLoop(evaluate)])
    untrained = step.initialize_model([1, 16])
""")

TRAIN = ("state, outputs = outer(untrained, train_dataset={train}, train_total_steps=10**9, "
         "train_loop_steps=5, eval_specs=[outer_loop.EvalSpec(dataset={eval})])")

AFTER = textwrap.dedent("""
    stop = sys.last_value
    live = outer.stopped_state
    print("raised:", type(stop).__name__, isinstance(stop, KeyboardInterrupt))
    print("stopped at:", int(live.step), stop.step, "saved:", stop.saved,
          int(live.step) in manager.all_steps())
    more, _ = train_loop.TrainLoop(step)(live, forever(), num_steps=3)
    print("continued to:", int(more.step), "untrained at:", int(untrained.step))
    print("last eval batch read at:", read_at[0])
    print("presses since held:", presses[0])
""")

# (what training reads, what the evaluation reads, the files that say the cell is where it
# should be interrupted, how many interrupts). No scenario's cell can end before its last
# press: training reads forever, the double press's data waits for both presses, and the
# evaluation lasts 40 s, then training goes on forever.
SCENARIOS = {"training": ("forever()", "batches", ("READY",), 1),
             "double": ("held(2)", "batches", ("READY", "HELD"), 2),
             "evaluation": ("forever()", "SlowEval()", ("EVALUATING",), 1)}
WAIT = 120  # seconds for a cell to reach the point where it is interrupted, or for a press
CELL_TIMEOUT = 240  # caps a cell that never answers


def interrupt_kernel(workdir):
    """In one kernel: runs SETUP, then for each scenario the training cell, interrupts the
    kernel once the scenario's file exists, and runs AFTER. Returns, by scenario, (the
    training cell's outputs, AFTER's stdout, the wall-clock time of the first interrupt)."""
    cells = [nbformat.v4.new_code_cell(SETUP.format(tests=str(Path(__file__).parent)))]
    for train, evaluate, _, _ in SCENARIOS.values():
        cells += [nbformat.v4.new_code_cell(TRAIN.format(train=train, eval=evaluate)),
                  nbformat.v4.new_code_cell(AFTER)]
    nb = nbformat.v4.new_notebook(cells=cells)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                     allow_errors=True,
                                     resources={"metadata": {"path": str(workdir)}})

    async def until(training, cell, *files):
        deadline = time.monotonic() + WAIT
        while not all((workdir / f).exists() for f in files):
            assert not training.done(), cell.outputs
            assert time.monotonic() < deadline, f"no {files} after {WAIT} s"
            await asyncio.sleep(0.05)

    async def run():
        times = []
        async with client.async_setup_kernel():
            await client.async_execute_cell(nb.cells[0], 0)
            for i, (_, _, wait_for, interrupts) in enumerate(SCENARIOS.values()):
                train_at = 1 + 2 * i
                for name in [*wait_for, *(p.name for p in workdir.glob("PRESS-*"))]:
                    (workdir / name).unlink(missing_ok=True)
                training = asyncio.ensure_future(
                    client.async_execute_cell(nb.cells[train_at], train_at))
                await until(training, nb.cells[train_at], *wait_for)
                times.append(time.time())
                for press in range(1, interrupts + 1):
                    # A press after the cell ended would land in the kernel's own reply
                    # code, which then never answers: the scenarios keep the cell running.
                    await client.km.interrupt_kernel()
                    if press < interrupts:  # the next press once this one was taken
                        await until(training, nb.cells[train_at], f"PRESS-{press}")
                await training
                await client.async_execute_cell(nb.cells[train_at + 1], train_at + 1)
        return times

    times = asyncio.run(run())
    results = {}
    for i, name in enumerate(SCENARIOS):
        after_cell = nb.cells[2 + 2 * i]
        errors = [o for o in after_cell.outputs if o.output_type == "error"]
        assert not errors, (name, errors)
        after = "".join(o.get("text", "") for o in after_cell.outputs
                        if o.output_type == "stream")
        results[name] = (nb.cells[1 + 2 * i].outputs, after, times[i])
    return results


def _check_stopped(name, train_outputs, after):
    errors = [o.ename for o in train_outputs if o.output_type == "error"]
    assert errors == ["Interrupted"], (name, train_outputs)
    if name == "double":  # both presses reached jaxloop's handler while training ran
        assert "presses since held: 2" in after, after
    assert "raised: Interrupted True" in after, (name, after)
    stopped = [int(x) for x in after.split("stopped at: ")[1].split()[:2]]
    assert stopped[0] == stopped[1] > 0, (name, after)
    assert "saved: True True" in after, (name, after)
    continued = int(after.split("continued to: ")[1].split()[0])
    assert continued == stopped[0] + 3, (name, after)
    assert "untrained at: 0" in after, (name, after)


@pytest.mark.slow
@pytest.mark.usefixtures("kernel_env")
def test_notebook_stop_once_twice_and_during_a_long_evaluation_keeps_a_live_state(tmp_path):
    """The Stop button, in one kernel: while training (the cell raises KeyboardInterrupt and
    a later cell continues from the live state); twice in a row (still a live state); during
    a long evaluation (honoured at its next batch, well within 2 s)."""
    results = interrupt_kernel(tmp_path)
    for name, (outputs, after, _) in results.items():
        _check_stopped(name, outputs, after)
    _, after, interrupted_at = results["evaluation"]
    # The kernel and this process share the machine's clock. The whole evaluation takes
    # 40 s; it stops at the next batch (20 ms), then saves and raises.
    seconds = float(after.split("last eval batch read at: ")[1].split()[0]) - interrupted_at
    print(f"evaluation stopped {seconds:.3f} s after the interrupt")
    assert seconds < 2.0
