"""Beyond one axis on 8 CPU devices: the batch split over several mesh axes, hybrid sharding
(HSDP: state split within a group, replicated across groups), data x fsdp x tensor, meshes
from sizes, and evaluation on a placement of its own."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
import test_multiprocess as mp
from jax.sharding import PartitionSpec as P
from models import ClassifierStep, LinenMLP, toy_data
from test_tensor_parallel import LogicalMLP

from jaxloop import eval_loop, outer_loop, partition, train_loop
from jaxloop.launch import meshes
from jaxloop.state import specs


class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(512)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


def hsdp(min_weight_size=2**10):
    mesh = meshes.make_mesh({"replica": 2, "fsdp": -1})
    return partition.FSDPPartitioner(mesh, data_axis=("replica", "fsdp"), fsdp_axis="fsdp",
                                     min_weight_size=min_weight_size)


def dp():
    return partition.DataParallelPartitioner(meshes.make_mesh({"data": -1}), "data")


def bytes_per_device(tree):
    per_device = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return per_device


def test_make_mesh_fills_the_rest_and_keeps_trailing_axes_together():
    mesh = meshes.make_mesh({"replica": -1, "fsdp": 4})
    assert dict(mesh.shape) == {"replica": 2, "fsdp": 4}
    # Devices in order: each 'fsdp' row is 4 consecutive devices (one host's, on 2 hosts).
    assert [[d.id for d in row] for row in mesh.devices] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dict(meshes.make_mesh({"data": -1, "fsdp": 2, "tensor": 2}).shape) == {
        "data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="Only one mesh axis may be -1"):
        meshes.make_mesh({"a": -1, "b": -1})
    with pytest.raises(ValueError, match="multiply to 4, not the 8 devices"):
        meshes.make_mesh({"a": 2, "b": 2})
    with pytest.raises(ValueError, match="do not divide by 3"):
        meshes.make_mesh({"a": -1, "b": 3})


def test_batch_is_split_over_the_product_of_the_data_axes():
    part = hsdp()
    assert part.data_axis == ("replica", "fsdp") and part.num_data_shards == 8
    data = {"x": np.arange(32 * 2, dtype=np.float32).reshape(32, 2), "y": np.arange(32)}
    placed = part.shard_batch(data)
    # Device at (r, f) holds rows [(r*4 + f)*4, +4): the tuple's order, replica major.
    for shard in placed["y"].addressable_shards:
        r, f = (int(i) for i in np.argwhere(part.mesh.devices == shard.device)[0])
        np.testing.assert_array_equal(np.asarray(shard.data), np.arange(4) + (r * 4 + f) * 4)
    with pytest.raises(ValueError, match="does not divide by the 8 local devices"):
        part.shard_batch({"x": np.zeros((12, 2))})
    # Described without being built (Step.abstract_state's batches), split the same way.
    abstract = specs.abstract_batch(part, {"x": [32, 2]})
    assert abstract["x"].sharding == placed["x"].sharding == part.batch_sharding
    with pytest.raises(ValueError, match="does not divide by the 8 devices"):
        specs.abstract_batch(part, {"x": [12, 2]})


def test_bad_data_and_fsdp_axes_are_clear_errors():
    mesh = meshes.make_mesh({"replica": 2, "fsdp": -1})
    with pytest.raises(ValueError, match="'model' is not an axis of the mesh"):
        partition.DataParallelPartitioner(mesh, ("replica", "model"))
    with pytest.raises(ValueError, match="names an axis twice"):
        partition.DataParallelPartitioner(mesh, ("fsdp", "fsdp"))
    with pytest.raises(ValueError, match="fsdp_axis"):
        partition.FSDPPartitioner(mesh, ("replica", "fsdp"), fsdp_axis="tensor")
    with pytest.raises(TypeError, match="data_axis must be a mesh axis name"):
        partition.DataParallelPartitioner(mesh, 3)
    # A one-axis tuple reads as the axis itself.
    assert partition.DataParallelPartitioner(mesh, ("fsdp",)).data_axis == "fsdp"


def test_hsdp_splits_state_within_groups_and_trains_like_data_parallel():
    data = toy_data(64, din=32)
    steps, states, losses = {}, {}, {}
    for name, part in (("hsdp", hsdp()), ("dp", dp())):
        steps[name] = ClassifierStep(jax.random.key(0), Wide(), optimizer=optax.adam(1e-3),
                                     partitioner=part, train=True)
        states[name] = steps[name].initialize_model([1, 32])
        losses[name] = []
        for i in range(6):
            batch = {k: v[(i % 2) * 32:(i % 2 + 1) * 32] for k, v in data.items()}
            states[name], out = steps[name](states[name], batch)
            losses[name].append(float(out["loss"]))
    np.testing.assert_allclose(losses["hsdp"], losses["dp"], rtol=1e-5)
    state = states["hsdp"]
    kernel = state.params["Dense_0"]["kernel"]  # (32, 512): 512 split over 'fsdp'
    assert kernel.sharding.spec == P(None, "fsdp")
    assert state.params["Dense_0"]["bias"].sharding.spec == P()  # small: replicated
    mesh = steps["hsdp"].partitioner.mesh
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        if leaf.size < 2**10:
            continue
        # Every replica row of the mesh holds all the shards of a leaf: gathers stay in it.
        shards = leaf.sharding.devices_indices_map(leaf.shape)
        for row in mesh.devices:
            held = {tuple((s.start, s.stop) for s in shards[d]) for d in row}
            assert len(held) == 4, (leaf.shape, leaf.sharding.spec)
    tree = (state.params, state.opt_state)
    total = sum(x.nbytes for x in jax.tree.leaves(tree))
    assert max(bytes_per_device(tree).values()) == pytest.approx(total / 4, rel=0.05)


def test_spmd_data_fsdp_tensor_mesh():
    mesh = meshes.make_mesh({"data": -1, "fsdp": 2, "tensor": 2})
    rules = [("batch", ("data", "fsdp")), ("embed", None), ("mlp", "tensor"),
             ("vocab", "tensor")]
    part = partition.SPMDPartitioner(mesh, data_axis=("data", "fsdp"), fsdp_axis="fsdp",
                                     logical_axis_rules=rules, fsdp_min_weight_size=2**10)
    step = ClassifierStep(jax.random.key(0), LogicalMLP(hidden=128, out=16),
                          optimizer=optax.adam(1e-2), partitioner=part, train=True)
    ref = ClassifierStep(jax.random.key(0), LogicalMLP(hidden=128, out=16),
                         optimizer=optax.adam(1e-2), partitioner=dp(), train=True)
    state, ref_state = step.initialize_model([1, 16]), ref.initialize_model([1, 16])
    assert state.params["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert state.params["down"]["kernel"].sharding.spec == P("tensor", "fsdp")
    data = toy_data(32, classes=16)
    for _ in range(3):
        state, out = step(state, data)
        ref_state, ref_out = ref(ref_state, data)
        np.testing.assert_allclose(float(out["loss"]), float(ref_out["loss"]), rtol=1e-5)


def test_eval_on_its_own_placement_beside_fsdp_training():
    fsdp = partition.FSDPPartitioner(meshes.make_mesh({"data": -1}), "data",
                                     min_weight_size=64)
    train = ClassifierStep(jax.random.key(0), LinenMLP(hidden=64), optimizer=optax.adam(1e-2),
                           partitioner=fsdp, train=True)
    state = train.initialize_model([1, 16])
    data = toy_data(64)
    state, _ = train(state, {k: v[:32] for k, v in data.items()})
    kernel_before = state.params["dense1"]["kernel"]
    batches = [{k: v[i * 16:(i + 1) * 16] for k, v in data.items()} for i in range(4)]

    same = eval_loop.EvalLoop(ClassifierStep(jax.random.key(0), LinenMLP(hidden=64),
                                             partitioner=fsdp, train=False))
    # A replicated mesh of 4 devices: another mesh, another partitioner.
    host_mesh = meshes.make_mesh({"data": -1}, devices=jax.devices()[:4])
    other = eval_loop.EvalLoop(ClassifierStep(
        jax.random.key(0), LinenMLP(hidden=64),
        partitioner=partition.DataParallelPartitioner(host_mesh, "data"), train=False))
    _, expected = same(state, iter(batches))
    assert same.state_moves == 0
    for evaluation in (1, 2):  # a second evaluation moves once more, not once per step
        returned, got = other(state, iter(batches))
        assert other.state_moves == evaluation
        np.testing.assert_allclose(np.asarray(got["loss"]), np.asarray(expected["loss"]),
                                   rtol=1e-6)
        assert returned is state
    # The training state stays where it was, untouched.
    assert state.params["dense1"]["kernel"] is kernel_before
    assert kernel_before.sharding.spec == P(None, "data")
    assert len(kernel_before.sharding.device_set) == 8

    # Under OuterLoop with an EvalSpec: one move per evaluation, training stays FSDP.
    moves = other.state_moves
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(train), eval_loops=[other])
    trained, _ = outer(state, iter([{k: v[:32] for k, v in data.items()}] * 4),
                       train_total_steps=4, train_loop_steps=2,
                       eval_specs=[outer_loop.EvalSpec(dataset=batches)])
    assert other.state_moves == moves + 2
    assert trained.params["dense1"]["kernel"].sharding.spec == P(None, "data")


HYBRID_JOB = Path(__file__).resolve().parent / "hybrid_job.py"
SHORT = ("--train-steps", "20", "--train-loop-steps", "10", "--batch-size", "64")


def run_hsdp(workdir: Path, *flags: str) -> dict:
    """The digits job as 2 processes x 4 devices under HSDP, with the state's layout as
    each process saw it (tests/hybrid_job.py)."""
    result_dir = workdir.parent / f"{workdir.name}-run-{time.monotonic_ns()}"
    command = [sys.executable, str(HYBRID_JOB), str(result_dir), "--workdir", str(workdir),
               "--partitioner", "hsdp", *flags]
    with mp.started([command] * 2, mp.job_envs(2), result_dir / "logs") as procs:
        try:
            codes = mp.wait_all(procs, mp.RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            codes = [p.poll() for p in procs]
        logs = mp.read_logs(result_dir / "logs", 2)
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{log.stderr[-4000:]}"
    results = [{**json.loads((result_dir / f"result-{i}.json").read_text()),
                "layout": json.loads((result_dir / f"layout-{i}.json").read_text())}
               for i in range(2)]
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
    return results[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_hsdp_matches_data_parallel_and_resumes_a_one_process_checkpoint(
        tmp_path):
    # Data parallel on 1 process x 8 devices: 10 steps (a checkpoint), then on to 20.
    dp_dir = tmp_path / "dp"
    half = mp.run_digits(dp_dir, "--partitioner", "dp", *SHORT[:1], "10", *SHORT[2:],
                         processes=1)
    assert half.step == 10
    shutil.copytree(dp_dir, tmp_path / "from-dp")
    dp = mp.run_digits(dp_dir, "--partitioner", "dp", *SHORT, processes=1)
    assert dp.step == 20 and dp.restored_step == 10

    hsdp = run_hsdp(tmp_path / "hsdp", *SHORT)
    layout = hsdp["layout"]
    assert layout["mesh"] == {"replica": 2, "fsdp": 4}
    # Each split leaf has all its shards on each process's devices: no gather crosses.
    assert layout["split_leaves"] >= 3 and layout["shards_within_each_process"]
    assert layout["max_bytes_per_device"] == pytest.approx(layout["state_bytes"] / 4, rel=0.05)
    assert hsdp["step"] == 20 and hsdp["restored_step"] is None
    assert abs(hsdp["eval_loss"] - dp.loss) < 1e-5, (hsdp, dp)

    # The 1 x 8 data parallel checkpoint of step 10 resumes under 2 x 4 HSDP.
    resumed = run_hsdp(tmp_path / "from-dp", *SHORT)
    assert resumed["restored_step"] == 10 and resumed["step"] == 20
    assert abs(resumed["eval_loss"] - dp.loss) < 1e-5, (resumed, dp)
    print(f"dp 1x8: {dp.loss}; hsdp 2x4: {hsdp['eval_loss']}; resumed from 1x8: "
          f"{resumed['eval_loss']}; bytes/device: {layout['max_bytes_per_device']} of "
          f"{layout['state_bytes']}")
