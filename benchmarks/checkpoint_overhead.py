"""Asynchronous checkpointing costs training little: steps/s with a checkpoint every loop
versus none, side by side in one run (alternating, best of --repeats).

The state is an MLP 784-1024-1024-10 with Adam (about 1.9M parameters, 22 MB with the
optimizer state). orbax copies the arrays off the device inside `save`, then writes the
files on background threads while training continues. Goal: ratio >= 0.9.

    python benchmarks/checkpoint_overhead.py
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402
from common import MLP, TrainStep, batches  # noqa: E402

from jaxloop import actions, outer_loop, train_loop  # noqa: E402
from jaxloop.checkpointing import checkpoint  # noqa: E402


def steps_per_sec(train, loops, loop_steps, batch_size, with_checkpoints):
    workdir = tempfile.mkdtemp()
    manager = checkpoint.make_manager(os.path.join(workdir, "ckpt"), max_to_keep=2)
    end_actions = [actions.CheckpointAction(manager)] if with_checkpoints else []
    outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(train, end_actions=end_actions))
    state = train.initialize_model([1, 784])
    start = time.perf_counter()
    state, _ = outer(state, batches(batch_size), train_total_steps=loops * loop_steps,
                     train_loop_steps=loop_steps)  # waits for the last write to finish
    elapsed = time.perf_counter() - start
    saved = checkpoint.all_steps(os.path.join(workdir, "ckpt"))
    manager.close()
    shutil.rmtree(workdir)
    return loops * loop_steps / elapsed, saved


def main():
    parser = argparse.ArgumentParser()
    # A checkpoint every 500 steps (~5 s here). On this CPU-only machine orbax's background
    # write competes with training for the same 2 cores, so much shorter intervals cost more
    # (100-step loops: ratio ~0.72); on an accelerator the host CPU is free for it.
    parser.add_argument("--loops", type=int, default=4)
    parser.add_argument("--loop-steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    logging.getLogger("absl").setLevel(logging.WARNING)
    train = TrainStep(jax.random.key(0), MLP(), optimizer=optax.adam(1e-3), train=True)
    steps_per_sec(train, 1, 5, args.batch_size, True)  # compile, warm up orbax
    without, with_ckpt = [], []
    for _ in range(args.repeats):
        without.append(steps_per_sec(train, args.loops, args.loop_steps, args.batch_size,
                                     False)[0])
        rate, saved = steps_per_sec(train, args.loops, args.loop_steps, args.batch_size, True)
        with_ckpt.append(rate)
    assert saved[-1] == args.loops * args.loop_steps
    print(f"devices={jax.device_count()} loops={args.loops} x {args.loop_steps} steps, "
          f"batch={args.batch_size}, state={train.num_params} params + Adam")
    print(f"{'no checkpoints':>26}: {max(without):8.1f} steps/s")
    print(f"{'checkpoint every loop':>26}: {max(with_ckpt):8.1f} steps/s")
    print(f"ratio with / without = {max(with_ckpt) / max(without):.3f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
