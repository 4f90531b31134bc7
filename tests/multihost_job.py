"""A small job run as real processes by tests/test_multihost.py (not a test module itself).

``python tests/multihost_job.py SCENARIO RESULT_DIR`` joins the job described by the
``JAXLOOP_*`` environment (or runs alone), runs SCENARIO and writes what it saw to
``RESULT_DIR/result-<process index>.json``: the tests read these files, never the
processes' output streams (gloo writes its own lines there).

Scenarios:
  actions: a step with a histogram of its logits beside its scalars, with SummaryAction
    at every step and every loop, CheckpointAction, and an eval loop (whose step also
    returns the bare per-example logits) with SummaryAction and BestCheckpointAction,
    under OuterLoop.
  cross_mesh: data=4 x model=2 with 'model' laid across the processes; GlobalBatchDataset
    reads rows by the partitioner's layout; trains and reports losses and the rows read.
  fused: steps_per_execution=4 and k=1 train the same steps from the same state;
    reports the size chosen, the tuner's timings and both runs' parameters.
  digits ARGS...: the digits example with these flags; SIGUSR1 calls `preemption.request()`.
    Reports the final results, or the exit code and the step it stopped at if preempted.
  trainer CKPT_DIR: trains 40 steps, one per loop, checkpointing each loop into CKPT_DIR
    with max_to_keep=1 (each save deletes the one before), then writes the STOPPED marker.
  continuous_eval CKPT_DIR: evaluates the checkpoints in CKPT_DIR as they come (OuterLoop
    with a CheckpointSpec and no train loop) until the trainer's marker; reports the steps
    it evaluated, their losses, and how many checkpoints it skipped as deleted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
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
from jax.experimental import multihost_utils  # noqa: E402
from models import ClassifierStep, LinenMLP, toy_data  # noqa: E402

from jaxloop import actions, data, eval_loop, outer_loop, partition, train_loop, types  # noqa: E402
from jaxloop.checkpointing import checkpoint  # noqa: E402
from jaxloop.launch import preemption  # noqa: E402
from jaxloop.metrics import writers  # noqa: E402


class NullWriter:
    """What non-main processes write to: nothing (every process runs the actions)."""

    def write_scalars(self, step, scalars):
        pass

    write_images = write_histograms = write_texts = write_videos = write_scalars

    def write_audios(self, step, audios, sample_rate):
        pass

    def flush(self):
        pass

    def close(self):
        pass


class HistogramStep(ClassifierStep):
    # A step-level SummaryAction hands bare values to the writer as the reference does, so
    # the train step gives its per-example logits only as a histogram; the eval step keeps
    # them bare too, and its loop-level summary skips their per-step list.
    keep_logits = False

    def run(self, state, batch):
        state, outputs = super().run(state, batch)
        hist = types.MetricWithMetadata(outputs["logits"], types.MetricType.HISTOGRAM)
        if not self.keep_logits:
            del outputs["logits"]
        return state, {**outputs, "logit_hist": hist}


class EvalHistogramStep(HistogramStep):
    keep_logits = True


def fingerprint(tree) -> str:
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        if not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    return digest.hexdigest()


def writer_for(workdir: Path, name: str):
    if jax.process_index() == 0:
        return writers.SummaryWriter(str(workdir / name))
    return NullWriter()


def actions_job(workdir: Path) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.DataParallelPartitioner(mesh, "data")
    train_writer, eval_writer = writer_for(workdir, "train"), writer_for(workdir, "eval")
    step = HistogramStep(
        jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), partitioner=part,
        train=True, end_actions=[actions.SummaryAction(train_writer)],  # every step
    )
    evaluate = EvalHistogramStep(jax.random.key(0), LinenMLP(), partitioner=part)
    manager = checkpoint.make_manager(workdir / "ckpt", max_to_keep=2)
    best = checkpoint.make_best_manager(workdir / "best", "accuracy", mode="max", k=1)
    trainer = train_loop.TrainLoop(step, end_actions=[
        actions.SummaryAction(train_writer), actions.CheckpointAction(manager)])
    evaluator = eval_loop.EvalLoop(evaluate, end_actions=[
        actions.SummaryAction(eval_writer), actions.BestCheckpointAction(best)])
    seen: dict = {}

    class Keep(actions.Action):
        def __call__(self, state, outputs, loop=None, **kwargs):
            seen[int(state.step)] = {k: v for k, v in actions.scalar_metrics(
                outputs, loop=loop).items()
                                     if not k.startswith("jaxloop/")}  # not timings

    evaluator.end_actions.append(Keep())
    outer = outer_loop.OuterLoop(trainer, [evaluator], outer_loop.CheckpointSpec(
        workdir / "ckpt"))
    train_ds = data.GlobalBatchDataset(toy_data(256), 32, seed=1)
    eval_ds = data.pad_to_global_batches(toy_data(72, seed=3), 32)  # last batch: 8 real
    state, outputs = outer(
        step.initialize_model([1, 16]), iter(train_ds), train_total_steps=12,
        train_loop_steps=4, eval_specs=[outer_loop.EvalSpec(dataset=eval_ds)],
    )
    manager.close()
    best.close()
    for w in (train_writer, eval_writer):
        w.close()
    return {
        "step": int(state.step),
        "eval": {str(k): v for k, v in seen.items()},
        "train_loss": actions.scalar_metrics(outputs)["loss"],
        "checkpoints": checkpoint.all_steps(workdir / "ckpt"),
        "best": checkpoint.all_steps(workdir / "best"),
        "fingerprint": fingerprint(state.params),
    }


def cross_mesh_job(workdir: Path) -> dict:
    # Device i of process 0 and device i of process 1 form one 'model' pair: both
    # processes hold every data coordinate. With one process the same layout, same rows.
    devices = np.array(jax.devices()).reshape(2, 4).T
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    part = partition.DataParallelPartitioner(mesh, "data")
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          partitioner=part, train=True)
    ds = data.GlobalBatchDataset(toy_data(256), 32, seed=1, partitioner=part)
    first = next(iter(ds))
    trainer = train_loop.TrainLoop(step)
    state, outputs = trainer(step.initialize_model([1, 16]), iter(ds), num_steps=20)
    sharded = part.shard_batch(first)
    return {
        "rows": list(ds.rows),
        "first_batch": hashlib.sha256(np.ascontiguousarray(first["x"]).tobytes()).hexdigest(),
        "global_batch_shape": list(sharded["x"].shape),
        "losses": [float(x) for x in np.asarray(jax.device_get(outputs["loss"]))],
        "step": int(state.step),
    }


def fused_job(workdir: Path) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.DataParallelPartitioner(mesh, "data")
    fired: list[int] = []

    class Every3(actions.Action):
        """A step action every 3 steps: fused executions are cut around it."""

        def __call__(self, state, outputs, per_loop_step_number=None, **kwargs):
            fired.append(per_loop_step_number)

    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          partitioner=part, train=True, end_actions=[Every3(3)])
    result: dict = {}
    for spe in (1, 4):
        fired.clear()
        trainer = train_loop.TrainLoop(step, steps_per_execution=spe)
        batches = iter(data.GlobalBatchDataset(toy_data(256), 32, seed=1))  # endless
        state = step.initialize_model([1, 16])
        losses = []
        for num_steps in (20, 7, 1):
            state, outputs = trainer(state, batches, num_steps=num_steps)
            losses += [float(x) for x in np.asarray(jax.device_get(outputs["loss"]))]
        result[str(spe)] = {"fingerprint": fingerprint(state.params), "losses": losses,
                            "step": int(state.step), "fired": list(fired)}
    return result


CONTINUOUS_EVAL_STEPS = 40


def trainer_job(ckpt_dir: Path) -> dict:
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    manager = checkpoint.make_manager(ckpt_dir, max_to_keep=1)
    outer = outer_loop.OuterLoop(
        train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)]),
        checkpoint_spec=outer_loop.CheckpointSpec(ckpt_dir))
    state, _ = outer(step.initialize_model([1, 16]),
                     iter(data.GlobalBatchDataset(toy_data(256), 32, seed=1)),
                     train_total_steps=CONTINUOUS_EVAL_STEPS, train_loop_steps=1)
    manager.close()
    return {"step": int(state.step), "checkpoints": checkpoint.all_steps(ckpt_dir)}


class _Skips(logging.Handler):
    """Counts continuous eval's "deleted before it could be evaluated" warnings (from the
    records, not from any output stream)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += "deleted before it could be evaluated" in record.getMessage()


