"""Run record: run.json and TensorBoard hparams, read back."""

import dataclasses
import importlib.metadata
import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxloop import partition
from jaxloop.diagnostics import run_record
from jaxloop.metrics import writers

eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


@dataclasses.dataclass
class Config:
    learning_rate: float = 1e-3
    batch_size: int = 64
    model: dict = dataclasses.field(default_factory=lambda: {"depth": 4})


def test_run_json_and_hparams(tmp_path):
    part = partition.DataParallelPartitioner(
        Mesh(np.array(jax.devices()).reshape(8), ("data",)))
    writer = writers.SummaryWriter(str(tmp_path / "train"))
    record = run_record.write(tmp_path, config=Config(), mesh=part, writer=writer)
    writer.close()

    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved == record
    assert saved["config"] == {"learning_rate": 1e-3, "batch_size": 64, "model": {"depth": 4}}
    assert saved["versions"]["jax"] == importlib.metadata.version("jax") == jax.__version__
    assert saved["versions"]["flax"] == importlib.metadata.version("flax")
    assert saved["devices"]["kinds"] == {jax.devices()[0].device_kind: 8}
    assert saved["devices"]["count"] == 8 and saved["devices"]["process_count"] == 1
    assert saved["mesh"] == {"axis_names": ["data"], "shape": {"data": 8}}

    from tensorboard.plugins.hparams import plugin_data_pb2

    # In the writer's run: one run folder per writer, however often a run resumes.
    assert not [p for p in (tmp_path / "train").iterdir() if p.is_dir()]
    acc = eam.EventAccumulator(str(tmp_path / "train"))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["learning_rate"].number_value == pytest.approx(1e-3)
    assert hp["model.depth"].number_value == 4
    assert hp["run.versions.jax"].string_value == jax.__version__
    assert hp["run.devices.count"].number_value == 8
    assert hp["run.mesh"].string_value == "data=8"

    # A resumed run writes its own record and keeps the earlier one.
    run_record.write(tmp_path, config={"learning_rate": 2e-3})
    assert json.loads((tmp_path / "run.json").read_text())["config"] == {
        "learning_rate": 2e-3}
    kept = [p for p in tmp_path.glob("run.*.json")]
    assert len(kept) == 1 and json.loads(kept[0].read_text())["config"]["batch_size"] == 64
