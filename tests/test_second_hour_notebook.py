"""What a notebook cell shows while it trains, read back from a real Jupyter kernel as a person
sees it: the docs' TensorBoard recipe (`writers.create_default_writer` in `SummaryAction`s)
writes every step to the event files but shows at most one line per evaluation in the cell,
no parameter table unless asked, and a text progress bar (no ipywidgets here, and no warning
about it) whose evaluation results name the step they belong to.

One kernel runs every scenario (cells run in order, the training cell twice).
"""

import re
import textwrap
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from test_notebooks import kernel_env  # noqa: E402, F401 (the fixture: a kernel on this Python)

TOTAL, LOOP = 400, 50
EVALUATIONS = TOTAL // LOOP

SETUP = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax, optax
    from models import ClassifierStep, LinenMLP, toy_data
    from jaxloop import actions, data, eval_loop, outer_loop, train_loop
    from jaxloop.diagnostics import param_table
    from jaxloop.metrics import writers

    forever = lambda: iter(data.GlobalBatchDataset(toy_data(256), 16, seed=0))  # repeats
    eval_batches = list(data.GlobalBatchDataset(toy_data(64, seed=1), 16, num_epochs=1))
    runs = 0
""")

# docs/notebooks.md, "TensorBoard inside the notebook", in a training cell.
RECIPE = textwrap.dedent(f"""
    runs += 1
    workdir = f"logs/{{runs}}"
    train_step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                                train=True)
    eval_step = ClassifierStep(jax.random.key(0), LinenMLP())
    train_writer = writers.create_default_writer(workdir, collection="train")
    eval_writer = writers.create_default_writer(workdir, collection="eval")
    trainer = train_loop.TrainLoop(train_step, end_actions=[actions.SummaryAction(train_writer)])
    evaluator = eval_loop.EvalLoop(eval_step, end_actions=[actions.SummaryAction(eval_writer)])
    outer = outer_loop.OuterLoop(trainer, [evaluator])
    state, outputs = outer(train_step.initialize_model([1, 16]), train_dataset=forever(),
                           train_total_steps={TOTAL}, train_loop_steps={LOOP},
                           eval_specs=[outer_loop.EvalSpec(dataset=eval_batches)])
""")

HISTORY = textwrap.dedent("""
    series = outer.history["eval/accuracy"]
    print("eval steps:", *series.steps)
    print("eval accuracy:", *(f"{v:.4g}" for v in series.values))
""")

# Asking for the table: printed from the state, then logged by the next new OuterLoop.
TABLE = "print(param_table.table(state))"
TABLE_LOGGED = textwrap.dedent(f"""
    import logging
    logging.getLogger("jaxloop.diagnostics.param_table").setLevel(logging.DEBUG)
    more = outer_loop.OuterLoop(train_loop.TrainLoop(train_step), progress=False)
    state, _ = more(state, train_dataset=forever(), train_total_steps={TOTAL + 5})
""")

CELLS = [SETUP, RECIPE, RECIPE, HISTORY, TABLE, TABLE_LOGGED]


@pytest.fixture
def text_bar(kernel_env, tmp_path_factory, monkeypatch):  # noqa: F811
    """Kernels that show the progress bar as text, as where ipywidgets is missing (the
    widget shows the same text): the tests read it from the cell's stderr. An IPython
    startup file hides ipywidgets from the kernel."""
    ipython_dir = tmp_path_factory.mktemp("ipython")
    startup = ipython_dir / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-text-bar.py").write_text("import sys\nsys.modules['ipywidgets'] = None\n")
    monkeypatch.setenv("IPYTHONDIR", str(ipython_dir))


def run_cells(workdir):
    cells = [nbformat.v4.new_code_cell(c.format(tests=str(Path(__file__).parent))
                                       if c is SETUP else c) for c in CELLS]
    nb = nbformat.v4.new_notebook(cells=cells)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()  # one kernel for every cell; raises on a cell's error
    return [cell.outputs for cell in nb.cells]


def stream(outputs, name):
    return "".join(o.get("text", "") for o in outputs
                   if o.output_type == "stream" and o.get("name") == name)


def visible(text):
    """The lines a notebook shows for a stream: a carriage return rewrites its line (the
    text progress bar updates in place)."""
    lines = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    return [line for line in lines if line.strip()]


def bar_states(text):
    """Every state the progress bar was drawn in, in order."""
    return [part.split("\n")[0] for part in text.split("\r") if part.startswith("train:")]


@pytest.mark.slow
@pytest.mark.usefixtures("text_bar")
def test_a_training_cell_shows_a_bar_and_a_line_per_evaluation_at_most(tmp_path):
    outputs = run_cells(tmp_path)
    eval_steps = [int(s) for s in re.search(r"eval steps: (.*)", stream(outputs[3], "stdout"))
                  .group(1).split()]
    assert eval_steps == list(range(LOOP, TOTAL + 1, LOOP))
    last_accuracy = stream(outputs[3], "stdout").split("eval accuracy: ")[1].split()[-1]

    for run in (1, 2):  # the training cell, then the same cell run again
        cell = outputs[run]
        assert not stream(cell, "stdout"), stream(cell, "stdout")
        shown = visible(stream(cell, "stderr"))
        bars = [line for line in shown if line.startswith("train:")]
        others = [line for line in shown if not line.startswith("train:")]
        # One bar, drawn in place; every other line is a message of the outer loop's
        # (no metric line per step, no parameter table, no warning of another library).
        assert len(bars) == 1 and f"{TOTAL}/{TOTAL}" in bars[0], shown
        assert len(others) <= EVALUATIONS, shown
        assert all(line.startswith(("INFO:jaxloop.outer_loop:", "WARNING:jaxloop."))
                   for line in others), others
        # Each evaluation the bar shows names its step: one already evaluated, and not
        # ahead of the bar.
        drawn = bar_states(stream(cell, "stderr"))
        evaluated = [(int(m.group(1)), int(m.group(2)))
                     for m in (re.search(r"\| (\d+)/\d+ .*eval at step (\d+): accuracy=", d)
                               for d in drawn) if m]
        assert evaluated, drawn
        assert all(at in eval_steps and at <= n for n, at in evaluated), evaluated
        assert f"eval at step {TOTAL}: accuracy={last_accuracy}" in bars[0], bars[0]

    # The event files still hold every train step and every evaluation.
    from tensorboard.backend.event_processing import event_accumulator as eam  # noqa: PLC0415

    for collection, steps in (("train", list(range(1, TOTAL + 1))), ("eval", eval_steps)):
        acc = eam.EventAccumulator(str(tmp_path / "logs" / "1" / collection),
                                   size_guidance={eam.SCALARS: 0})
        acc.Reload()
        assert [e.step for e in acc.Scalars("accuracy")] == steps, collection

    # The table when asked: printed, and logged by a new OuterLoop once its logger says so.
    printed = stream(outputs[4], "stdout")
    assert "params/dense1/kernel" in printed and printed.count("\n") > 10, printed
    logged = stream(outputs[5], "stderr")
    assert logged.count("params/dense1/kernel") == 1, logged
