"""A training job whose input runs in 2 grain worker processes, for tests/test_grain_workers.py.

    python tests/workers_job.py WORKDIR RESULTS_JSON

Trains 120 steps on `GlobalBatchDataset(..., num_workers=2)` with a per-record Python
transform, checkpointing every 10-step loop into WORKDIR/checkpoints, and resumes from
there when run again; writes the final step and a fingerprint of the parameters.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from models import ClassifierStep, LinenMLP, toy_data  # noqa: E402

from jaxloop import actions, data, outer_loop, train_loop  # noqa: E402
from jaxloop.checkpointing import checkpoint  # noqa: E402


def augment(example):
    x = example["x"]
    return {"x": (x[::-1] * 0.5 + np.tanh(x)).astype(np.float32), "y": example["y"]}


def main() -> None:
    workdir, results = Path(sys.argv[1]), Path(sys.argv[2])
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          train=True)
    manager = checkpoint.make_manager(workdir / "checkpoints")
    loop = train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)])
    outer = outer_loop.OuterLoop(
        loop, checkpoint_spec=outer_loop.CheckpointSpec(workdir / "checkpoints"))
    ds = data.GlobalBatchDataset(data.ArraySource(toy_data(512)), 16, seed=1,
                                 transform=augment, num_workers=2)
    it = iter(ds)
    state, _ = outer(step.initialize_model([1, 16]), it, train_total_steps=120,
                     train_loop_steps=10)
    manager.close()
    it.close()
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(state.params):
        digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    results.write_text(json.dumps({"step": int(state.step), "fingerprint": digest.hexdigest()}))


if __name__ == "__main__":
    main()
