"""diagnostics.memory.estimate: per-device bytes from XLA's memory analysis, before any run."""

import re
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, NnxMLP

from jaxloop import partition
from jaxloop.diagnostics import memory
from jaxloop.examples import transformer

SPEC = {"x": [64, 1024], "y": ([64], "int32")}


class Big(nn.Module):
    """2.1M parameters: big enough that the state dominates every other buffer."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(1024)(x.reshape((x.shape[0], -1))))
        x = nn.relu(nn.Dense(1024)(x))
        return nn.Dense(10)(x)


def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _kernel_sized_arrays():
    return {id(x) for x in jax.live_arrays() if x.shape == (1024, 1024)}


def _step(partitioner):
    return ClassifierStep(jax.random.key(0), Big(), optimizer=optax.adam(1e-3),
                          partitioner=partitioner, train=True)


def test_fsdp_needs_an_eighth_of_the_data_parallel_arguments():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    estimates, state_bytes = {}, None
    before = _kernel_sized_arrays()
    for name, partitioner in (("dp", partition.DataParallelPartitioner(mesh)),
                              ("fsdp", partition.FSDPPartitioner(mesh))):
        step = _step(partitioner)
        state = step.abstract_state([1, 1024])
        state_bytes = _nbytes(state)
        estimates[name] = memory.estimate(step, SPEC, state)
        # Compiled, never run: no array of the model's size was created.
        assert _kernel_sized_arrays() <= before
    dp, fsdp = estimates["dp"], estimates["fsdp"]
    assert dp.num_devices == fsdp.num_devices == 8
    # Data parallel: every device holds the whole state and its eighth of the batch.
    batch_shard_bytes = 8 * 1024 * 4 + 8 * 4  # x float32, y int32: 8 examples
    assert dp.argument_bytes == state_bytes + batch_shard_bytes
    # The training step donates its state: the new state reuses the old one's buffers.
    assert dp.alias_bytes == state_bytes
    assert dp.total_bytes == (dp.argument_bytes + dp.output_bytes - dp.alias_bytes
                              + dp.temp_bytes)
    # FSDP splits every large leaf 8 ways.
    assert 0.12 < fsdp.argument_bytes / dp.argument_bytes < 0.14
    assert fsdp.total_bytes < dp.total_bytes


def test_default_state_str_and_nnx():
    step = ClassifierStep(jax.random.key(0), NnxMLP, optimizer=optax.sgd(0.1), train=True,
                          nnx_model_args=(16, 32, 10))
    # No state given: the step's model initialised from the batch spec itself.
    estimate = memory.estimate(step, {"x": [32, 16], "y": ([32], "int32")})
    params_bytes = (16 * 32 + 32 + 32 * 10 + 10) * 4
    assert estimate.argument_bytes >= params_bytes + 32 * 16 * 4
    assert estimate.num_devices == 1 and estimate.temp_bytes > 0
    text = str(estimate)
    assert text.startswith("Memory per device (1 cpu device, XLA estimate):")
    for row in ("arguments", "outputs", "temporaries", "total"):
        assert f"  {row}" in text
    assert memory.format_bytes(estimate.total_bytes) in text
    assert estimate.fits is None  # the CPU backend reports no memory limit
    assert step.num_params is None  # an estimate leaves the step's bookkeeping alone
    # The step then trains as usual.
    state = step.initialize_model([1, 16])
    batch = {"x": np.ones((32, 16), np.float32), "y": np.zeros(32, np.int32)}
    state, outputs = step(state, batch)
    assert int(state.step) == 1 and np.isfinite(float(outputs["loss"]))


def test_limits_and_formatting():
    small = memory.MemoryEstimate(argument_bytes=3 * 2**30, output_bytes=2**30,
                                  alias_bytes=2**30, temp_bytes=2**29, bytes_limit=2**32)
    assert small.total_bytes == 3.5 * 2**30 and small.fits
    assert re.search(r"device memory +4\.00 GiB \(fits\)", str(small))
    big = memory.MemoryEstimate(argument_bytes=5 * 2**30, output_bytes=0, alias_bytes=0,
                                temp_bytes=0, bytes_limit=2**32)
    assert big.fits is False and "DOES NOT FIT" in str(big)
    assert memory.format_bytes(512) == "512 B"
    assert memory.format_bytes(3 * 2**20) == "3.00 MiB"


def test_a_batch_that_does_not_split_is_a_clear_error():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    step = _step(partition.DataParallelPartitioner(mesh))
    with pytest.raises(ValueError, match=r"Batch leaf \['x'\] has shape \(12, 1024\): its "
                                         r"leading dimension 12 .* does not divide by the 8"):
        memory.estimate(step, {"x": [12, 1024], "y": ([12], "int32")},
                        step.abstract_state([1, 1024]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_dry_run_prints_the_estimate_and_trains_nothing(tmp_path):
    workdir = tmp_path / "digits"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxloop.examples.digits", "--workdir", str(workdir),
         "--dry-run", "--partitioner", "fsdp"],
        capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    match = re.fullmatch(r"dry-run train_total_bytes=(\d+) eval_total_bytes=(\d+)", lines[-1])
    assert match, lines[-1]
    assert int(match.group(1)) > int(match.group(2)) > 0  # training also holds gradients
    assert "train step, global batch 64: Memory per device (8 cpu devices" in proc.stdout
    assert proc.stdout.count("  temporaries") == 2
    assert not workdir.exists()  # no checkpoint, no event file: nothing ran


@pytest.mark.slow
def test_transformer_dry_run_under_dp_and_fsdp(tmp_path, capsys):
    results = {}
    for kind in ("dp", "fsdp"):
        results[kind] = transformer.main(
            ["--dry-run", "--partitioner", kind, "--num-layers", "1",
             "--workdir", str(tmp_path / kind)])
        assert results[kind]["dry_run"] and not (tmp_path / kind).exists()
    dp, fsdp = results["dp"]["train"], results["fsdp"]["train"]
    # Every kernel and embedding is split 8 ways under FSDP; norms and biases are not.
    assert fsdp.argument_bytes < dp.argument_bytes / 4
    params = results["dp"]["num_params"]
    assert dp.argument_bytes > 3 * 4 * params  # params + two Adam moments, float32
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("dry-run train_total_bytes=")
    assert "final step" not in out
