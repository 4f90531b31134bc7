"""A small training job run as a real process by tests/test_history.py (not a test module).

``python tests/history_job.py RESULT_DIR WORKDIR TOTAL_STEPS [HANG_AT]`` trains a tiny model
under OuterLoop in loops of 10 steps, a checkpoint and an evaluation after each, resuming
from WORKDIR/checkpoints; it writes ``outer.history.as_dict()`` to RESULT_DIR/result-0.json.
With HANG_AT it stops at that step's loop end, once its checkpoint is complete, writes
RESULT_DIR/ready and waits to be killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import job_results  # noqa: E402
import optax  # noqa: E402
from models import ClassifierStep, LinenMLP, toy_data  # noqa: E402

from jaxloop import actions, data, eval_loop, outer_loop, train_loop  # noqa: E402
from jaxloop.checkpointing import checkpoint  # noqa: E402


def main() -> None:
    result_dir, workdir, total = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    hang_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    result_dir.mkdir(parents=True, exist_ok=True)
    manager = checkpoint.make_manager(workdir / "checkpoints", max_to_keep=None)

    class HangAt(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            if int(state.step) == hang_at:
                manager.wait_until_finished()
                (result_dir / "ready").write_text(str(hang_at))
                time.sleep(600)

    step = ClassifierStep(jax.random.key(0), LinenMLP(hidden=8), optimizer=optax.adam(1e-2),
                          train=True)
    outer = outer_loop.OuterLoop(
        train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager), HangAt()]),
        [eval_loop.EvalLoop(ClassifierStep(jax.random.key(0), LinenMLP(hidden=8)))],
        checkpoint_spec=outer_loop.CheckpointSpec(workdir / "checkpoints"), progress=False)
    held_out = toy_data(32, seed=3)
    state, _ = outer(
        step.abstract_state([1, 16]), iter(data.GlobalBatchDataset(toy_data(128), 16, seed=1)),
        train_total_steps=total, train_loop_steps=10,
        eval_specs=[outer_loop.EvalSpec([{k: v[i:i + 16] for k, v in held_out.items()}
                                          for i in (0, 16)])])
    manager.close()
    job_results.write(result_dir, {"step": int(state.step), "history": outer.history.as_dict()})


if __name__ == "__main__":
    main()