def continuous_eval_job(ckpt_dir: Path) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP(),
                              partitioner=partition.DataParallelPartitioner(mesh, "data"))
    seen: list[tuple[int, float]] = []

    class Keep(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            seen.append((int(state.step), actions.scalar_metrics(outputs)["loss"]))

    skips = _Skips()
    logging.getLogger("jaxloop.outer_loop").addHandler(skips)
    evaluator = outer_loop.OuterLoop(
        eval_loops=[eval_loop.EvalLoop(evaluate, end_actions=[Keep()])],
        checkpoint_spec=outer_loop.CheckpointSpec(ckpt_dir, iterate_interval_secs=0.05))
    evaluator(evaluate.initialize_model([1, 16]), eval_specs=[outer_loop.EvalSpec(
        dataset=data.pad_to_global_batches(toy_data(48, seed=3), 16))])
    return {"steps": [s for s, _ in seen], "losses": [loss for _, loss in seen],
            "skipped": skips.count}


class _Steps(logging.Handler):
    """Catches the step of digits' "Preempted at step N" record and of jaxloop's "Resumed from
    step N" record (from the records' arguments, not from any output stream)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.preempted = self.restored = None

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Preempted at step"):
            self.preempted = int(record.args[0])
        elif message.startswith("Resumed from step"):
            self.restored = int(record.args[0])


def digits_job(argv: list[str]) -> dict:
    from jaxloop.examples import digits  # noqa: PLC0415

    signal.signal(signal.SIGUSR1, lambda *_: preemption.request())
    steps = _Steps()
    logging.getLogger("digits").addHandler(steps)
    logging.getLogger("jaxloop.checkpointing.checkpoint").addHandler(steps)
    logging.getLogger("jaxloop.checkpointing.checkpoint").setLevel(logging.INFO)
    try:
        results = digits.main(argv)
    except SystemExit as e:
        return {"exit": e.code, "preempted_step": steps.preempted,
                "restored_step": steps.restored}
    return {"exit": 0, "restored_step": steps.restored, **results}


def main() -> None:
    scenario, result_dir = sys.argv[1], Path(sys.argv[2])
    result_dir.mkdir(parents=True, exist_ok=True)
    workdir = result_dir / "work"
    if scenario == "digits":
        result = digits_job(sys.argv[3:])
    elif scenario in ("trainer", "continuous_eval"):
        job = trainer_job if scenario == "trainer" else continuous_eval_job
        result = job(Path(sys.argv[3]))
    else:
        jobs = {"actions": actions_job, "fused": fused_job, "cross_mesh": cross_mesh_job}
        result = jobs[scenario](workdir)
    result["process_index"] = jax.process_index()
    result["process_count"] = jax.process_count()
    job_results.write(result_dir, result)
    if result.get("exit"):
        sys.exit(result["exit"])


if __name__ == "__main__":
    main()
