"""The smaller words of issue 46, as a user's cell or script meets them: no STOPPED-marker
line after a finished run, one TensorBoard run folder per writer however often a run
resumes, an endless eval dataset stopped with a warning naming its spec, `train_steps=`
beside `train_total_steps`, epochs in the docs, the README's `num_flops`, and the notebooks'
environment (the `notebooks` extra, pinned; the Colab cell's source set by the user)."""

import importlib.metadata
import logging
import re
import sys
import tomllib
import types
from pathlib import Path

import jax
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data
from test_readme import notebook_preamble, notebook_snippets, run_cells

from jaxloop import data, eval_loop, outer_loop, train_loop
from jaxloop.metrics import writers
from jaxloop.orchestration import evaluation

ROOT = Path(__file__).resolve().parent.parent


def train_step():
    return ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)


def forever():
    return iter(data.GlobalBatchDataset(toy_data(128), 16, seed=0))


def test_a_second_run_after_a_finished_one_says_nothing_of_the_stopped_marker(tmp_path,
                                                                              caplog):
    step = train_step()
    spec = outer_loop.CheckpointSpec(tmp_path / "ckpt")
    with caplog.at_level(logging.DEBUG - 1, logger="jaxloop"):
        for total in (4, 8):  # the script run twice
            outer = outer_loop.OuterLoop(train_loop.TrainLoop(step), checkpoint_spec=spec,
                                         progress=False)
            outer(step.initialize_model([1, 16]), forever(), train_total_steps=total)
    assert outer_loop.stop_marker_path(tmp_path / "ckpt").exists()
    assert not [r for r in caplog.records
                if "STOPPED" in r.getMessage() and r.levelno >= logging.INFO]


def test_a_resumed_run_appends_to_the_writers_one_run_folder(tmp_path):
    for step in (1, 2):  # a run, then its resume: each writes its hparams and a scalar
        with writers.SummaryWriter(tmp_path / "train") as writer:
            writer.write_hparams({"lr": 0.1})
            writer.write_scalars(step, {"loss": 1.0 / step})
    assert [p for p in (tmp_path / "train").iterdir() if p.is_dir()] == []
    from tensorboard.backend.event_processing import event_accumulator as eam  # noqa: PLC0415

    acc = eam.EventAccumulator(str(tmp_path / "train"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]


def test_an_endless_eval_dataset_stops_at_the_bound_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(evaluation, "EVAL_STEPS_BOUND", 6)
    outer = outer_loop.OuterLoop(eval_loops=[eval_loop.EvalLoop(
        ClassifierStep(jax.random.key(0), LinenMLP()))], progress=False)
    state = train_step().initialize_model([1, 16])

    def endless():  # a train-style generator given as an eval dataset
        yield from forever()
        yield from forever()

    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        _, outputs = outer(state, eval_specs=[outer_loop.EvalSpec(dataset=endless())])
    assert len(outputs["loss"]) == 6
    [warning] = [r.getMessage() for r in caplog.records if "bound" in r.getMessage()]
    assert warning.startswith("eval_specs[0] (<generator object") and "num_steps" in warning
    with caplog.at_level(logging.WARNING, logger="jaxloop"):  # a finite one: no warning
        caplog.clear()
        _, outputs = outer(state, eval_specs=[outer_loop.EvalSpec(
            dataset=list(data.GlobalBatchDataset(toy_data(64), 16, num_epochs=1)))])
    assert len(outputs["loss"]) == 4 and not caplog.records


def test_train_steps_counts_from_where_the_state_is():
    step = train_step()
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step), progress=False)
    it = forever()
    state, _ = outer(step.initialize_model([1, 16]), it, train_steps=6, train_loop_steps=4)
    assert int(state.step) == 6 and outer.history["train/loss"].steps[-1] == 6
    state, _ = outer(state, it, train_steps=6, train_loop_steps=4)  # the cell run again
    assert int(state.step) == 12
    with pytest.raises(ValueError, match="train_total_steps .* or train_steps"):
        outer(state, it, train_total_steps=20, train_steps=4)
    with pytest.raises(ValueError, match="train_steps must be positive"):
        outer(state, it, train_steps=0)


def test_notebooks_md_epochs_cell_evaluates_once_per_epoch(tmp_path):
    build = notebook_snippets("Building loops cell by cell")[0]
    [epochs] = notebook_snippets("Epochs: a finite dataset repeated")
    scope = run_cells({"__name__": "notebook"}, notebook_preamble(tmp_path), build, epochs)
    assert int(scope["state"].step) == 3 * scope["epoch"] == 120
    assert scope["outer"].history["eval/accuracy"].steps == [40, 80, 120]


def test_readme_says_num_flops_is_per_device():
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| Steps and loops"))
    assert "flops of one step on one device" in row and "whole global step" not in row


def test_the_notebooks_extra_is_pinned_and_in_the_test_environment():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["notebooks"]
    assert {"ipykernel", "ipywidgets", "matplotlib", "tensorboard"} <= set(extra)
    assert "jaxloop[notebooks]" in project["optional-dependencies"]["test"]
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split())
    for name in extra:  # installed here (the kernels' environment) at its pin
        assert importlib.metadata.version(name) == pins[name], name
    readme = (ROOT / "README.md").read_text()
    assert "`bash scripts/notebooks.sh`" in readme
    assert "jupyter lab notebooks" in (ROOT / "scripts" / "notebooks.sh").read_text()


def test_the_colab_cell_installs_from_the_source_the_user_sets(monkeypatch, capsys):
    import nbformat  # noqa: PLC0415

    installed = []
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr("subprocess.run", lambda args, check: installed.append(args[-1]))
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        [cell] = [c.source for c in nbformat.read(path, as_version=4).cells
                  if "JAXLOOP_SOURCE" in c.source]
        with pytest.raises(ValueError, match="Set JAXLOOP_SOURCE"):  # as shipped: says so
            exec(cell, {})
        for source, requirement in (
                ("git+https://example.org/me/jaxloop", "jaxloop[examples] @ git+https://"
                                                       "example.org/me/jaxloop"),
                ("/content/jaxloop", "/content/jaxloop[examples]")):
            exec(re.sub(r'JAXLOOP_SOURCE = ""', f"JAXLOOP_SOURCE = {source!r}", cell), {})
            assert installed.pop() == requirement, path.name
            assert f"Installing {requirement}" in capsys.readouterr().out
