"""The second hour with an `OuterLoop` (issue 37, items 1-6 and the history's plot): what a
notebook or script user meets after the quick start, each test written as their cells or
script do it. The notebook behaviours run in one real Jupyter kernel (see
`test_a_notebook_session_continues_rewinds_and_resumes_after_a_restart`)."""

import asyncio
import logging
import textwrap
import time

import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, data, eval_loop, outer_loop, train_loop
from jaxloop.checkpointing import checkpoint
from jaxloop.launch import preemption
from jaxloop.metrics import writers

DATA = toy_data(256)
BATCHES = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 256, 16)]


def train_step():
    return ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)


def eval_step():
    return ClassifierStep(jax.random.key(0), LinenMLP())


def warnings_of(caplog, text):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and text in r.getMessage()]


class Evaluated(actions.Action):
    """Records the steps an eval loop ran at."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def __call__(self, state, outputs, **kwargs):
        self.steps.append(int(state.step))


# --- 3. resume from the checkpoint action's own directory ------------------------------------


def checkpointed_run(directory, total, resume=True, state=None):
    """A script's run: a train loop that checkpoints into `directory`, no CheckpointSpec."""
    step = train_step()
    manager = checkpoint.make_manager(directory, max_to_keep=None)
    outer = outer_loop.OuterLoop(
        train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)]),
        **({} if resume else {"resume": False}))  # the default, as a user leaves it
    try:
        result = outer(step.initialize_model([1, 16]) if state is None else state,
                       iter(data.GlobalBatchDataset(DATA, 16, seed=0)),
                       train_total_steps=total, train_loop_steps=2)
    finally:
        manager.close()
    return result


def test_a_train_loop_that_checkpoints_resumes_from_its_directory_and_says_so(tmp_path, caplog):
    checkpointed_run(tmp_path / "ckpt", 4)
    # The script run again (a restart): no CheckpointSpec, the same directory.
    with caplog.at_level(logging.INFO, logger="jaxloop"):
        state, outputs = checkpointed_run(tmp_path / "ckpt", 8)
    assert f"Resumed from step 4 of {tmp_path / 'ckpt'}" in caplog.text
    assert int(state.step) == 8 and len(outputs["loss"]) == 2
    assert checkpoint.all_steps(tmp_path / "ckpt") == [2, 4, 6, 8]
    # Resumed exactly: the same parameters as one run of 8 steps.
    uninterrupted, _ = checkpointed_run(tmp_path / "one", 8)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(uninterrupted.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_off_on_a_directory_with_later_checkpoints_fails_before_training(tmp_path):
    checkpointed_run(tmp_path / "ckpt", 8)
    trained = []

    class Count(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            trained.append(int(state.step))

    step = train_step()
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(
        step, end_actions=[Count(), actions.CheckpointAction(manager)]), resume=False)
    with pytest.raises(ValueError, match=r"would save no checkpoint") as error:
        outer(step.initialize_model([1, 16]), iter(BATCHES), train_total_steps=6,
              train_loop_steps=2)
    message = str(error.value)
    assert str(tmp_path / "ckpt") in message and "step 8" in message and "step 0" in message
    assert "resume=False" in message
    assert trained == []  # failed before training
    # Resuming turned off on a new directory trains from the state given.
    state, _ = checkpointed_run(tmp_path / "new", 4, resume=False)
    assert int(state.step) == 4 and checkpoint.all_steps(tmp_path / "new") == [2, 4]


@pytest.mark.parametrize("spec", [False, True])
def test_a_live_state_ahead_of_the_directory_is_kept_not_rewound(tmp_path, spec):
    # E.g. a Stop whose save is still being written, or checkpoints every few loops.
    checkpointed_run(tmp_path / "ckpt", 4)
    step = train_step()
    ahead, _ = train_loop.TrainLoop(step)(step.initialize_model([1, 16]), BATCHES, num_steps=6)
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=None)
    outer = outer_loop.OuterLoop(
        train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)]),
        checkpoint_spec=outer_loop.CheckpointSpec(tmp_path / "ckpt") if spec else None)
    state, _ = outer(ahead, BATCHES, train_total_steps=8, train_loop_steps=2)
    manager.close()
    assert int(state.step) == 8
    # Trained from 6 (saved at 8), not from the checkpoint at 4 (which saves 6 and 8).
    assert checkpoint.all_steps(tmp_path / "ckpt") == [2, 4, 8]


