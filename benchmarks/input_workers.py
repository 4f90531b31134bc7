"""Input work that holds the GIL: read in the training process's thread or in grain workers.

Per record, the pipeline decodes a small image (uint8 to float), crops it at a random offset
from a 2-pixel padding, flips it, and runs a tokenizer-like Python loop over its bytes whose
hash sets a brightness jitter: plain Python and numpy on small arrays, which hold the GIL.
Its length is calibrated so that the input alone costs about as much as a step alone
(--input-cost 2: twice as much).
Measures, side by side in one run (variants alternating, best of --repeats):

  step alone      the train step on batches already in memory (OuterLoop, prefetch 2)
  input alone     the pipeline iterated without training: in the caller's thread, and
                  through 2 grain worker processes
  caller thread   OuterLoop(prefetch=2) over GlobalBatchDataset(num_workers=0): the
                  prefetch thread reads and transforms every record
  2 workers       the same over GlobalBatchDataset(num_workers=2): records are read and
                  transformed in 2 grain worker processes (mp_prefetch)

and prints steps/s and the ratio 2 workers / caller thread (goal >= 1.3). Worker start-up
is not timed: each variant keeps one endless iterator (and its workers) across rounds.
It also prints the CPU time per step of the step and of the input, and the most steps/s
the machine's cores can give both: the ceiling of any arrangement of the input.

    python benchmarks/input_workers.py
    python benchmarks/input_workers.py --steps 100 --repeats 5 --input-cost 2
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import MLP, TrainStep  # noqa: E402

from jaxloop import data, outer_loop, train_loop  # noqa: E402


class Augment:
    """Decode, crop, flip and a tokenizer-like loop of `work` byte steps (picklable: grain
    workers are new processes)."""

    def __init__(self, work: int):
        self.work = work

    def __call__(self, example: dict) -> dict:
        raw = example["image"]
        image = raw.reshape(28, 28).astype(np.float32) / 255.0
        seed = int(raw[:8].sum())
        dy, dx = seed % 5, (seed // 5) % 5
        image = np.pad(image, 2)[dy:dy + 28, dx:dx + 28]
        if seed & 1:
            image = image[:, ::-1]
        values, h = raw.tolist(), 0
        for i in range(self.work):
            h = (h * 31 + values[i % 784]) & 0xFFFF
        image = image * (0.9 + (h % 21) / 100)
        return {"x": ((image - 0.5) / 0.25).reshape(-1).astype(np.float32),
                "y": example["label"]}


def source(n: int = 4096) -> data.ArraySource:
    rng = np.random.default_rng(0)
    return data.ArraySource({"image": rng.integers(0, 256, (n, 784), dtype=np.uint8),
                             "label": rng.integers(0, 10, n).astype(np.int32)})


def dataset(batch_size: int, work: int, workers: int) -> data.GlobalBatchDataset:
    return data.GlobalBatchDataset(source(), batch_size, seed=0, transform=Augment(work),
                                   num_workers=workers)


def input_rate(it, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        next(it)
    return n / (time.perf_counter() - start)


class Trainer:
    """One state and one OuterLoop, trained a window of steps at a time."""

    def __init__(self, batches):
        # 784-2048-2048-10: a step costing about what the input's decode and crop cost.
        self.step = TrainStep(jax.random.key(0), MLP(hidden=2048), optimizer=optax.sgd(1e-3),
                              train=True)
        self.state = self.step.initialize_model([1, 784])
        self.outer = outer_loop.OuterLoop(train_loop.TrainLoop(self.step), prefetch=2,
                                          progress=False)
        self.batches = batches
        self.done = 0
        self.window(5)  # compiles

    def window(self, n: int) -> float:
        start = time.perf_counter()
        self.state, _ = self.outer(self.state, self.batches, train_total_steps=self.done + n,
                                   train_loop_steps=n, log_train_total_steps=False)
        jax.block_until_ready(self.state)
        self.done += n
        return n / (time.perf_counter() - start)


def cycle(batches):
    while True:
        yield from batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--input-cost", type=float, default=1.0,
                        help="the input's cost per batch as a multiple of the step's")
    args = parser.parse_args()
    n, size = args.steps, args.batch_size

    # Calibration: the step alone, then the input's cost per batch as a line in `work`.
    in_memory = [next(iter(dataset(size, 0, 0)))]
    step_alone = Trainer(cycle(in_memory))
    step_rate = max(step_alone.window(n) for _ in range(3))
    probes = {w: iter(dataset(size, w, 0)) for w in (0, 2000)}
    costs = {w: 1 / max(input_rate(it, 30) for _ in range(3)) for w, it in probes.items()}
    per_work = (costs[2000] - costs[0]) / 2000
    work = max(0, round((args.input_cost / step_rate - costs[0]) / per_work))

    caller_it, workers_it = iter(dataset(size, work, 0)), iter(dataset(size, work, 2))
    next(workers_it)  # starts the workers before anything is timed
    variants = {
        "step alone": step_alone.window,
        "input alone, caller thread": lambda k: input_rate(caller_it, k),
        "input alone, 2 workers": lambda k: input_rate(workers_it, k),
        "caller thread": Trainer(caller_it).window,
        "2 workers": Trainer(workers_it).window,
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}  # this process's, per step
    names = list(variants)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.process_time()
            rates[name].append(variants[name](n))
            cpu[name].append((time.process_time() - start) / n)
    workers_it.close()
    best = {name: max(v) for name, v in rates.items()}
    print(f"devices={jax.device_count()} cores={os.cpu_count()} steps={n} batch={size} "
          f"work={work} (input cost {1e3 * (costs[0] + work * per_work):.2f} ms/batch in the "
          f"caller's thread; step alone {1e3 / step_rate:.2f} ms at calibration)")
    for name in names:
        print(f"{name:>28}: {best[name]:8.1f} steps/s")
    ratio = best["2 workers"] / best["caller thread"]
    print(f"ratio 2 workers / caller thread = {ratio:.3f} (goal >= 1.3)")
    # Workers move the input's CPU work, they do not shrink it: whatever runs where, the
    # machine's cores must supply the step's CPU time plus the input's for every step.
    step_cpu, input_cpu = min(cpu["step alone"]), min(cpu["input alone, caller thread"])
    ceiling = os.cpu_count() / (step_cpu + input_cpu)
    print(f"CPU per step: step {1e3 * step_cpu:.2f} ms ({step_cpu * best['step alone']:.2f} "
          f"cores busy), input {1e3 * input_cpu:.2f} ms; {os.cpu_count()} cores give at most "
          f"{ceiling:.1f} steps/s, {ceiling / best['caller thread']:.2f}x the caller thread")
    slower = min(best["step alone"], best["input alone, 2 workers"])
    print(f"ratio 2 workers / slower of step alone and input alone (2 workers) = "
          f"{best['2 workers'] / slower:.3f}")


if __name__ == "__main__":
    main()
