"""Device prefetch hides an input pipeline whose per-batch cost is close to the step's.

Measures, side by side in one run (best of --repeats, alternating):
  step alone      the train step on batches that are already in memory
  input alone     the input pipeline alone (iterated, no training)
  no prefetch     OuterLoop(prefetch=0): input and step take turns
  prefetch        OuterLoop(prefetch=2): the next batches are loaded and placed while the
                  current step runs
and prints steps/s and the ratios. The goal: prefetch >= 0.85 x the slower of the two alone.
Without prefetch the loop overlaps them too, since JAX dispatches steps asynchronously and
the loop reads the next batch while the dispatched steps run.

The pipeline's cost is host work that releases the GIL (as decoding and file reads do),
simulated with a sleep calibrated to the measured step time.

    python benchmarks/input_pipeline.py
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402
from common import MLP, TrainStep, batches  # noqa: E402

from jaxloop import outer_loop, train_loop  # noqa: E402


def run_training(n, batch_size, delay, prefetch):
    train = TrainStep(jax.random.key(0), MLP(), optimizer=optax.sgd(1e-3), train=True)
    state = train.initialize_model([1, 784])
    outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(train), prefetch=prefetch)
    outer(train.initialize_model([1, 784]), batches(batch_size, 5), train_total_steps=5)
    start = time.perf_counter()
    state, _ = outer(state, batches(batch_size, n, delay),
                     train_total_steps=n, train_loop_steps=n)
    jax.block_until_ready(state)
    return n / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    step_alone = max(run_training(args.steps, args.batch_size, 0, 0)
                     for _ in range(args.repeats))
    delay = 1.0 / step_alone  # the input pipeline costs as much as a step
    results = {"no prefetch": [], "prefetch": [], "input alone": []}
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in batches(args.batch_size, args.steps, delay):
            pass
        results["input alone"].append(args.steps / (time.perf_counter() - start))
        results["no prefetch"].append(run_training(args.steps, args.batch_size, delay, 0))
        results["prefetch"].append(run_training(args.steps, args.batch_size, delay, 2))
    best = {k: max(v) for k, v in results.items()}
    slower = min(step_alone, best["input alone"])
    print(f"devices={jax.device_count()} steps={args.steps} batch={args.batch_size} "
          f"input cost={delay * 1e3:.2f} ms/batch")
    print(f"{'step alone':>12}: {step_alone:8.1f} steps/s")
    for name in ("input alone", "no prefetch", "prefetch"):
        print(f"{name:>12}: {best[name]:8.1f} steps/s")
    print(f"ratio prefetch / slower alone    = {best['prefetch'] / slower:.3f} (goal >= 0.85)")
    print(f"ratio no prefetch / slower alone = {best['no prefetch'] / slower:.3f}")


if __name__ == "__main__":
    main()