class StopAtStep:
    """A step's end action that asks for a stop (as SIGTERM or a notebook's Stop does) once,
    after the train step numbered `at`."""

    interval = 1

    def __init__(self, at):
        self.at, self.done = at, False

    def __call__(self, state, outputs, **kwargs):
        if not self.done and int(state.step) == self.at:
            self.done = True
            preemption.request()


def test_the_continue_cell_after_a_stop_inside_a_loop_keeps_the_loop_boundaries():
    step = train_step()
    step.end_actions.append(StopAtStep(13))
    evaluated = Evaluated()
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step),
                                 [eval_loop.EvalLoop(eval_step(), end_actions=[evaluated])])
    specs = [outer_loop.EvalSpec(BATCHES[:1])]
    with pytest.raises(preemption.Preempted):  # stopped inside the third loop
        outer(step.initialize_model([1, 16]), BATCHES * 10, train_total_steps=25,
              train_loop_steps=5, eval_specs=specs)
    outer(outer.state, BATCHES * 10, train_total_steps=25, train_loop_steps=5,
          eval_specs=specs)
    assert evaluated.steps == [5, 10, 15, 20, 25]  # not 18, 23
    assert outer.train_loop.loop_count == 5


# --- 2. training again from an older state ---------------------------------------------------


def test_training_again_from_an_older_state_names_the_history_steps_it_replaces(caplog):
    step = train_step()
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step), [eval_loop.EvalLoop(eval_step())])
    untrained = step.initialize_model([1, 16])
    specs = [outer_loop.EvalSpec(BATCHES[:2])]
    state, _ = outer(untrained, BATCHES * 2, train_total_steps=10, train_loop_steps=5,
                     eval_specs=specs)
    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        outer(state, BATCHES * 2, train_total_steps=15, train_loop_steps=5,
              eval_specs=specs)  # continuing replaces nothing
    assert not warnings_of(caplog, "is replaced")
    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        outer(untrained, BATCHES * 2, train_total_steps=5, train_loop_steps=5,
              eval_specs=specs)  # the cell that trained from the untrained state, run again
    [message] = warnings_of(caplog, "is replaced")
    assert "from step 0" in message and "at steps 1-15 (eval/accuracy, eval/loss, " in message
    assert outer.history["eval/loss"].steps == [5]


# --- 4. an iterator as an EvalSpec dataset ---------------------------------------------------


def test_an_iterator_given_as_eval_dataset_is_named_at_the_first_empty_evaluation(caplog):
    step = train_step()
    evaluated = Evaluated()
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step),
                                 [eval_loop.EvalLoop(eval_step(), end_actions=[evaluated])])
    eval_batches = iter(BATCHES[:2])  # an iterator, where an iterable was meant
    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        outer(step.initialize_model([1, 16]), BATCHES * 4, train_total_steps=15,
              train_loop_steps=5, eval_specs=[outer_loop.EvalSpec(dataset=eval_batches)])
    [message] = warnings_of(caplog, "read no batch")  # said once, at the first empty one
    assert "evaluation at step 10" in message and "iterator" in message
    assert "a list, a tf.data or grain dataset" in message
    assert outer.history["eval/loss"].steps == [5]  # only the first evaluation had batches


# --- 5. a finite train dataset ends with an evaluation ---------------------------------------


