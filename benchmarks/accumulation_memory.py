"""Gradient accumulation lowers peak memory: XLA's memory analysis of the compiled train step
with the global batch run at once (k=1) versus as k=4 microbatches (`accumulate`).

The model is the benchmarks' MLP 784-1024-1024-10 with Adam; the figure is the compiled
step's temporary buffers (activations, gradients, XLA scratch) per device, plus its
argument and output sizes, which accumulation does not change. No step is run.

    python benchmarks/accumulation_memory.py --batch-size 4096
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import MLP  # noqa: E402

from jaxloop import step  # noqa: E402
from jaxloop.recipes import accumulate  # noqa: E402


class AccumStep(step.Step):
    def __init__(self, *args, num_microbatches: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.k = num_microbatches

    def run(self, state, batch):
        def loss_fn(params, micro):
            logits = state.apply_fn({"params": params}, micro["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, micro["y"]).mean()

        loss, grads = accumulate.value_and_grad(loss_fn, self.k)(state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss}


def memory(k: int, batch_size: int) -> dict[str, int]:
    s = AccumStep(jax.random.key(0), MLP(), optimizer=optax.adam(1e-3), train=True,
                  num_microbatches=k)
    state = s.initialize_model([1, 784])
    batch = s.partitioner.shard_batch({
        "x": np.zeros((batch_size, 784), np.float32),
        "y": np.zeros((batch_size,), np.int32),
    })
    analysis = s.compile().lower(state, batch).compile().memory_analysis()
    return {
        "temp": analysis.temp_size_in_bytes,
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    one, many = memory(1, args.batch_size), memory(args.k, args.batch_size)
    mib = 2**20
    platform = jax.devices()[0].platform
    print(f"global batch {args.batch_size}, MLP 784-1024-1024-10, Adam, {platform}")
    for name in ("temp", "arguments", "outputs"):
        print(f"  {name:9s}  k=1: {one[name] / mib:8.1f} MiB   "
              f"k={args.k}: {many[name] / mib:8.1f} MiB")
    peak1 = one["temp"] + one["arguments"] + one["outputs"]
    peakk = many["temp"] + many["arguments"] + many["outputs"]
    print(f"  temporaries k={args.k}/k=1: {many['temp'] / one['temp']:.2f}; "
          f"peak (args+outputs+temp) k={args.k}/k=1: {peakk / peak1:.2f}")


if __name__ == "__main__":
    main()
