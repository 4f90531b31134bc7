"""A job run as real processes by tests/test_checkpoint_policies.py (not a test module).

``python tests/checkpoint_policy_job.py RESULT_DIR`` joins the job described by the
``JAXLOOP_*`` environment (or runs alone), trains 6 loops of 2 steps with a time-based
CheckpointAction whose clock differs by process, and writes what it saw to
``RESULT_DIR/result-<process index>.json`` (never read from the output streams: gloo writes
its own lines there).

Process 0's clock advances 100 s per loop (with ``every_secs=250`` a save is due on loops 3
and 6); every other process's clock advances 10**6 s per loop, so it alone would save on
every loop. All processes must follow process 0.
"""

from __future__ import annotations

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


class LoopClock:
    """A clock that moves `per_loop` seconds each time `tick` runs (an end action)."""

    def __init__(self, per_loop: float):
        self.now, self.per_loop = 0.0, per_loop

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.per_loop


def main() -> None:
    result_dir = Path(sys.argv[1])
    result_dir.mkdir(parents=True, exist_ok=True)
    workdir = result_dir / "work"
    clock = LoopClock(100.0 if jax.process_index() == 0 else 1e6)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.DataParallelPartitioner(mesh, "data")
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          partitioner=part, train=True)
    manager = checkpoint.make_manager(workdir / "ckpt", max_to_keep=None)
    ckpt = actions.CheckpointAction(manager, every_secs=250, clock=clock)
    saved: list[bool] = []

    class Tick(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            clock.tick()

    class Record(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            saved.append(bool(ckpt(state, outputs, **kwargs)))

    loop = train_loop.TrainLoop(step, end_actions=[Tick(), Record()])
    state = step.initialize_model([1, 16])
    dataset = iter(data.GlobalBatchDataset(toy_data(256), 32, seed=1))
    for _ in range(6):
        state, _ = loop(state, dataset, num_steps=2)
    manager.wait_until_finished()
    manager.close()
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "saved": saved,
        "checkpoints": checkpoint.all_steps(workdir / "ckpt"),
        "step": int(state.step),
    }
    job_results.write(result_dir, result)


if __name__ == "__main__":
    main()
