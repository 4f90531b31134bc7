"""The main job: a small CNN on scikit-learn's bundled 8x8 digits (real data, no network).

Trains on 80% of the 1797 images and evaluates on the held-out 20% after every train loop,
with exact-epoch eval (padded batches and a mask, so each test image counts once). Writes
TensorBoard events and orbax checkpoints under ``--workdir``; running the same command again
resumes from the last checkpoint. The last line printed is::

    final step=<int> eval_accuracy=<float> eval_loss=<float> fingerprint=<sha256 of params>

Example::

    python -m jaxloop.examples.digits --workdir /tmp/digits --partitioner fsdp
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from clu import metrics as clu_metrics
from jax.experimental import multihost_utils

from jaxloop import actions, data, eval_loop, outer_loop, partition, train_loop
from jaxloop import step as step_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.diagnostics import run_record
from jaxloop.examples import dry_run
from jaxloop.launch import agreement, meshes, preemption
from jaxloop.launch import config as config_lib
from jaxloop.metrics import writers
from jaxloop.recipes import accumulate, ema, guard, telemetry

log = logging.getLogger("digits")

NUM_CLASSES = 10
TEST_FRACTION = 0.2
SPLIT_SEED = 0  # fixed, so accuracies are comparable across --seed values


class CNN(nn.Module):
    """Two 3x3 convolutions and two dense layers, sized for 8x8 inputs."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(NUM_CLASSES)(x)


