"""Parameter table: rows and totals checked against the arrays' own shards; logged by
OuterLoop; written to TensorBoard's text tab by the run record."""

from __future__ import annotations

import collections
import itertools
import json
import logging

import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import outer_loop, train_loop
from jaxloop.diagnostics import param_table, run_record
from jaxloop.examples import transformer
from jaxloop.metrics import writers

eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

SPEC = ([1, 64], "int32")


def transformer_step(kind: str) -> transformer.LMStep:
    partitioner, model_axis = transformer.make_partitioner(kind)
    model = transformer.TransformerLM(transformer.LMConfig(), model_axis=model_axis)
    return transformer.LMStep(jax.random.key(0), model,
                              optimizer=transformer.make_optimizer(1e-2, 10),
                              partitioner=partitioner, train=True)


@pytest.mark.parametrize("kind", ["fsdp", "spmd"])
def test_transformer_table_matches_its_shards(kind):
    step = transformer_step(kind)
    state = step.initialize_model(SPEC)
    rows = {r.path: r for r in param_table.rows(state)}
    leaves = {jax.tree_util.keystr(p, simple=True, separator="/"): x
              for p, x in jax.tree_util.tree_leaves_with_path(state)}
    assert set(rows) == set(leaves)
    held = collections.Counter()
    for path, leaf in leaves.items():
        row = rows[path]
        assert row.shape == leaf.shape and row.dtype == str(leaf.dtype)
        assert row.bytes == leaf.nbytes
        shard_bytes = [s.data.nbytes for s in leaf.addressable_shards]
        assert row.bytes_per_device == max(shard_bytes)
        spec = leaf.sharding.spec
        assert row.sharding == ("replicated" if not any(spec) else str(tuple(spec)))
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    totals = param_table.totals(state)
    assert totals["params"] == step.num_params
    assert totals["bytes"] == sum(x.nbytes for x in leaves.values())
    assert totals["max_bytes_per_device"] == max(held.values())
    # The kernels are split: a device holds less than the whole state.
    assert totals["max_bytes_per_device"] < totals["bytes"]
    up = rows["params/block0/mlp/up/kernel"]
    if kind == "spmd":
        assert up.sharding == "(None, 'model')" and up.bytes_per_device == up.bytes // 2
    else:
        assert up.sharding == "(None, 'data')" and up.bytes_per_device == up.bytes // 8
    # The abstract state describes the same table, with nothing allocated.
    assert param_table.rows(step.abstract_state(SPEC)) == param_table.rows(state)
    text = param_table.table(state)
    assert "params/block0/mlp/up/kernel" in text and f"{totals['params']:,} parameters" in text


def test_outer_loop_logs_the_table_and_run_record_writes_it(tmp_path, caplog):
    step = ClassifierStep(jax.random.key(0), LinenMLP(hidden=8), optax.sgd(0.1), train=True)
    state = step.initialize_model([1, 8])
    data = toy_data(16, din=8)
    with caplog.at_level(logging.INFO, logger="jaxloop.diagnostics.param_table"):
        # A script logging at INFO gets no table of about a line per parameter.
        outer_loop.OuterLoop(train_loop.TrainLoop(step), progress=False)(
            state, itertools.repeat(data), train_total_steps=1)
    assert not [r for r in caplog.records if r.name == "jaxloop.diagnostics.param_table"]
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step), progress=False)
    with caplog.at_level(logging.DEBUG, logger="jaxloop.diagnostics.param_table"):
        state, _ = outer(state, itertools.repeat(data), train_total_steps=2,
                         train_loop_steps=2)
        # The training cell run again: the same state's layout is not logged again.
        outer(state, itertools.repeat(data), train_total_steps=4, train_loop_steps=2)
    (logged,) = [r.getMessage() for r in caplog.records
                 if r.name == "jaxloop.diagnostics.param_table"]
    assert "params/dense1/kernel" in logged and "(8, 8)" in logged and "162 parameters" in logged

    writer = writers.SummaryWriter(str(tmp_path / "train"))
    record = run_record.write(tmp_path, config={"lr": 0.1}, writer=writer, state=state)
    writer.close()
    assert record["state"]["params"] == 162
    assert json.loads((tmp_path / "run.json").read_text())["state"] == record["state"]
    acc = eam.EventAccumulator(str(tmp_path / "train"), size_guidance={eam.TENSORS: 0})
    acc.Reload()
    (event,) = acc.Tensors("parameters/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 0 and "| params/dense2/kernel | (8, 10) | float32 |" in text
    assert np.all([line.startswith("|") for line in text.splitlines()[:-2]])
