"""What a notebook cell prints, read back from one real Jupyter kernel as a person sees it
(issue 46): one line per event a user acts on, routine saves silent unless asked, the
evaluation in the progress bar, clear words for an out-of-order cell, a Stop in one line,
`train_steps=` for n more steps, an exhausted iterator as an error and the first non-finite
loss as one warning. The cells run in order in one kernel (kernels are slow to start)."""

import re
import textwrap
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from test_notebooks import kernel_env  # noqa: E402, F401 (the fixture: a kernel on this Python)
from test_second_hour_notebook import (  # noqa: E402, F401 (text_bar: the fixture)
    bar_states,
    stream,
    text_bar,
    visible,
)

TOTAL, LOOP, EVAL_BATCHES = 400, 20, 4

SETUP = textwrap.dedent("""
    import importlib.util, sys
    assert importlib.util.find_spec("ipywidgets") is None  # the text bar (the fixture)
    sys.path.insert(0, {tests!r})
    import os, signal
    import jax, numpy as np, optax
    from models import ClassifierStep, LinenMLP, toy_data
    from jaxloop import actions, data, eval_loop, outer_loop, train_loop
    from jaxloop.checkpointing import checkpoint
    from jaxloop.metrics import notebook_logging

    forever = lambda: iter(data.GlobalBatchDataset(toy_data(256), 16, seed=0))  # repeats
    eval_batches = list(data.GlobalBatchDataset(toy_data(64, seed=1), 16, num_epochs=1))

    def make_outer(directory, *end_actions):
        train_step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                                    train=True)
        manager = checkpoint.make_manager(directory)
        trainer = train_loop.TrainLoop(
            train_step, end_actions=[*end_actions, actions.CheckpointAction(manager)])
        evaluator = eval_loop.EvalLoop(ClassifierStep(jax.random.key(0), LinenMLP()))
        return train_step, outer_loop.OuterLoop(trainer, [evaluator])
""")

# A 400-step run with a checkpoint at every loop and an evaluation after each.
TRAIN = textwrap.dedent(f"""
    train_step, outer = make_outer("ckpt")
    first = train_step.initialize_model([1, 16])
    state, _ = outer(first, train_dataset=forever(), train_total_steps={TOTAL},
                     train_loop_steps={LOOP}, eval_specs=[outer_loop.EvalSpec(eval_batches)])
""")

# The first training cell run again after the run went on: its checkpoints are at 400.
OUT_OF_ORDER = textwrap.dedent("""
    train_step, outer = make_outer("ckpt")
    state, _ = outer(train_step.initialize_model([1, 16]), train_dataset=forever(),
                     train_total_steps=300, train_loop_steps=20,
                     eval_specs=[outer_loop.EvalSpec(eval_batches)])
    print("at", int(state.step))
""")

MORE = textwrap.dedent("""
    state, _ = outer(state, train_dataset=forever(), train_steps=40, train_loop_steps=20,
                     eval_specs=[outer_loop.EvalSpec(eval_batches)])
    print("at", int(state.step))
""")


class_press_stop = textwrap.dedent("""
    class PressStop(actions.Action):  # the Stop button, pressed during the second loop
        def __call__(self, state, outputs, loop_count=0, **kwargs):
            if loop_count == 2:
                os.kill(os.getpid(), signal.SIGINT)
""")

STOP = class_press_stop + textwrap.dedent("""
    train_step, stopped = make_outer("stop_ckpt", PressStop())
    stopped(train_step.initialize_model([1, 16]), train_dataset=forever(),
            train_total_steps=400, train_loop_steps=20,
            eval_specs=[outer_loop.EvalSpec(eval_batches)])
""")

AFTER_STOP = 'print("live", int(stopped.state.step))'

EXHAUSTED = textwrap.dedent("""
    used = iter(eval_batches)
    list(used)
    try:
        make_outer("empty_ckpt")[1](first, train_dataset=used, train_total_steps=10,
                                    eval_specs=[outer_loop.EvalSpec(eval_batches)])
    except ValueError as e:
        print("error:", e)
""")

NAN = textwrap.dedent("""
    bad = toy_data(64)
    bad["x"][:] = np.nan
    nan_outer = outer_loop.OuterLoop(train_loop.TrainLoop(train_step))
    nan_outer(first, train_dataset=iter(data.GlobalBatchDataset(bad, 16, seed=0)),
              train_total_steps=40, train_loop_steps=10)
""")