class DigitsStep(step_lib.Step):
    """Cross-entropy training; evaluation returns masked clu metrics (exact over the split).

    Training options (all off by default): `microbatches` (gradient accumulation),
    `ema_decay` (EMA of the parameters), `nonfinite_guard` and `telemetry` outputs.
    """

    def __init__(self, *args: Any, microbatches: int = 1, ema_decay: float | None = None,
                 nonfinite_guard: guard.NonFiniteGuard | None = None,
                 telemetry: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.microbatches = microbatches
        self.ema_decay = ema_decay
        self.nonfinite_guard = nonfinite_guard
        self.telemetry = telemetry

    def run(self, state: Any, batch: dict[str, jax.Array]) -> tuple[Any, dict[str, Any]]:
        images, labels = batch["image"], batch["label"]

        def loss_fn(params: Any) -> tuple[jax.Array, jax.Array]:
            logits = state.apply_fn({"params": params}, images)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return losses.mean(), (logits, losses)

        if self.train:
            def train_loss(params: Any, micro: dict[str, jax.Array]) -> tuple[Any, Any]:
                logits = state.apply_fn({"params": params}, micro["image"])
                loss = optax.softmax_cross_entropy_with_integer_labels(
                    logits, micro["label"]).mean()
                return loss, jnp.mean(jnp.argmax(logits, -1) == micro["label"])

            grad_fn = accumulate.value_and_grad(train_loss, self.microbatches, has_aux=True)
            (loss, accuracy), grads = grad_fn(state.params, batch)
            outputs = {"loss": loss, "accuracy": accuracy}
            if self.nonfinite_guard is not None:
                new_state, guard_outputs = self.nonfinite_guard.apply_gradients(
                    state, grads, loss)
                outputs.update(guard_outputs)
            else:
                new_state = state.apply_gradients(grads=grads)
            if self.telemetry:
                outputs.update(telemetry.train_metrics(state, grads, new_state))
            if self.ema_decay is not None:
                new_state = ema.update(new_state, self.ema_decay)
            return new_state, outputs
        _, (logits, losses) = loss_fn(state.params)
        mask = batch["mask"]
        return state, {
            "loss": clu_metrics.Average.from_model_output(losses, mask=mask),
            "accuracy": clu_metrics.Accuracy.from_model_output(
                logits=logits, labels=labels, mask=mask
            ),
        }


def load_digits() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The digits as (train, test) dicts of image [N, 8, 8, 1] in [0, 1] and int32 label."""
    from sklearn.datasets import load_digits as sk_load_digits  # noqa: PLC0415

    digits = sk_load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    n_test = int(len(labels) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return (
        {"image": images[train], "label": labels[train]},
        {"image": images[test], "label": labels[test]},
    )


def make_partitioner(kind: str) -> partition.Partitioner:
    """`single`, `dp` or `fsdp` over all devices, or `hsdp`: split within each process,
    replicated across processes (`meshes.make_mesh`)."""
    if kind == "single":
        return partition.SingleDevicePartitioner()
    if kind == "hsdp":
        mesh = meshes.make_mesh({"replica": -1, "fsdp": jax.local_device_count()})
        return partition.FSDPPartitioner(mesh, ("replica", "fsdp"), min_weight_size=2**8,
                                         fsdp_axis="fsdp")
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    if kind == "dp":
        return partition.DataParallelPartitioner(mesh, "data")
    if kind == "fsdp":
        return partition.FSDPPartitioner(mesh, "data", min_weight_size=2**10)
    raise ValueError(f"--partitioner must be single, dp, fsdp or hsdp, got {kind!r}")


def fingerprint(params: Any) -> str:
    """sha256 of the parameters' bytes in tree order (gathered from every process)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        if not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    return digest.hexdigest()


def memory_report(
    train_step: step_lib.Step, eval_step: step_lib.Step, train_data: dict[str, np.ndarray],
    batch_size: int, is_main: bool = True,
) -> dict[str, Any]:
    """The ``--dry-run`` report (`dry_run.report`) for global batches of `batch_size`
    images shaped like `train_data`'s."""
    image = (train_data["image"].shape[1:], train_data["image"].dtype)
    train_spec = {"image": ([batch_size, *image[0]], image[1]), "label": ([batch_size], "int32")}
    eval_spec = {**train_spec, "mask": ([batch_size], "bool")}
    state = train_step.abstract_state([1, *image[0]])
    return dry_run.report(train_step, eval_step, train_spec, eval_spec, state, batch_size,
                          show=is_main)


@dataclasses.dataclass
class Config(dry_run.Flags):
    """The digits run; every field is a flag (``--train-steps 200``, see
    `jaxloop.launch.config`)."""

    workdir: str = "workdir/digits"
    train_steps: int = 600
    train_loop_steps: int = 100
    batch_size: int = 64
    """global batch size"""
    partitioner: Literal["single", "dp", "fsdp", "hsdp"] = "dp"
    checkpoint_every: int = 1
    """in train loops"""
    checkpoint_every_secs: float | None = None
    """save only when this many seconds passed since the last save"""
    warm_start: str | None = None
    """start a new run from the parameters of another run's checkpoints (a directory)"""
    seed: int = 0
    learning_rate: float = 3e-3
    coordinator: str | None = None
    """HOST:PORT of process 0"""
    num_processes: int | None = None
    process_id: int | None = None
    distributed: bool = False
    """join a multi-process job (flags, JAXLOOP_* environment, or cluster auto-detection)"""
    compilation_cache: str | None = None
    """JAX persistent compilation cache directory (faster restarts)"""
    microbatches: int = 1
    """gradient accumulation: split each batch into this many"""
    ema_decay: float | None = None
    """keep an EMA of the parameters and evaluate it"""
    nonfinite: Literal["off", "skip", "raise"] = "off"
    """on a NaN/Inf loss or gradient: skip the update or stop"""
    telemetry: bool = False
    """write gradient/parameter/update norms and the learning rate"""

    def __post_init__(self) -> None:
        if self.batch_size % max(self.microbatches, 1):
            raise ValueError("--batch-size must be a multiple of --microbatches")
        for name in ("train_steps", "train_loop_steps", "batch_size", "checkpoint_every",
                     "microbatches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.checkpoint_every_secs is not None and not self.checkpoint_every_secs > 0:
            raise ValueError("--checkpoint-every-secs must be positive")


def parse_args(argv: Sequence[str] | None) -> Config:
    """The run's `Config`: its defaults overridden by the flags in `argv`."""
    return config_lib.parse(Config, argv, description=__doc__.split("\n")[0])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Trains and evaluates; returns the final results (also printed as the last line)."""
    args = parse_args(argv)
    joins_job = (
        args.distributed or args.coordinator or args.num_processes
        or args.process_id is not None or os.environ.get("JAXLOOP_COORDINATOR")
    )
    if joins_job:
        from jaxloop.launch import distributed  # noqa: PLC0415

        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    if args.compilation_cache:
        from jaxloop.launch import compilation_cache  # noqa: PLC0415

        compilation_cache.enable(args.compilation_cache)
    is_main = jax.process_index() == 0
    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,  # absl (imported by orbax) installs a root handler first
    )
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save chatter
    # Remote storage (gs://...) is shared by all hosts; only local paths are made absolute.
    workdir = args.workdir if "://" in args.workdir else os.path.abspath(args.workdir)
    train_data, test_data = load_digits()
    partitioner = make_partitioner(args.partitioner)
    train_ds = data.GlobalBatchDataset(
        data.ArraySource(train_data), args.batch_size, seed=args.seed
    )
    eval_ds = data.pad_to_global_batches(data.ArraySource(test_data), args.batch_size)

    nonfinite = None if args.nonfinite == "off" else guard.NonFiniteGuard(args.nonfinite)
    # float32 leaves the model untouched (no policy): the default run is unchanged.
    policy = None if args.precision == "float32" else args.precision
    train_step = DigitsStep(
        jax.random.key(args.seed), CNN(), optimizer=optax.adam(args.learning_rate),
        partitioner=partitioner, train=True, microbatches=args.microbatches,
        ema_decay=args.ema_decay, nonfinite_guard=nonfinite, telemetry=args.telemetry,
        dtype_policy=policy,
    )
    eval_step = DigitsStep(
        jax.random.key(args.seed), CNN(), partitioner=partitioner, dtype_policy=policy
    )
    if args.dry_run:
        return memory_report(train_step, eval_step, train_data, args.batch_size, is_main)
    manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"), max_to_keep=3)
    # Per-step train scalars go to TensorBoard only (logging each step would flood stderr);
    # eval results are also logged, one line per loop. Only process 0 writes event files.
    train_writer = (
        writers.AsyncWriter(writers.SummaryWriter(os.path.join(workdir, "train")))
        if is_main
        else writers.LoggingWriter("train")
    )
    eval_writer = writers.create_default_writer(workdir, collection="eval", asynchronous=True)
    # The config as given, and the state's parameter table (TensorBoard's text tab).
    run_record.write(workdir, config=args, mesh=partitioner, writer=train_writer,
                     state=train_step.abstract_state([1, 8, 8, 1]))
    final: dict[str, float] = {}

    class KeepEval(actions.Action):
        def __call__(self, state: Any, outputs: Any, loop: Any = None, **kwargs: Any) -> None:
            final.update(actions.scalar_metrics(outputs, loop=loop))  # means over examples

    save = actions.CheckpointAction(manager, interval=args.checkpoint_every,
                                    every_secs=args.checkpoint_every_secs)
    trainer = train_loop.TrainLoop(
        train_step,
        end_actions=[
            *([nonfinite.action()] if nonfinite is not None else []),
            actions.SummaryAction(train_writer),
            save,
        ],
        global_batch_size=args.batch_size,
    )
    evaluator = eval_loop.EvalLoop(
        eval_step, use_ema=args.ema_decay is not None,
        end_actions=[actions.SummaryAction(eval_writer), KeepEval()],
    )
    outer = outer_loop.OuterLoop(
        train_loop=trainer,
        eval_loops=[evaluator],
        checkpoint_spec=outer_loop.CheckpointSpec(os.path.join(workdir, "checkpoints")),
    )
    # Process 0's listing decides for every process (the warm start reads collectively).
    warm = args.warm_start and not agreement.agreed(
        lambda: checkpoint.all_steps(os.path.join(workdir, "checkpoints")))
    if warm or args.ema_decay is not None:
        # A warm start and the EMA copy need real parameters, so such a run builds its
        # state first.
        state = train_step.initialize_model([1, 8, 8, 1], log_num_params=True)
        if warm:
            # A new run only: a resumed one restores its own checkpoint instead.
            state = checkpoint.warm_start(state, args.warm_start, partitioner=partitioner)
        if args.ema_decay is not None:
            state = ema.init(state)
    else:
        # An abstract state (shapes, dtypes, shardings): the outer loop restores the last
        # checkpoint straight into place, or initialises the state when there is none, so a
        # resumed job never holds a fresh state beside the restored one.
        state = train_step.abstract_state([1, 8, 8, 1], log_num_params=True)
    try:
        state, _ = outer(
            state,
            train_dataset=iter(train_ds),
            train_total_steps=args.train_steps,
            train_loop_steps=args.train_loop_steps,
            eval_specs=[outer_loop.EvalSpec(dataset=eval_ds)],
        )
    except (preemption.Preempted, preemption.Interrupted) as stopped:
        manager.close()
        train_writer.close()
        eval_writer.close()
        log.warning("Preempted at step %d; run the same command to resume.", stopped.step)
        if isinstance(stopped, preemption.Interrupted):
            sys.exit(130)  # 128 + SIGINT, as a shell reports Ctrl-C, without a traceback
        raise
    if args.checkpoint_every_secs and int(state.step) not in manager.all_steps():
        # A time-based policy need not fall on the last step: keep the final state too.
        save(state, None, loop=trainer, force=True)
    if "accuracy" not in final:  # resumed at the end: nothing trained, evaluate once
        _, outputs = evaluator(state, iter(eval_ds))
        final.update(actions.scalar_metrics(outputs, loop=evaluator))
    manager.close()
    train_writer.close()
    eval_writer.close()
    results = {
        "step": int(state.step),
        "eval_accuracy": final["accuracy"],
        "eval_loss": final["loss"],
        "fingerprint": fingerprint(state.params),
    }
    if is_main:
        print(
            f"final step={results['step']} eval_accuracy={results['eval_accuracy']:.6f} "
            f"eval_loss={results['eval_loss']:.6f} fingerprint={results['fingerprint']}",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
