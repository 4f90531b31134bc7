"""Step time of a TrainLoop reading host batches through `loop.prefetching(it, size=2,
place=...)`: placed on the devices in the prefetch thread (place=True) or handed to the
step as host arrays that jit copies in its dispatch (place=False); alternating rounds, the
ratio taken within each round. Run: ``QUICK=1 python benchmarks/place_ahead.py``
(part of benchmarks/gpu_check.sh)."""
import os
import statistics
import sys
import time

import jax
import optax

sys.path.insert(0, "benchmarks")
import common  # noqa: E402

from jaxloop import train_loop  # noqa: E402

quick = os.environ.get("QUICK") == "1"
hidden, batch_size, steps, rounds = (256, 32, 20, 3) if quick else (1024, 256, 200, 7)
step = common.TrainStep(jax.random.key(0), common.MLP(hidden=hidden),
                        optimizer=optax.sgd(1e-3), train=True)
loop = train_loop.TrainLoop(step)
states = {place: step.initialize_model([1, 784]) for place in (True, False)}


def window(place):
    it = common.batches(batch_size, steps)
    with loop.prefetching(it, size=2, place=place):
        state, _ = loop(states[place], it, num_steps=steps)
    states[place] = jax.block_until_ready(state)


for place in states:  # compiles
    window(place)
times = {True: [], False: []}
for r in range(rounds):
    for place in ((True, False) if r % 2 == 0 else (False, True)):
        start = time.perf_counter()
        window(place)
        times[place].append((time.perf_counter() - start) / steps)
ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
print(f"MLP 784-{hidden}-{hidden}-10, batch {batch_size}, {steps} steps x {rounds} rounds on "
      f"{jax.devices()[0].device_kind}: step time placed ahead "
      f"{statistics.median(times[True]) * 1e3:.3f} ms, placed by jit "
      f"{statistics.median(times[False]) * 1e3:.3f} ms; ahead / by jit "
      f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
      "(below 1: placing ahead is faster)")