def test_a_finite_train_dataset_is_evaluated_at_the_step_it_reached():
    step = train_step()
    evaluated = Evaluated()
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step),
                                 [eval_loop.EvalLoop(eval_step(), end_actions=[evaluated])])
    state, outputs = outer(step.initialize_model([1, 16]), BATCHES[:13], train_total_steps=100,
                           train_loop_steps=5, eval_specs=[outer_loop.EvalSpec(BATCHES[:2])])
    assert int(state.step) == 13 and len(outputs["loss"]) == 3
    assert evaluated.steps == [5, 10, 13]
    assert outer.history["eval/loss"].steps == [5, 10, 13]
    # Data that ends at a loop boundary: the last evaluation is not repeated.
    evaluated.steps.clear()
    outer(step.initialize_model([1, 16]), BATCHES[:10], train_total_steps=100,
          train_loop_steps=5, eval_specs=[outer_loop.EvalSpec(BATCHES[:2])])
    assert evaluated.steps == [5, 10]


# --- 6. the history and TensorBoard on resume ------------------------------------------------


def summarised_run(workdir, total):
    """A script with a checkpointing train loop and an eval loop writing TensorBoard."""
    step = train_step()
    manager = checkpoint.make_manager(workdir / "ckpt", max_to_keep=None)
    writer = writers.create_default_writer(workdir / "tb", collection="eval")
    outer = outer_loop.OuterLoop(
        train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)]),
        [eval_loop.EvalLoop(eval_step(), end_actions=[actions.SummaryAction(writer)])])
    outer(step.initialize_model([1, 16]), iter(data.GlobalBatchDataset(DATA, 16, seed=0)),
          train_total_steps=total, train_loop_steps=5,
          eval_specs=[outer_loop.EvalSpec(BATCHES[:2])])
    writer.close()
    manager.close()
    return outer


def test_a_resumed_run_keeps_its_last_evaluation_and_writes_each_eval_step_once(tmp_path):
    eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    first = summarised_run(tmp_path, 10)
    assert first.history["eval/loss"].steps == [5, 10]
    # Run again (a restart) with the run finished: its history ends with the evaluation at
    # its last step, as it did before the restart.
    again = summarised_run(tmp_path, 10)
    assert again.history["eval/loss"] == first.history["eval/loss"]
    # Extended: TensorBoard has each evaluation once, none repeated at the resume step.
    resumed = summarised_run(tmp_path, 20)
    assert resumed.history["eval/loss"].steps == [5, 10, 15, 20]
    accumulator = eam.EventAccumulator(str(tmp_path / "tb" / "eval"),
                                       size_guidance={eam.SCALARS: 0},
                                       purge_orphaned_data=False)
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("loss")] == [5, 10, 15, 20]


# --- 11. the history's plot ------------------------------------------------------------------


def test_history_plot_labels_its_axes_and_keeps_each_series_colour():
    pytest.importorskip("matplotlib")
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    step = train_step()
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step), [eval_loop.EvalLoop(eval_step())])
    outer(step.initialize_model([1, 16]), BATCHES, train_total_steps=10, train_loop_steps=5,
          eval_specs=[outer_loop.EvalSpec(BATCHES[:2])])

    def colours(fig):
        return {line.get_label(): line.get_color()
                for ax in fig.axes for line in ax.get_lines()}

    whole = outer.history.plot()
    assert {ax.get_title(): ax.get_ylabel() for ax in whole.axes} == {
        "accuracy": "accuracy", "loss": "loss"}
    eval_only = outer.history.plot(["eval/accuracy"])
    reordered = outer.history.plot(["eval/loss", "train/loss"])
    assert colours(eval_only)["eval"] == colours(whole)["eval"] == colours(reordered)["eval"]
    assert colours(reordered)["train"] == colours(whole)["train"] != colours(whole)["eval"]


# --- 1, 2, 3, 6 in a real kernel: Stop, continue twice, rewind, restart and resume ------------

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from test_notebooks import kernel_env  # noqa: E402, F401 (the fixture: a kernel on this Python)
from test_readme import notebook_preamble, notebook_snippets  # noqa: E402

READY = textwrap.dedent("""
    class Ready(actions.Action):  # tells the test that a loop has ended: press Stop now
        def __call__(self, state, outputs, **kwargs):
            open("READY", "w").close()

    outer.train_loop.end_actions.append(Ready())
""")
REWIND = ("state, outputs = outer(train_step.initialize_model([1, 8, 8, 1]), "
          "train_dataset=train_iter, train_total_steps=100, train_loop_steps=50, "
          "eval_specs=[outer_loop.EvalSpec(dataset=eval_ds)])")
