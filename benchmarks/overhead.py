"""jaxloop's loops against a hand-written `jax.jit` loop: same model, optimizer and data.

Measures, side by side in one run (best of --repeats, alternating A/B so that load on the
machine hits both alike), steps/s of
  hand-written   ``state, out = train_fn(state, batch)`` over in-memory numpy batches:
                 `jax.jit` with the state donated, no per-step sync, losses kept in a list
  jaxloop p=0    ``OuterLoop(train_loop=TrainLoop(step), prefetch=0)``: one train loop
  jaxloop p=2    the same with ``prefetch=2`` (a background thread places batches ahead)
  jaxloop k=16   ``TrainLoop(step, steps_per_execution=16)``, prefetch 0 and 2: 16 steps per
                 compiled call (the CNN: k=4 with ``unroll=True``)
and prints the ratios jaxloop / hand-written. Goals: >= 0.97 for the per-step loops, and
>= 1.3 for k=16 on the small MLP. It also prints jaxloop's host overhead per step, measured
on a tiny step (16-8-10 MLP, batch 8) whose device time is negligible.

Cases: MLP 784-256-10 and the guide's CNN at batch 32 on one device; MLP 784-256-10 at
batch 256 on 8 (forced CPU) devices with DataParallel and with FSDP. Each device count
runs in its own subprocess, since the device count is fixed when jax starts.

On 8 CPU devices the hand-written loop waits for the step before the one it just
dispatched (the policy of jaxloop's default there, ``max_steps_in_flight=2``): dispatching
hundreds of sharded steps without ever waiting crashes XLA's CPU collectives ("Expected 8
threads to join the rendezvous"; see DESIGN.md, reproduced here). On one device it never
waits (jaxloop lets 8 steps run ahead there).

    python benchmarks/overhead.py                      # everything, about 6 minutes
    python benchmarks/overhead.py --only mlp --repeats 9
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxloop import outer_loop, partition, step, train_loop  # noqa: E402

FUSED_STEPS = 16
IN_FLIGHT = 2  # jaxloop's default max_steps_in_flight on several CPU devices


class MLP(nn.Module):
    hidden: int = 256

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(10)(nn.relu(nn.Dense(self.hidden)(x)))


class GuideCNN(nn.Module):
    """The CNN of the jaxloop guide."""

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3))(x)), (2, 2), (2, 2))
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(10)(nn.relu(nn.Dense(256)(x)))


def train_step(state, batch):
    """The one computation both loops run."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


class TrainStep(step.Step):
    def run(self, state, batch):
        return train_step(state, batch)


def make_batches(shape, batch_size, count=64):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(batch_size, *shape)).astype(np.float32),
            "y": rng.integers(0, 10, size=(batch_size,)).astype(np.int32),
        }
        for _ in range(count)
    ]


def cycle(batches, n):
    for i in range(n):
        yield batches[i % len(batches)]


class Case:
    """One model on one partitioner, with a hand-written loop and jaxloop loops."""

    def __init__(self, name, model, shape, batch_size, partitioner, steps, fused=None):
        self.name, self.steps, self.shape = name, steps, shape
        self.batches = make_batches(shape, batch_size)
        self.step = TrainStep(jax.random.key(0), model, optimizer=optax.sgd(0.005, 0.9),
                              partitioner=partitioner, train=True)
        state = self.fresh_state()
        state_shardings = jax.tree.map(lambda x: x.sharding, state)
        mesh = partitioner.mesh
        batch_shardings = {"x": NamedSharding(mesh, P("data")),
                           "y": NamedSharding(mesh, P("data"))}
        if mesh.size == 1:
            self.hand_fn = jax.jit(train_step, donate_argnums=0)
            self.bound = None
        else:  # the state's own placement pinned in and out, numpy batches split by jit
            self.hand_fn = jax.jit(train_step, donate_argnums=0,
                                   in_shardings=(state_shardings, batch_shardings),
                                   out_shardings=(state_shardings, None))
            self.bound = IN_FLIGHT
        self.variants = {"hand-written": self.hand_written}
        for prefetch in (0, 2):
            self.variants[f"jaxloop p={prefetch}"] = self.jaxloop(1, prefetch)
        self.fused_steps = 1
        if fused is not None:  # (steps_per_execution, unroll)
            self.fused_steps, unroll = fused
            unrolled = " unrolled" if unroll is True else ""
            for prefetch in (0, 2):
                self.variants[f"jaxloop k={self.fused_steps}{unrolled} p={prefetch}"] = (
                    self.jaxloop(self.fused_steps, prefetch, unroll))

    def fresh_state(self):
        return jax.block_until_ready(self.step.initialize_model([1, *self.shape]))

    def hand_written(self, state, n):
        losses = []
        in_flight = collections.deque()
        for batch in cycle(self.batches, n):
            state, out = self.hand_fn(state, batch)
            losses.append(out["loss"])
            if self.bound:
                in_flight.append(out["loss"])
                if len(in_flight) >= self.bound:
                    in_flight.popleft().block_until_ready()
        return state

    def jaxloop(self, steps_per_execution, prefetch, unroll=1):
        loop = train_loop.TrainLoop(self.step, steps_per_execution=steps_per_execution,
                                    unroll=unroll)
        outer = outer_loop.OuterLoop(train_loop=loop, prefetch=prefetch, progress=False)

        def run(state, n):
            state, _ = outer(state, cycle(self.batches, n), train_total_steps=n,
                             train_loop_steps=n, log_train_total_steps=False)
            return state

        return run

    def measure(self, repeats):
        # Compiles every program a timed run uses, the remainder's execution size included.
        warmup = self.fused_steps + self.steps % self.fused_steps
        for run in self.variants.values():
            jax.block_until_ready(run(self.fresh_state(), warmup))
        best = dict.fromkeys(self.variants, 0.0)
        for _ in range(repeats):
            for name, run in self.variants.items():
                state = self.fresh_state()
                start = time.perf_counter()
                jax.block_until_ready(run(state, self.steps))
                best[name] = max(best[name], self.steps / (time.perf_counter() - start))
        return best


