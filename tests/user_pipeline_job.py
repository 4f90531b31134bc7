"""A user's script whose own grain pipelines run in worker processes, for
tests/test_user_grain_pipeline.py. It never sets up absl's flags.

    python tests/user_pipeline_job.py WORKDIR TOTAL_STEPS

Trains on ``MapDataset ... .mp_prefetch(...)`` (passed as the dataset, not an iterator)
and evaluates on another such pipeline every second 10-step loop, checkpointing into
WORKDIR/checkpoints and resuming from there when run again; prints the final step and a
fingerprint of the parameters as its last line.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from models import ClassifierStep, LinenMLP, toy_data  # noqa: E402

from jaxloop import actions, eval_loop, outer_loop, train_loop  # noqa: E402
from jaxloop.checkpointing import checkpoint  # noqa: E402


def augment(example):
    """Per-record Python work (picklable: the workers are new processes)."""
    return {"x": (example["x"] * 0.5 + np.tanh(example["x"])).astype(np.float32),
            "y": example["y"]}


def pipeline(n: int, seed: int, workers: int = 1) -> grain.IterDataset:
    """The user's pipeline; without workers it gives the same batches in this process."""
    arrays = toy_data(n, seed=seed)
    records = [{"x": arrays["x"][i], "y": arrays["y"][i]} for i in range(n)]
    ds = grain.MapDataset.source(records).shuffle(seed=seed).repeat().map(augment).batch(16)
    ds = ds.to_iter_dataset()
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers else ds


def main() -> None:
    workdir, total = Path(sys.argv[1]), int(sys.argv[2])
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          train=True)
    manager = checkpoint.make_manager(workdir / "checkpoints")
    outer = outer_loop.OuterLoop(
        train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)]),
        eval_loops=[eval_loop.EvalLoop(ClassifierStep(jax.random.key(0), LinenMLP()))],
        checkpoint_spec=outer_loop.CheckpointSpec(workdir / "checkpoints"))
    # One evaluation in a fresh run (after its second loop), each with its own workers.
    state, _ = outer(step.initialize_model([1, 16]), pipeline(256, 1, workers=2),
                     train_total_steps=total, train_loop_steps=10, eval_specs=[
                         outer_loop.EvalSpec(pipeline(64, 2), num_steps=2, eval_loop_interval=2)])
    manager.close()
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(state.params):
        digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    print(f"final step={int(state.step)} fingerprint={digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
