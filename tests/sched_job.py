"""A small job run as real processes by tests/test_triggers.py and tests/test_integrity.py
(not a test module itself).

``python tests/sched_job.py SCENARIO RESULT_DIR`` joins the job described by the
``JAXLOOP_*`` environment, runs SCENARIO and writes what it saw to
``RESULT_DIR/result-<process index>.json``.

Scenarios:
  every_secs: a train loop with a loop-level and a step-level action, each under a
    ``Trigger(every_secs=3)`` whose clock counts calls, 3x faster on process 1 than on
    process 0; reports the steps each fired at and the host exchanges of each loop.
  parted: a train loop whose action, before CheckpointAction, runs a collective on process 1
    only at step 4 (the sum of a data-sharded array: process 1 waits in it for process 0,
    which never joins); writes RESULT_DIR/parting when it parts, and the error process 0
    raises to its result file before exiting 3.
  integrity: `integrity.check_replicas` on a healthy data x model state laid across the
    processes, then on one whose replicated leaf differs on one device of process 1;
    reports both outcomes.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from jaxloop.launch import distributed  # noqa: E402

if os.environ.get("JAXLOOP_COORDINATOR"):
    distributed.initialize()

import jax  # noqa: E402
import job_results  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from models import ClassifierStep, LinenMLP, toy_data  # noqa: E402

from jaxloop import actions, data, partition, train_loop  # noqa: E402
from jaxloop.checkpointing import checkpoint  # noqa: E402
from jaxloop.diagnostics import integrity  # noqa: E402
from jaxloop.hooks import triggers  # noqa: E402
from jaxloop.launch import agreement  # noqa: E402


def counting_clock(rate: float):
    ticks = itertools.count()
    return lambda: rate * next(ticks)


class Recorder(actions.Action):
    def __init__(self, trigger):
        super().__init__(trigger=trigger)
        self.steps: list[int] = []

    def __call__(self, state, outputs, **kwargs):
        self.steps.append(int(state.step))


def every_secs_job() -> dict:
    rate = 1.0 + 2.0 * jax.process_index()  # each process's clock differs
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.DataParallelPartitioner(mesh, "data")
    per_step = Recorder(triggers.Trigger(every_secs=3, clock=counting_clock(rate)))
    per_loop = Recorder(triggers.Trigger(every_secs=3, clock=counting_clock(rate)))
    step = ClassifierStep(jax.random.key(0), LinenMLP(hidden=8), optax.sgd(0.1),
                          partitioner=part, train=True, end_actions=[per_step])
    exchanges: list[int] = []

    class CountExchanges(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            exchanges.append(agreement.exchange_count())

    loop = train_loop.TrainLoop(step, end_actions=[per_loop, CountExchanges()])
    batches = iter(data.GlobalBatchDataset(toy_data(64), 16, seed=1))
    state = step.initialize_model([1, 16])
    for _ in range(6):
        state, _ = loop(state, batches, num_steps=4)
    return {"step": per_step.steps, "loop": per_loop.steps, "exchanges": exchanges}


def parted_job(result_dir: Path) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.DataParallelPartitioner(mesh, "data")
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    class OnProcessOneOnly(actions.Action):
        """What parts them: a collective that one process runs and the other does not."""

        def __call__(self, state, outputs, **kwargs):
            if int(state.step) == 4 and jax.process_index() == 1:
                (result_dir / "parting").write_text("4")
                local = np.ones(4, np.float32)
                float(jax.numpy.sum(jax.make_array_from_process_local_data(rows, local)))

    step = ClassifierStep(jax.random.key(0), LinenMLP(hidden=8), optax.sgd(0.1),
                          partitioner=part, train=True)
    manager = checkpoint.make_manager(result_dir / "ckpt")
    loop = train_loop.TrainLoop(step, end_actions=[OnProcessOneOnly(),
                                                   actions.CheckpointAction(manager)])
    batches = iter(data.GlobalBatchDataset(toy_data(64), 16, seed=1))
    state = step.initialize_model([1, 16])
    try:
        for _ in range(4):
            state, _ = loop(state, batches, num_steps=2)
    except agreement.DisagreementError as e:
        return {"error": str(e), "exit": 3}
    return {"error": None, "exit": 0}


def integrity_job() -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = jax.sharding.NamedSharding
    P = jax.sharding.PartitionSpec
    value = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    tree = {"w": jax.make_array_from_callback(value.shape, sharding(mesh, P(None, "model")),
                                              lambda idx: value[idx]),
            "b": jax.make_array_from_callback((8,), sharding(mesh, P()), lambda idx: value[0])}
    result = {"healthy": integrity.check_replicas(tree, atol=0.0)}
    # Process 1's last device holds a copy of `b` that differs by 0.5 in one entry.
    target = jax.devices()[-1]
    shards = []
    for d in tree["b"].sharding.addressable_devices:
        copy = value[0].copy()
        if d == target:
            copy[3] += 0.5
        shards.append(jax.device_put(copy, d))
    tree["b"] = jax.make_array_from_single_device_arrays((8,), tree["b"].sharding, shards)
    try:
        integrity.check_replicas(tree, atol=1e-3)
        result["perturbed"] = None
    except integrity.ReplicaMismatchError as e:
        result["perturbed"] = str(e)
    return result


def main() -> None:
    scenario, result_dir = sys.argv[1], Path(sys.argv[2])
    result_dir.mkdir(parents=True, exist_ok=True)
    if scenario == "parted":
        result = parted_job(result_dir)
    else:
        result = {"every_secs": every_secs_job, "integrity": integrity_job}[scenario]()
    job_results.write(result_dir, result)
    if result.get("exit"):
        sys.exit(result["exit"])


if __name__ == "__main__":
    main()