def host_overhead_us(repeats, steps=2000):
    """jaxloop's host time per step minus the hand-written loop's, on a step whose device
    time is negligible (a 16-8-10 MLP on 8 examples): what the loop itself costs."""
    case = Case("tiny", MLP(hidden=8), (16,), 8, partition.SingleDevicePartitioner(), steps)
    best = case.measure(repeats)
    hand = 1e6 / best["hand-written"]
    return hand, {name: 1e6 / v - hand for name, v in best.items() if name != "hand-written"}


def cases_for(devices, steps):
    if devices == 1:
        single = partition.SingleDevicePartitioner()
        return [
            Case("MLP 784-256-10, batch 32", MLP(), (784,), 32, single, steps,
                 fused=(FUSED_STEPS, 1)),
            # XLA:CPU runs convolutions inside a rolled loop on a slow kernel: unroll. The
            # CNN is compute-bound, so fusing only shows that it costs nothing (k <= 8).
            Case("guide CNN, batch 32", GuideCNN(), (28, 28, 1), 32, single, steps // 5,
                 fused=(4, True)),
        ]
    mesh = Mesh(np.array(jax.devices()), ("data",))
    return [
        Case("MLP batch 256, DataParallel x8", MLP(), (784,), 256,
             partition.DataParallelPartitioner(mesh, "data"), steps // 2),
        Case("MLP batch 256, FSDP x8", MLP(), (784,), 256,
             partition.FSDPPartitioner(mesh, "data"), steps // 2),
    ]


def run_group(devices, steps, repeats, only):
    assert jax.device_count() == devices, (jax.device_count(), devices)
    print(f"-- {devices} device(s), {jax.devices()[0].platform}, best of {repeats} "
          f"alternating runs; steps/s (ratio to hand-written)")
    for case in cases_for(devices, steps):
        if only and only.lower() not in case.name.lower():
            continue
        best = case.measure(repeats)
        hand = best["hand-written"]
        cells = [f"hand-written {hand:8.1f}"] + [
            f"{name} {value:8.1f} ({value / hand:.3f})"
            for name, value in best.items() if name != "hand-written"
        ]
        print(f"{case.name} [{case.steps} steps]")
        for cell in cells:
            print(f"    {cell}")
        sys.stdout.flush()
    if devices == 1 and (not only or only.lower() in "tiny"):
        hand_us, extra = host_overhead_us(repeats)
        print(f"host time per step on a tiny step: hand-written {hand_us:.1f} us; jaxloop adds "
              + ", ".join(f"{name}: {us:+.1f} us" for name, us in extra.items()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000,
                        help="steps per timed run (the CNN runs 1/5, the 8-device cases 1/2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="",
                        help="run only the cases whose name contains this ('tiny': overhead)")
    parser.add_argument("--devices", type=int, choices=(1, 8),
                        help="run one device-count group in this process (used internally)")
    args = parser.parse_args()
    if args.devices is not None:
        run_group(args.devices, args.steps, args.repeats, args.only)
        return
    for devices in (1, 8):
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        if devices > 1:
            flags.append(f"--xla_force_host_platform_device_count={devices}")
        env["XLA_FLAGS"] = " ".join(flags)
        subprocess.run(
            [sys.executable, __file__, "--devices", str(devices), "--steps", str(args.steps),
             "--repeats", str(args.repeats), "--only", args.only],
            env=env, check=True,
        )


if __name__ == "__main__":
    main()
