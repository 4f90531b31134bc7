"""MLflow and W&B writers, for real: a local MLflow file store read back with mlflow's client,
W&B offline run files read back record by record; a resumed job continues the same run."""

import json
import wave

import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data
from PIL import Image

from jaxloop import actions, outer_loop, train_loop
from jaxloop.checkpointing import checkpoint
from jaxloop.metrics import trackers


class Losses(ClassifierStep):
    def run(self, state, batch):
        state, out = super().run(state, batch)
        return state, {"loss": out["loss"], "accuracy": out["accuracy"]}


def train(workdir, writer, total, **manager_options):
    """Trains to `total` steps (resuming from workdir/ckpt) with summaries and checkpoints."""
    step = Losses(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    manager = checkpoint.make_manager(workdir / "ckpt", **manager_options)
    tl = train_loop.TrainLoop(step, end_actions=[
        actions.SummaryAction(writer),
        actions.CheckpointAction(manager, meta={trackers.RUN_ID_KEY: writer.run_id}),
    ])
    outer = outer_loop.OuterLoop(train_loop=tl,
                                 checkpoint_spec=outer_loop.CheckpointSpec(workdir / "ckpt"))
    state, _ = outer(step.initialize_model([1, 16]), iter([toy_data(32, seed=0)] * total),
                     train_total_steps=total, train_loop_steps=2)
    manager.wait_until_finished()
    manager.close()
    return state


def test_mlflow_file_store_read_back_and_resumed(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    # MLflow 3 keeps its file store for those who opt in; a database needs SQLAlchemy.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    assert checkpoint.read_meta(tmp_path / "ckpt").get(trackers.RUN_ID_KEY) is None
    writer = trackers.MlflowWriter(experiment="digits", tracking_uri=uri, run_name="first")
    writer.write_hparams({"lr": 0.01, "model": {"hidden": 32}})
    writer.write_images(0, {"sample": np.zeros((2, 4, 4, 1), np.float32)})
    writer.write_texts(0, {"note": "hello"})
    train(tmp_path, writer, 4)
    writer.close()
    run_id = writer.run_id

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.01", "model.hidden": "32.0"}
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3, 4]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert "texts" in artifacts and "images" in artifacts

    # The job restarts: the run id comes back from the latest checkpoint.
    saved = checkpoint.read_meta(tmp_path / "ckpt").get(trackers.RUN_ID_KEY)
    assert saved == run_id
    resumed = trackers.MlflowWriter(experiment="digits", tracking_uri=uri, run_id=saved)
    resumed.write_hparams({"lr": 0.01, "model": {"hidden": 32}, "resumed": True})
    train(tmp_path, resumed, 6)
    resumed.close()
    assert resumed.run_id == run_id
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(m.value) for m in history)
    assert client.get_run(run_id).data.params["resumed"] == "True"
    exp = client.get_experiment_by_name("digits")
    assert len(client.search_runs([exp.experiment_id])) == 1
    assert mlflow.__version__


def _wandb_records(path):
    """The records of a W&B run file (LevelDB log format after a 7-byte W&B header)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4:pos + 6], "little")
        kind = data[pos + 6]
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):  # full, first
            pending = chunk
        else:  # middle, last
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _history(run_dir):
    out = []
    for record in _wandb_records(next(run_dir.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                     for i in record.history.item}
            out.append(items)
    return out


@pytest.mark.timeout(300)
def test_wandb_offline_files_read_back_and_resumed(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    writer = trackers.WandbWriter(project="digits", mode="offline", dir=tmp_path / "wb",
                                  config={"lr": 0.01})
    writer.write_hparams({"model": {"hidden": 32}})
    frames = np.linspace(0, 1, 5)[:, None, None, None] * np.ones((5, 8, 6, 1))  # distinct
    writer.write_videos(0, {"clip": np.stack([frames, 1 - frames])})  # [N, T, H, W, C], grey
    writer.write_audios(0, {"tone": np.zeros((2, 100, 2))}, sample_rate=8000)  # [N, T, C]
    train(tmp_path, writer, 4)
    writer.close()
    wandb.teardown()  # stops W&B's service process: its files are complete after this
    run_id = writer.run_id
    [first] = (tmp_path / "wb" / "wandb").glob(f"offline-run-*-{run_id}")
    history = _history(first)
    media = next(h for h in history if "clip/path" in h)
    gif = Image.open(first / "files" / media["clip/path"])
    assert (gif.format, gif.n_frames, gif.size) == ("GIF", 5, (12, 8))  # two side by side
    assert media["tone/sampleRates"] == [8000, 8000]
    with wave.open(str(first / "files" / media["tone/audio"][0]["path"])) as wav:
        assert (wav.getnchannels(), wav.getframerate(), wav.getnframes()) == (2, 8000, 100)
    losses = [h for h in history if "loss" in h]
    assert [h["_step"] for h in losses] == [1, 2, 3, 4]
    assert all(np.isfinite(h["loss"]) for h in losses)
    # The config given to init is in the run record; later updates in config records.
    records = _wandb_records(next(first.glob("run-*.wandb")))
    updates = [u for r in records if r.WhichOneof("record_type") == "run"
               for u in r.run.config.update]
    updates += [u for r in records if r.WhichOneof("record_type") == "config"
                for u in r.config.update]
    keys = {(u.key or ".".join(u.nested_key)): json.loads(u.value_json) for u in updates}
    assert keys["lr"] == 0.01 and keys["model.hidden"] == 32.0

    saved = checkpoint.read_meta(tmp_path / "ckpt").get(trackers.RUN_ID_KEY)
    assert saved == run_id
    resumed = trackers.WandbWriter(project="digits", mode="offline", dir=tmp_path / "wb",
                                   run_id=saved)
    train(tmp_path, resumed, 6)
    resumed.close()
    wandb.teardown()
    assert resumed.run_id == run_id
    runs = sorted((tmp_path / "wb" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert first in runs
    steps = [h["_step"] for run in runs for h in _history(run) if "loss" in h]
    assert steps == [1, 2, 3, 4, 5, 6]


class RunIdOnly:
    """A tracker's part in resuming: its run id (the metrics go nowhere)."""

    def __init__(self, run_id):
        self.run_id = run_id

    def write_scalars(self, step, scalars):
        pass

    def flush(self):
        pass


def test_the_run_id_comes_back_whatever_the_step_naming(tmp_path):
    """Issue 23.13: a manager naming its steps ``ckpt_000004`` keeps the tracker's run."""
    naming = {"step_prefix": "ckpt", "step_format_fixed_length": 6}
    train(tmp_path, RunIdOnly("run-7f3a"), 4, **naming)
    assert (tmp_path / "ckpt" / "ckpt_000004").exists()
    assert checkpoint.read_meta(tmp_path / "ckpt").get(trackers.RUN_ID_KEY) == "run-7f3a"
    assert checkpoint.read_meta(tmp_path / "ckpt", 2).get(trackers.RUN_ID_KEY) == "run-7f3a"


def test_missing_package_message(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mlflow(name, *args, **kwargs):
        if name == "mlflow" or name.startswith("mlflow."):
            raise ImportError("No module named 'mlflow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    monkeypatch.delitem(__import__("sys").modules, "mlflow", raising=False)
    with pytest.raises(ImportError, match=r"pip install jaxloop\[mlflow\]"):
        trackers.MlflowWriter(tracking_uri="file:///nonexistent")
