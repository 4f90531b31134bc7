"""OuterLoop.history: recorded per step and per evaluation, continued by a second call,
restored with a checkpoint in a fresh OuterLoop, plotted and tabulated."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import matplotlib
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions as actions_lib
from jaxloop import data, outer_loop
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import train_loop as train_loop_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.metrics.history import History

matplotlib.use("Agg")

DATA = toy_data(128)
EVAL = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 128, 16)]


def make(workdir=None):
    """A notebook's cells: steps, loops with an eval loop, an OuterLoop (checkpointed when
    given a workdir)."""
    train = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    end_actions, spec = [], None
    if workdir is not None:
        end_actions = [actions_lib.CheckpointAction(checkpoint.make_manager(workdir / "ckpt"))]
        spec = outer_loop.CheckpointSpec(workdir / "ckpt")
    outer = outer_loop.OuterLoop(
        train_loop_lib.TrainLoop(train, end_actions=end_actions),
        [eval_loop_lib.EvalLoop(ClassifierStep(jax.random.key(0), LinenMLP()))],
        checkpoint_spec=spec,
    )
    return train, outer


def fit(outer, state, it, total):
    return outer(state, it, train_total_steps=total, train_loop_steps=4,
                 eval_specs=[outer_loop.EvalSpec(EVAL, num_steps=2)])


def test_history_continues_across_calls_and_plots():
    train, outer = make()
    it = iter(data.GlobalBatchDataset(DATA, 16, seed=0))
    state, outputs = fit(outer, train.initialize_model([1, 16]), it, 8)
    history = outer.history
    assert history["train/loss"].steps == list(range(1, 9))
    # The per-step losses are the loop's own, value for value.
    last_loop = [float(v) for v in jax.device_get(outputs["loss"])]
    assert history["train/loss"].values[-4:] == pytest.approx(last_loop)
    assert history["eval/accuracy"].steps == [4, 8]

    state, _ = fit(outer, state, it, 16)  # the cell run again, further
    assert outer.history is history
    assert history["train/loss"].steps == list(range(1, 17))
    assert history["eval/loss"].steps == [4, 8, 12, 16]
    assert "train/jaxloop/steps_per_sec" not in history and "train/logits" not in history

    table = history.as_dict()
    assert set(table) == {"name", "step", "value"}
    assert table["name"].count("train/loss") == 16
    assert len(table["step"]) == len(table["value"]) == sum(
        len(history[n].steps) for n in history.names)

    fig = history.plot()
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panels) == {"loss", "accuracy"}
    lengths = sorted(len(line.get_xdata()) for line in panels["accuracy"].get_lines())
    assert lengths == [4, 16]  # eval points, train steps


def test_history_restarted_from_an_earlier_state_rewrites_its_future():
    train, outer = make()
    it = iter(data.GlobalBatchDataset(DATA, 16, seed=0))
    start = train.initialize_model([1, 16])
    fit(outer, start, it, 12)
    fit(outer, start, it, 4)  # the untrained state again: the history goes back with it
    assert outer.history["train/loss"].steps == [1, 2, 3, 4]
    assert outer.history["eval/accuracy"].steps == [4]


def test_history_comes_back_with_the_checkpoint_in_a_new_outer_loop(tmp_path):
    train, outer = make(tmp_path)
    dataset = data.GlobalBatchDataset(DATA, 16, seed=0)
    fit(outer, train.initialize_model([1, 16]), iter(dataset), 8)
    before = outer.history.as_dict()

    # A restarted kernel: new objects, the same directory.
    train, resumed = make(tmp_path)
    state, _ = fit(resumed, train.initialize_model([1, 16]), iter(dataset), 12)
    assert int(state.step) == 12
    history = resumed.history
    assert history["train/loss"].steps == list(range(1, 13))
    # The saved steps are the earlier run's values, exactly.
    assert history["train/loss"].values[:8] == before["value"][
        before["name"].index("train/loss"):before["name"].index("train/loss") + 8]
    assert history["eval/accuracy"].steps == [4, 8, 12]


def test_history_record_and_errors():
    history = History()
    history.record("train/loss", [1, 2, 3], [3.0, 2.0, 1.0])
    history.record("train/loss", [3, 4], [0.5, 0.25])  # step 3 again: replaced
    assert history["train/loss"].steps == [1, 2, 3, 4]
    assert history["train/loss"].values == [3.0, 2.0, 0.5, 0.25]
    assert history.latest("train") == {"loss": 0.25}
    copy = History()
    copy.load_state_dict(history.state_dict())
    assert copy.as_dict() == history.as_dict()
    with pytest.raises(KeyError, match="train/loss"):
        history["eval/loss"]
    with pytest.raises(ValueError, match="2 steps but 1 values"):
        history.record("x", [1, 2], [1.0])
    with pytest.raises(ValueError, match="empty"):
        History().plot()


def test_history_eval_values_are_the_loops_means_over_examples():
    # 120 examples in batches of 16: the last batch holds 8, and counts for 8.
    uneven = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 120, 16)]
    train, outer = make()
    state, _ = outer(train.initialize_model([1, 16]),
                     iter(data.GlobalBatchDataset(DATA, 16, seed=0)), train_total_steps=4,
                     eval_specs=[outer_loop.EvalSpec(uneven)])
    _, outputs = outer.eval_loops[0](state, uneven)
    expected = actions_lib.scalar_metrics(outputs)
    assert outer.history["eval/loss"].values == [pytest.approx(expected["loss"])]
    assert outer.history["eval/accuracy"].values == [pytest.approx(expected["accuracy"])]


def test_a_long_loops_losses_come_back_exactly_and_a_series_taken_stays_as_it_was():
    train = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    outer = outer_loop.OuterLoop(train_loop_lib.TrainLoop(train))
    it = iter(data.GlobalBatchDataset(DATA, 16, seed=0))
    # One loop of 300 steps: its losses are read in groups stacked on the device.
    state, outputs = outer(train.initialize_model([1, 16]), it, train_total_steps=300,
                           train_loop_steps=300)
    taken = outer.history["train/loss"]  # a notebook keeps what it plotted
    assert taken.steps == list(range(1, 301))
    assert taken.values == [float(v) for v in jax.device_get(outputs["loss"])]

    outer(state, it, train_total_steps=310, train_loop_steps=10)  # the next cell trains on
    assert len(taken.steps) == len(taken.values) == 300
    assert outer.history["train/loss"].steps == list(range(1, 311))


def test_bfloat16_losses_are_recorded():
    class HalfLoss(ClassifierStep):
        def run(self, state, batch):
            state, outputs = super().run(state, batch)
            return state, {"loss": outputs["loss"].astype(jax.numpy.bfloat16)}

    train = HalfLoss(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    outer = outer_loop.OuterLoop(train_loop_lib.TrainLoop(train))
    it = iter(data.GlobalBatchDataset(DATA, 16, seed=0))
    _, outputs = outer(train.initialize_model([1, 16]), it, train_total_steps=20,
                       train_loop_steps=20)
    assert outer.history["train/loss"].values == [
        float(v) for v in jax.device_get(outputs["loss"])]
    assert actions_lib.scalar_metrics(outputs)["loss"] > 0


def _meta_bytes(step_dir):
    return sum(f.stat().st_size for f in (step_dir / checkpoint.META_ITEM).rglob("*")
               if f.is_file())


def test_a_checkpoint_does_not_grow_with_the_run(tmp_path):
    """Issue 42.4: the meta item a CheckpointAction writes at step 10,000 is within 1 KB of
    the one at step 100, and the history lives in an append-only file beside the checkpoint
    directory. 100 real steps, then 9,900 more steps' values recorded as a run records
    them (a real 10,000-step run takes a minute here), then one real step more, saved
    through the same OuterLoop and action."""
    step = ClassifierStep(jax.random.key(0), LinenMLP(hidden=4), optimizer=optax.sgd(0.1),
                          train=True)
    ckpt = tmp_path / "ckpt"
    manager = checkpoint.make_manager(ckpt, max_to_keep=None)
    save = actions_lib.CheckpointAction(manager)
    trainer = train_loop_lib.TrainLoop(step, end_actions=[save])
    outer = outer_loop.OuterLoop(trainer, checkpoint_spec=outer_loop.CheckpointSpec(ckpt),
                                 progress=False)
    batches = iter(data.GlobalBatchDataset(DATA, 16, seed=0))
    state, _ = outer(step.initialize_model([1, 16]), batches, train_total_steps=100,
                     train_loop_steps=100)
    losses = outer.history["train/loss"].values
    outer.history.record("train/loss", range(101, 10_000), (losses * 99)[:9_899])
    outer(state.replace(step=9_999), batches, train_total_steps=10_000, train_loop_steps=100)
    assert manager.all_steps() == [100, 10_000]
    early, late = _meta_bytes(ckpt / "100"), _meta_bytes(ckpt / "10000")
    print(f"meta item: {early} B at step 100, {late} B at step 10,000")
    assert abs(late - early) < 1024
    assert "ckpt.history.jsonl" in [p.name for p in tmp_path.iterdir()]
    manager.close()

    # A new OuterLoop resumes the history from that file, up to the step restored.
    again = checkpoint.make_manager(ckpt, max_to_keep=None)
    resumed = outer_loop.OuterLoop(
        train_loop_lib.TrainLoop(step, end_actions=[actions_lib.CheckpointAction(again)]),
        checkpoint_spec=outer_loop.CheckpointSpec(ckpt), progress=False)
    resumed(step.initialize_model([1, 16]), batches, train_total_steps=10_000,
            train_loop_steps=100)
    again.close()
    assert resumed.history["train/loss"].steps == list(range(1, 10_001))
    assert resumed.history["train/loss"].values == outer.history["train/loss"].values


def test_a_checkpoint_of_an_earlier_release_brings_its_history_back(tmp_path):
    """Checkpoints written before the history file held the history in their meta item:
    they restore it, and the next saves move it into the file."""
    step = ClassifierStep(jax.random.key(0), LinenMLP(hidden=4), optimizer=optax.sgd(0.1),
                          train=True)
    ckpt = tmp_path / "ckpt"
    manager = checkpoint.make_manager(ckpt)
    saved = {"train/loss": [[1, 2, 3, 4], [2.5, 2.0, 1.5, 1.25]], "eval/accuracy": [[4], [0.5]]}
    checkpoint.save(manager, 4, step.initialize_model([1, 16]).replace(step=4),
                    meta={"loop_count": 1, "history": saved, "loop_partial": False,
                          "evals_pending": False, "early_stopping": []})
    manager.close()
    manager = checkpoint.make_manager(ckpt)
    outer = outer_loop.OuterLoop(
        train_loop_lib.TrainLoop(step, end_actions=[actions_lib.CheckpointAction(manager)]),
        checkpoint_spec=outer_loop.CheckpointSpec(ckpt), progress=False)
    outer(step.initialize_model([1, 16]), iter(data.GlobalBatchDataset(DATA, 16, seed=0)),
          train_total_steps=8, train_loop_steps=4)
    manager.close()
    assert outer.history["train/loss"].steps == list(range(1, 9))
    assert outer.history["train/loss"].values[:4] == [2.5, 2.0, 1.5, 1.25]
    assert outer.history["eval/accuracy"].values == [0.5]
    restored = History()
    assert restored.load_file(tmp_path / "ckpt.history.jsonl", step=8)
    assert restored.as_dict() == outer.history.as_dict()


JOB = Path(__file__).resolve().parent / "history_job.py"


def _run_job(result_dir, workdir, *args, hang=False):
    proc = subprocess.Popen([sys.executable, str(JOB), str(result_dir), str(workdir), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if hang:
        deadline = time.monotonic() + 240
        while not (result_dir / "ready").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job did not reach its hang step"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        return None
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads((result_dir / "result-0.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_history_after_kill_9_between_saves_equals_the_uninterrupted_run(tmp_path):
    """Issue 42.4: a job is killed (SIGKILL) after its checkpoint at step 40 and its
    history file have been written; the checkpoint of step 40 is then lost as a kill
    during its commit loses it, so the file holds values past the latest checkpoint (30).
    The same command resumes from step 30 and ends with the uninterrupted run's history."""
    whole = _run_job(tmp_path / "whole", tmp_path / "a", "50")
    _run_job(tmp_path / "killed", tmp_path / "b", "50", "40", hang=True)
    ckpt = tmp_path / "b" / "checkpoints"
    shutil.rmtree(ckpt / "40")
    on_disk = History()
    on_disk.load_file(ckpt.parent / "checkpoints.history.jsonl", step=10**9)
    assert on_disk["train/loss"].steps[-1] == 40 and checkpoint.all_steps(ckpt)[-1] == 30
    resumed = _run_job(tmp_path / "resumed", tmp_path / "b", "50")
    assert resumed["step"] == whole["step"] == 50
    assert resumed["history"] == whole["history"]
    assert whole["history"]["step"].count(50) == len(set(whole["history"]["name"]))