ROUTINE = textwrap.dedent("""
    notebook_logging.show_routine()
    train_step, routine = make_outer("routine_ckpt")
    routine(first, train_dataset=forever(), train_total_steps=40, train_loop_steps=20,
            eval_specs=[outer_loop.EvalSpec(eval_batches)])
""")

CELLS = [SETUP, TRAIN, OUT_OF_ORDER, MORE, STOP, AFTER_STOP, EXHAUSTED, NAN, ROUTINE]


def run_cells(workdir):
    cells = [nbformat.v4.new_code_cell(c.format(tests=str(Path(__file__).parent))
                                       if c is SETUP else c) for c in CELLS]
    cells[CELLS.index(STOP)].metadata["tags"] = ["raises-exception"]
    nb = nbformat.v4.new_notebook(cells=cells)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()  # one kernel for every cell; raises on a cell's unexpected error
    return [cell.outputs for cell in nb.cells]


def lines(outputs):
    """The lines a cell shows besides the progress bar: stdout's, and stderr's log lines
    (a line logged while the bar is drawn follows the bar's text on its line)."""
    logged = re.findall(r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):[^\n\r]*",
                        stream(outputs, "stderr"))
    others = [line for line in visible(stream(outputs, "stderr"))
              if not line.startswith("train:") and not re.match(r"[A-Z]+:", line)]
    return visible(stream(outputs, "stdout")) + logged + others


@pytest.mark.slow
@pytest.mark.usefixtures("text_bar")
def test_a_cell_prints_one_line_per_event(tmp_path):
    out = run_cells(tmp_path)
    train, out_of_order, more, stop, after_stop, exhausted, nan, routine = out[1:]

    # 400 steps, a checkpoint at each of 20 loops: the bar and at most 5 lines.
    shown = lines(train)
    assert len(shown) <= 5, shown
    assert not [line for line in shown if "checkpoint" in line.lower()], shown
    # The evaluation shows in the bar, out of the eval dataset's length.
    drawn = bar_states(stream(train, "stderr"))
    assert any(f"evaluating eval: {EVAL_BATCHES}/{EVAL_BATCHES}" in d for d in drawn), drawn
    assert f"{TOTAL}/{TOTAL}" in drawn[-1] and "evaluating" not in drawn[-1], drawn[-1]

    # The first cell again: it resumes at 400, says once that 300 is behind it, trains nothing.
    shown = lines(out_of_order)
    assert "at 400" in shown, shown
    [said] = [line for line in shown if "train_total_steps" in line]
    assert "step 400" in said and "300" in said and "train_steps=" in said, said
    assert not [line for line in shown if "Training from" in line], shown

    # n more steps, relative to where the state is.
    assert "at 440" in lines(more), lines(more)

    # A Stop ends the cell (so "Run all" stops there) in one line: the step, where the
    # state is, whether it was saved; no traceback, no warning lines.
    [error] = [o for o in stop if o.output_type == "error"]
    assert error.ename == "Interrupted", error
    [line] = error.traceback
    assert re.search(r"stopped at step \d+; a checkpoint was saved\. The live state is the "
                     r"OuterLoop's `\.state`", line), line
    assert lines(stop) == ["INFO:jaxloop.outer_loop:Training from step 0 to 400."], lines(stop)
    assert re.match(r"live \d+", lines(after_stop)[0]), lines(after_stop)

    # An iterator used up before step 0: an error naming it.
    [said] = [line for line in lines(exhausted) if line.startswith("error:")]
    assert said.startswith("error: The train dataset <list_iterator object") and (
        "before step 0" in said), said

    # The first non-finite loss: one warning naming its step and the guard.
    warned = [line for line in lines(nan) if "non-finite" in line]
    assert len(warned) == 1 and "train/loss is nan at step 1" in warned[0], lines(nan)
    assert "jaxloop.recipes.guard" in warned[0], warned
    # On a line of its own, not after the text bar's.
    assert warned[0] in visible(stream(nan, "stderr")), stream(nan, "stderr")

    # The routine lines, on request.
    saves = [line for line in lines(routine) if "Saving checkpoint for step" in line]
    assert len(saves) == 2, lines(routine)
