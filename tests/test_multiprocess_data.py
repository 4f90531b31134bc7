"""Each process's data position (issue 13.3): per-process pipelines resume exactly.

Two real processes x 4 CPU devices; each reads its own shard through a grain DataLoader
sharded with ``ShardByJaxProcess``. A run interrupted at step 8 and resumed must end
bit-identical to an uninterrupted one, and each process must resume from its OWN position.
Restoring those per-process positions under another process count is a clear error.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_multiprocess import job_envs, read_logs, started, wait_all

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

RUN_TIMEOUT = 300

WORKER = textwrap.dedent(
    """
    import json, hashlib, os, sys
    from jaxloop.launch import distributed
    if os.environ.get("JAXLOOP_COORDINATOR"):
        distributed.initialize()
    import grain, jax, numpy as np, optax
    sys.path.insert(0, "tests")
    from models import ClassifierStep, LinenMLP, toy_data
    from jaxloop import actions, data, outer_loop, partition, train_loop
    from jaxloop.checkpointing import checkpoint

    workdir, total = sys.argv[1], int(sys.argv[2])
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.DataParallelPartitioner(mesh, "data")
    examples = toy_data(512, seed=1)
    source = [{k: v[i] for k, v in examples.items()} for i in range(512)]
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(
            num_records=512, shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
            shuffle=True, seed=3, num_epochs=None),
        operations=[grain.transforms.Batch(16 // jax.process_count(), drop_remainder=True)],
        worker_count=0,
    )
    iterator = iter(loader)
    class ScalarStep(ClassifierStep):  # scalars only: this test is about data positions
        def run(self, state, batch):
            state, outputs = super().run(state, batch)
            return state, {"loss": outputs["loss"]}

    step = ScalarStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                      partitioner=part, train=True)
    manager = checkpoint.make_manager(os.path.join(workdir, "ckpt"), max_to_keep=2)
    outer = outer_loop.OuterLoop(
        train_loop=train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)]),
        checkpoint_spec=outer_loop.CheckpointSpec(os.path.join(workdir, "ckpt")))
    state, _ = outer(step.initialize_model([1, 16]), iterator, train_total_steps=total,
                     train_loop_steps=4)
    manager.close()
    position = data.iterator_state(iterator)
    with open(os.path.join(workdir, f"position_p{jax.process_index()}.json"), "w") as f:
        json.dump(position, f)
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get((state.params, state.opt_state))):
        digest.update(np.asarray(leaf).tobytes())
    if jax.process_index() == 0:
        print(f"final step={int(state.step)} fingerprint={digest.hexdigest()}", flush=True)
    """
)
FINAL = re.compile(r"^final step=(\d+) fingerprint=([0-9a-f]{64})$", re.M)


def run(workdir: Path, total: int, processes: int = 2) -> tuple[list[int], list]:
    workdir.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-c", WORKER, str(workdir), str(total)]
    envs = job_envs(processes)
    logdir = workdir.parent / f"{workdir.name}-logs-{time.monotonic_ns()}"
    with started([base] * processes, envs, logdir) as procs:
        try:
            codes = wait_all(procs, RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            codes = [p.poll() for p in procs]
        logs = read_logs(logdir, processes)
    return codes, logs


def finished(workdir: Path, total: int) -> tuple[str, list]:
    codes, logs = run(workdir, total)
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{log.stderr[-4000:]}"
    match = FINAL.search(logs[0].stdout)
    assert match and int(match.group(1)) == total, logs[0].stdout[-2000:]
    positions = [json.loads((workdir / f"position_p{i}.json").read_text()) for i in range(2)]
    return match.group(2), positions


def test_each_process_resumes_from_its_own_data_position(tmp_path):
    uninterrupted, positions = finished(tmp_path / "a", 16)
    # The two processes read different shards, so their positions differ.
    assert positions[0] != positions[1]
    assert "shard_index=0" in positions[0]["sampler"]
    assert "shard_index=1" in positions[1]["sampler"]

    finished(tmp_path / "b", 8)
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    resumed, resumed_positions = finished(tmp_path / "b", 16)
    assert resumed == uninterrupted  # bit-identical parameters and optimizer state
    assert resumed_positions == positions

    # The same per-process positions cannot be restored by one process (8 devices).
    codes, logs = run(tmp_path / "c", 16, processes=1)
    assert codes[0] != 0
    assert "data positions of 2 process(es), but this job has 1" in logs[0].stderr
