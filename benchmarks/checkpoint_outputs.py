"""A checkpoint does not copy a loop's per-example outputs to the host.

Times `CheckpointAction` (save and wait for the write) at the end of a 100-step loop whose
outputs hold the per-step losses and, in the second case, also the per-step logits
([256, 1000] float32 each: 100 MB over the loop). The action passes the scalar outputs to
orbax as metrics; it picks them from the outputs' shapes, so the logits are never fetched
and the two times match (ratio near 1). Alternating, median of --repeats.

    python benchmarks/checkpoint_outputs.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from common import MLP, TrainStep  # noqa: E402

from jaxloop import actions  # noqa: E402
from jaxloop.checkpointing import checkpoint  # noqa: E402


def loop_outputs(steps: int, with_logits: bool, batch: int, classes: int) -> dict:
    keys = jax.random.split(jax.random.key(0), steps)
    outputs = {"loss": [jnp.float32(i) for i in range(steps)]}
    if with_logits:
        outputs["logits"] = [jax.random.normal(k, (batch, classes)) for k in keys]
    jax.block_until_ready(outputs)
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="steps in the loop's outputs")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    train = TrainStep(jax.random.key(0), MLP(), optimizer=optax.adam(1e-3), train=True)
    state = train.initialize_model([1, 784])
    cases = {
        "scalars only": loop_outputs(args.steps, False, args.batch, args.classes),
        "with logits": loop_outputs(args.steps, True, args.batch, args.classes),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as workdir:
        manager = checkpoint.make_manager(os.path.join(workdir, "ckpt"), max_to_keep=1)
        action = actions.CheckpointAction(manager)
        step = 0
        for _ in range(args.repeats):
            for name, outputs in cases.items():
                step += 1
                state = state.replace(step=jnp.int32(step))
                start = time.perf_counter()
                action(state, outputs)
                manager.wait_until_finished()
                times[name].append(time.perf_counter() - start)
        manager.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in medians.items():
        print(f"{name:>13}: {seconds * 1000:8.1f} ms per checkpoint (median of {args.repeats})")
    ratio = medians["with logits"] / medians["scalars only"]
    print(f"with logits / scalars only: {ratio:.2f}x "
          f"({args.steps} steps of [{args.batch}, {args.classes}] logits in the outputs)")


if __name__ == "__main__":
    main()
