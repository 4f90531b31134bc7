"""What a notebook user is told: nothing to train, a checkpoint directory that blocks saving,
a batch given where the model's input spec is wanted, INFO lines in a kernel, the progress
bar's one rate with the latest train loss and eval metrics."""

import logging
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, data, outer_loop
from jaxloop import train_loop as train_loop_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.metrics.history import History

DATA = toy_data(128)


def train_step():
    return ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)


def warnings_of(caplog, text):
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def test_rerun_at_the_target_step_says_there_is_nothing_to_train(caplog):
    step = train_step()
    outer = outer_loop.OuterLoop(train_loop_lib.TrainLoop(step))
    it = iter(data.GlobalBatchDataset(DATA, 16, seed=0))
    state, _ = outer(step.initialize_model([1, 16]), it, train_total_steps=4)
    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        again, outputs = outer(state, it, train_total_steps=4)  # the cell run twice
    assert again is state and outputs is None  # as google/jaxloop returns
    [record] = warnings_of(caplog, "Nothing to train")
    assert "at step 4 and train_total_steps is 4" in record.getMessage()


def test_checkpoint_action_on_a_directory_with_later_steps_says_why_once(tmp_path, caplog):
    step = train_step()
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    outer = outer_loop.OuterLoop(train_loop_lib.TrainLoop(
        step, end_actions=[actions.CheckpointAction(manager)]))
    outer(step.initialize_model([1, 16]), iter(data.GlobalBatchDataset(DATA, 16, seed=0)),
          train_total_steps=8, train_loop_steps=2)
    manager.close()
    assert checkpoint.all_steps(tmp_path / "ckpt") == [4, 6, 8]
    # A bare train loop from step 0 into the same directory (an OuterLoop resumes from it,
    # or refuses with resume=False: tests/test_second_hour_outer.py).
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    loop = train_loop_lib.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)])
    it = iter(data.GlobalBatchDataset(DATA, 16, seed=0))
    state = step.initialize_model([1, 16])
    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        for _ in range(3):
            state, _ = loop(state, it, num_steps=2)
    manager.close()
    assert checkpoint.all_steps(tmp_path / "ckpt") == [4, 6, 8]  # nothing was saved
    [record] = warnings_of(caplog, "saves nothing")  # three loops, one warning
    assert "step 2" in record.getMessage() and "later checkpoint (step 8)" in record.getMessage()


def test_initialize_model_given_a_batch_names_the_spec_it_needs():
    step = train_step()
    batch = next(iter(data.GlobalBatchDataset(DATA, 16, seed=0)))
    with pytest.raises(TypeError, match=r"initialize_model\(\[1, 16\]\)") as error:
        step.initialize_model(batch)
    assert "memory.estimate" in str(error.value) and "['x', 'y']" in str(error.value)
    with pytest.raises(TypeError, match="model's input"):
        step.abstract_state({"x": [1, 16], "y": ([1], "int32")})

    class DictModel(nn.Module):  # a model that does take the dict still initialises
        @nn.compact
        def __call__(self, batch):
            return nn.Dense(10)(batch["x"])

    dict_step = ClassifierStep(jax.random.key(0), DictModel(), optimizer=optax.sgd(0.1))
    state = dict_step.initialize_model({"x": [1, 16], "y": ([1], "int32")})
    assert state.params["Dense_0"]["kernel"].shape == (16, 10)


_LOG_NUM_PARAMS = """
import sys
sys.path.insert(0, {tests!r})
{setup}
import jax, optax
from models import ClassifierStep, LinenMLP
step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
step.initialize_model([1, 16], log_num_params=True)
"""


def _stderr_of(setup):
    tests = str(__import__("pathlib").Path(__file__).parent)
    code = _LOG_NUM_PARAMS.format(tests=tests, setup=textwrap.dedent(setup))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    return done.stderr


@pytest.mark.slow
def test_log_num_params_shows_in_a_kernel_once_and_never_overrides_configured_logging():
    # ipykernel loaded (as in a notebook), nothing configured: the line shows, once.
    shown = _stderr_of("import ipykernel\nimport jaxloop")
    assert shown.count("Number of parameters: 874") == 1, shown
    # The user configured INFO logging: their format, once.
    configured = _stderr_of("""
        import ipykernel, logging
        logging.basicConfig(level=logging.INFO, format='USER %(message)s')
        import jaxloop
    """)
    assert configured.count("Number of parameters") == 1, configured
    assert "USER Number of parameters: 874" in configured
    # The user asked for WARNING and up only: nothing is added.
    quiet = _stderr_of("""
        import ipykernel, logging
        logging.basicConfig(level=logging.WARNING, format='USER %(message)s')
        import jaxloop
    """)
    assert "Number of parameters" not in quiet, quiet
    # A script (no kernel) keeps Python's default: INFO is not shown.
    assert "Number of parameters" not in _stderr_of("import jaxloop")


def test_progress_bar_shows_one_rate_after_compilation_and_the_latest_metrics():
    history = History()
    progress = actions.ProgressAction(total_steps=8, enabled=True, history=history)
    state = train_step().initialize_model([1, 16])
    history.record("train/loss", [1, 2], [2.0, 1.5])
    history.record("eval/accuracy", [2], [0.5])
    progress(state.replace(step=2), {"jaxloop/steps_per_sec": 2e5}, first_step=0)
    # The first loop compiled: no rate yet; the dispatch rate of the stats is not shown.
    assert progress._bar.postfix == "loss=1.5, eval at step 2: accuracy=0.5"
    history.record("train/loss", [3, 4], [1.0, 0.75])
    history.record("eval/accuracy", [4], [0.75])
    progress(state.replace(step=4), {"jaxloop/steps_per_sec": 2e5}, first_step=2)
    shown = str(progress._bar)
    assert "loss=0.75" in shown and "eval at step 4: accuracy=0.75" in shown
    assert shown.count("/s") == 1 and "steps/s=" in shown  # tqdm's own rate is left out
    rate = float(shown.split("steps/s=")[1].split(",")[0].split("]")[0])
    assert 0 < rate < 2e5
    progress.close()