SHOW = ('print("live:", int(outer.state.step), int(state.step), outer.stopped_state is None, '
        'outer.history["eval/loss"].steps[-3:])')
NO_RESUME = textwrap.dedent("""
    manager = checkpoint.make_manager(workdir / "checkpoints", max_to_keep=2)
    fresh = outer_loop.OuterLoop(
        train_loop.TrainLoop(train_step, end_actions=[actions.CheckpointAction(manager)]),
        resume=False)
    fresh(train_step.initialize_model([1, 8, 8, 1]), train_dataset=iter(train_ds),
          train_total_steps=100)
""")


def stream(cell, name):
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.output_type == "stream" and o.get("name") == name)


def errors(cell):
    return [(o.ename, o.evalue) for o in cell.outputs if o.output_type == "error"]


@pytest.mark.slow
@pytest.mark.usefixtures("kernel_env")
def test_a_notebook_session_continues_rewinds_and_resumes_after_a_restart(tmp_path):
    """One kernel, the docs' cells as written: Stop the training cell, run the continue
    cell twice (item 1); train again from the untrained state (item 2: a warning names the
    history's steps replaced); then the resume cell, a kernel restart and the same cells
    again (items 3 and 6: resumed from the action's directory, the last evaluation kept),
    and a run with resuming off that could save nothing (item 3: refused before training)."""
    build, train = notebook_snippets("Building loops cell by cell")[:2]
    cont, _ = notebook_snippets("Interrupting and continuing")
    [resume] = notebook_snippets("Resuming after a kernel restart")
    before = [notebook_preamble("nb") + build + READY, train, cont, cont, SHOW, REWIND, SHOW,
              resume]
    after = [notebook_preamble("nb") + build, resume, SHOW, NO_RESUME]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in before + after])
    cells = nb.cells
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(tmp_path)}})

    async def run():
        async with client.async_setup_kernel():
            await client.async_execute_cell(cells[0], 0)
            training = asyncio.ensure_future(client.async_execute_cell(cells[1], 1))
            deadline = time.monotonic() + 300
            while not (tmp_path / "READY").exists():
                assert not training.done(), cells[1].outputs
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await client.km.interrupt_kernel()  # the Stop button
            await training
            for i in range(2, len(before)):
                await client.async_execute_cell(cells[i], i)
            await client.km.restart_kernel(now=True)  # Kernel > Restart
            await client.kc.wait_for_ready(timeout=120)
            for i in range(len(before), len(cells)):
                await client.async_execute_cell(cells[i], i)

    asyncio.run(run())
    assert not errors(cells[0]), cells[0].outputs
    assert [e for e, _ in errors(cells[1])] == ["Interrupted"], cells[1].outputs
    for i in (2, 3, 4, 5, 6, 7, 8, 9, 10):
        assert not errors(cells[i]), (i, cells[i].outputs)
    # 1. The continue cell, after Stop and again after the run it continued finished.
    assert "Nothing to train: the state is at step 1000" in stream(cells[3], "stderr")
    assert stream(cells[4], "stdout").startswith("live: 1000 1000 True [900, 950, 1000]")
    # 2. Training again from an older state says which steps of the history it replaces.
    rewind = stream(cells[5], "stderr")
    assert "what it holds at steps 1-1000 (eval/accuracy, eval/loss" in rewind, rewind
    assert stream(cells[6], "stdout").startswith("live: 100 100 True [50, 100]")
    # 3 and 6. After the restart, the resume cell resumes from the checkpoint action's
    # directory, with the evaluation at its last step.
    resumed = stream(cells[9], "stderr")
    assert "Resumed from step 1000 of" in resumed and "Nothing to train" in resumed, resumed
    assert stream(cells[10], "stdout").startswith("live: 1000 1000 True [900, 950, 1000]")
    [(name, message)] = errors(cells[11])
    assert name == "ValueError" and "would save no checkpoint" in message, message
