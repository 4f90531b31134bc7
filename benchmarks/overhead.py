"""jaxloop's loops against a hand-written `jax.jit` loop: same model, optimizer and data.

Measures, side by side in one run, steps/s of
  hand-written    ``state, out = train_fn(state, batch)`` over in-memory numpy batches:
                  `jax.jit` with the state donated, no per-step sync, losses kept in a list
  defaults        ``OuterLoop(train_loop=TrainLoop(step))``, everything at its default
                  (on CPUs no prefetch thread: see `jaxloop.data.read_ahead`), train loops of
                  --loop-steps steps (default 200)
  p=0             the same with ``prefetch=0``: no read-ahead thread (the default on CPUs)
  p=2             the same with ``prefetch=2``: a thread that reads two batches ahead
  k=K             ``TrainLoop(step, steps_per_execution=K)``, defaults otherwise: K steps
                  per compiled call (the CNN: with ``unroll=True``)
  k=16 L=192      k=16 on loops of 192 steps (a multiple of 16); the default 200-step loops
                  run their last 8 steps as a short execution of the same program

How. Each variant trains its own state throughout; a round times one window of every
variant (one train loop of steps: an ``OuterLoop`` call for jaxloop), the variants taking
turns in an order that rotates from round to round, and --rounds rounds (default 60) are
run. A variant's ratio to the hand-written loop is taken within each round, from windows
that ran moments apart, and the median over the rounds is printed with its 95%
confidence interval (distribution-free, from the ranks) and the spread (min-max). Whole
runs of one program moved by 10-40% from run to run on a 2-core machine, and short windows
by +-20%, so a ratio of two separate runs says little; paired windows cancel what
changes slowly, and many of them narrow what does not. The one-device cases run in
--processes processes (default 3) whose rounds are pooled: a process places its arrays
anew, and the same variant measured 0.93-0.99x the hand-written loop from one process to
the next (each process's median is printed too). Goals: defaults >= 0.97, k=16 >= 1.3
(MLP, one device); defaults >= 0.95 with 8 devices (DataParallel).

It also prints jaxloop's host time per step on a tiny step (16-8-10 MLP, batch 8) whose
device time is negligible, as wall time and as the CPU time of the thread that runs the
loop (its dispatch and bookkeeping, without XLA's threads: far steadier than wall time).

Cases: MLP 784-256-10 and the guide's CNN at batch 32 on one device (the CNN in loops of
1/5 the length); MLP 784-256-10 at batch 256 on 8 (forced CPU) devices with DataParallel
and with FSDP (loops of 1/4 the length). Each device count runs in its own subprocess,
since the device count is fixed when jax starts.

NNX case (``--only nnx``): the same MLP as an nnx.Module trained by an NNX-native step
(``run(self, model, optimizer, batch)``) against a hand-written NNX loop written the fast
way: ``nnx.split`` once, a donated `jax.jit` of a pure function that calls ``nnx.merge``
inside and returns ``nnx.state``; beside them ``nnx.jit`` on the model and optimizer
objects, called per step (the tutorial's way). Goal: defaults >= 0.97 of the fast loop.

On 8 CPU devices the hand-written loop waits for the step before the one it just
dispatched (the policy of jaxloop's default there, ``max_steps_in_flight=2``): dispatching
hundreds of sharded steps without ever waiting crashes XLA's CPU collectives ("Expected 8
threads to join the rendezvous"; see DESIGN.md, reproduced here). On one device it never
waits (jaxloop lets 8 steps run ahead there).

    python benchmarks/overhead.py                       # everything (about 15 minutes)
    python benchmarks/overhead.py --only mlp --rounds 200
    python benchmarks/overhead.py --only tiny           # host time per step
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxloop import outer_loop, partition, step, train_loop  # noqa: E402

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
    """One model on one partitioner, with a hand-written loop and jaxloop loops.

    `fused` lists the fixed steps_per_execution sizes to run (with `unroll`); `aligned`
    adds k=16 on loops of 192 steps.
    """

    def __init__(self, model, shape, batch_size, partitioner, loop_steps=200,
                 fused=(), unroll=False, aligned=False):
        self.shape, self.loop_steps = shape, loop_steps
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
        self.loops = {}
        self.window = {}  # steps per timed window, where not loop_steps
        self.variants = {"hand-written": self.hand_written,
                         "defaults": self.jaxloop("defaults", 1),
                         "p=0": self.jaxloop("p=0", 1, prefetch=0),
                         "p=2": self.jaxloop("p=2", 1, prefetch=2)}
        for k in fused:
            self.variants[f"k={k}"] = self.jaxloop(f"k={k}", k, unroll=unroll)
        if aligned:
            self.variants["k=16 L=192"] = self.jaxloop("k=16 L=192", 16, unroll=unroll,
                                                       loop_steps=192)

    def fresh_state(self):
        return jax.block_until_ready(self.step.initialize_model([1, *self.shape]))

    def start(self, name):
        """A fresh state for variant `name` (the jaxloop state unless it keeps its own)."""
        return self.fresh_state()

    def hand_written(self, state, first, n):
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

    def jaxloop(self, name, steps_per_execution, prefetch=None, unroll=False,
                loop_steps=None):
        loop = train_loop.TrainLoop(self.step, steps_per_execution=steps_per_execution,
                                    unroll=unroll)
        self.loops[name] = loop
        outer = outer_loop.OuterLoop(train_loop=loop, prefetch=prefetch, progress=False)
        loop_steps = loop_steps or self.loop_steps
        self.window[name] = loop_steps

        def run(state, first, n):
            # The state goes on from `first` (its step count): train_total_steps is absolute.
            state, _ = outer(state, cycle(self.batches, n), train_total_steps=first + n,
                             train_loop_steps=min(n, loop_steps), log_train_total_steps=False)
            return state

        return run

    def measure(self, rounds):
        """Each variant's steps/s, and CPU seconds per step of the thread that runs the loop
        (dispatch and the loop's own work, without XLA's threads), in every round.

        A round times one window of every variant (one train loop of its length), in an
        order that rotates from round to round. Each variant trains one state throughout,
        so a window is a stretch of one long run.
        """
        states, done = {}, {}
        # Compiles every program a window uses (one per variant).
        for name, run in self.variants.items():
            states[name], done[name] = self.start(name), 0
            n = self.window.get(name, self.loop_steps)
            states[name] = jax.block_until_ready(run(states[name], done[name], n))
            done[name] += n
        rates = {name: [] for name in self.variants}
        cpu = {name: [] for name in self.variants}
        names = list(self.variants)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                n = self.window.get(name, self.loop_steps)
                start, start_cpu = time.perf_counter(), time.thread_time()
                states[name] = jax.block_until_ready(
                    self.variants[name](states[name], done[name], n))
                rates[name].append(n / (time.perf_counter() - start))
                cpu[name].append((time.thread_time() - start_cpu) / n)
                done[name] += n
        return rates, cpu


class NnxMLP(nnx.Module):
    """MLP 784-256-10 as an nnx.Module."""

    def __init__(self, hidden=256, *, rngs):
        self.dense1 = nnx.Linear(784, hidden, rngs=rngs)
        self.dense2 = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        return self.dense2(nnx.relu(self.dense1(x.reshape((x.shape[0], -1)))))


def nnx_train(model, optimizer, batch):
    """The one NNX computation every NNX variant runs."""

    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {"loss": loss}


class NnxTrainStep(step.Step):
    def run(self, model, optimizer, batch):
        return nnx_train(model, optimizer, batch)


class NnxCase(Case):
    """The MLP as an nnx.Module on one device: jaxloop's NNX-native step against a
    hand-written loop written the fast way, and `nnx.jit` per step."""

    def __init__(self, batch_size, loop_steps=200):
        self.shape, self.loop_steps = (784,), loop_steps
        self.batches = make_batches(self.shape, batch_size)
        self.tx = optax.sgd(0.005, 0.9)
        self.step = NnxTrainStep(jax.random.key(0), NnxMLP(rngs=nnx.Rngs(0)), optimizer=self.tx,
                                 train=True)
        self.graphdef, _ = nnx.split(self.objects())

        @functools.partial(jax.jit, donate_argnums=0)
        def fast(state, batch):
            model, optimizer = nnx.merge(self.graphdef, state)
            out = nnx_train(model, optimizer, batch)
            return nnx.state((model, optimizer)), out

        self.fast = fast
        self.nnx_jit = nnx.jit(nnx_train)
        self.loops, self.window = {}, {}
        self.variants = {"hand-written": self.hand_written, "defaults": self.jaxloop("defaults", 1),
                         "nnx.jit": self.nnx_jitted}

    def objects(self):
        model = NnxMLP(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, self.tx, wrt=nnx.Param)

    def start(self, name):
        if name == "hand-written":
            return jax.block_until_ready(nnx.split(self.objects())[1])
        if name == "nnx.jit":
            return self.objects()
        return self.fresh_state()

    def hand_written(self, state, first, n):
        """nnx.split once (in `start`), then a donated jax.jit of a pure function."""
        losses = []
        for batch in cycle(self.batches, n):
            state, out = self.fast(state, batch)
            losses.append(out["loss"])
        return state

    def nnx_jitted(self, objects, first, n):
        """The tutorial's way: nnx.jit called on the objects every step."""
        model, optimizer = objects[:2]
        losses = []
        for batch in cycle(self.batches, n):
            losses.append(self.nnx_jit(model, optimizer, batch)["loss"])
        return model, optimizer, losses[-1]


def median_ci(values):
    """The median and a distribution-free 95% confidence interval for it (the order
    statistics n/2 -/+ 0.98 sqrt(n), from the binomial distribution of ranks)."""
    v = sorted(values)
    n = len(v)
    half = 0.98 * math.sqrt(n)
    return (statistics.median(v), v[max(0, math.floor(n / 2 - half))],
            v[min(n - 1, math.ceil(n / 2 + half))])


def ratios(rates, name, over):
    """`name`'s rate over `over`'s in each round (their windows ran side by side)."""
    return [a / b for a, b in zip(rates[name], rates[over], strict=True)]


def host_overhead_us(rounds, window=2000):
    """Host time per step on a step whose device time is negligible (a 16-8-10 MLP on 8
    examples), per round: each variant's wall time and CPU time of the thread that runs
    the loop, in microseconds per step."""
    case = Case(MLP(hidden=8), (16,), 8, partition.SingleDevicePartitioner(),
                loop_steps=window)
    rates, cpu = case.measure(rounds)
    return {n: {"wall": [1e6 / r for r in rates[n]], "cpu": [1e6 * c for c in cpu[n]]}
            for n in rates}


def cases_for(devices, loop_steps):
    """(name, a function that builds its Case) for each case on this many devices."""
    if devices == 1:
        single = partition.SingleDevicePartitioner()
        return [
            ("MLP 784-256-10, batch 32", lambda: Case(
                MLP(), (784,), 32, single, loop_steps, fused=(4, 8, 16, 32), aligned=True)),
            # XLA:CPU runs convolutions inside a rolled loop on a slow kernel: unroll.
            ("guide CNN, batch 32", lambda: Case(
                GuideCNN(), (28, 28, 1), 32, single, loop_steps // 5,
                fused=(2, 4, 8), unroll=True)),
            ("NNX 784-256-10 (nnx.Module), batch 32", lambda: NnxCase(32, loop_steps)),
        ]
    mesh = Mesh(np.array(jax.devices()), ("data",))
    return [
        ("MLP batch 256, DataParallel x8", lambda: Case(
            MLP(), (784,), 256, partition.DataParallelPartitioner(mesh, "data"),
            loop_steps // 4)),
        ("MLP batch 256, FSDP x8", lambda: Case(
            MLP(), (784,), 256, partition.FSDPPartitioner(mesh, "data"),
            loop_steps // 4)),
    ]


def run_group(devices, loop_steps, rounds, only):
    """Measures this device count's cases in this process: per case, its loop length and
    each variant's steps/s per round; 'tiny': host time per step."""
    assert jax.device_count() == devices, (jax.device_count(), devices)
    results = {}
    for name, build in cases_for(devices, loop_steps):
        if only and only.lower() not in name.lower():
            continue
        case = build()
        rates, _ = case.measure(rounds)
        results[name] = {"loop_steps": case.loop_steps, "rates": rates}
    if devices == 1 and (not only or only.lower() in "tiny"):
        results["tiny"] = host_overhead_us(rounds)
    return results


def report(devices, runs, rounds):
    """Prints each case of `runs` (run_group's results, one per process), the rounds of
    all processes pooled: ratios are taken within each round, then their median."""
    print(f"-- {devices} device(s), {len(runs)} process(es) x {rounds} rounds; median "
          f"steps/s, and the median ratio to hand-written over the rounds [its 95% "
          f"confidence interval] (min-max); load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    for name, first in runs[0].items():
        if name == "tiny":
            continue
        rates = {v: [r for run in runs for r in run[name]["rates"][v]] for v in first["rates"]}
        median = {n: statistics.median(v) for n, v in rates.items()}
        print(f"{name} [loops of {first['loop_steps']} steps, one loop per window]")
        print(f"    {'hand-written':22s} {median['hand-written']:8.1f}")
        for variant in rates:
            if variant == "hand-written":
                continue
            each_round = ratios(rates, variant, "hand-written")
            mid, lo, hi = median_ci(each_round)
            print(f"    {variant:22s} {median[variant]:8.1f} ({mid:.3f} [{lo:.3f}-{hi:.3f}]"
                  f" ({min(each_round):.3f}-{max(each_round):.3f}))")
            if len(runs) > 1:
                each = [statistics.median(ratios(run[name]["rates"], variant, "hand-written"))
                        for run in runs]
                print(f"    {'':22s} per process: {' '.join(f'{x:.3f}' for x in each)}")
    if "tiny" in runs[0]:
        def pooled(variant, kind):
            return [x for run in runs for x in run["tiny"][variant][kind]]

        def added(variant, kind):
            return statistics.median(a - b for a, b in zip(
                pooled(variant, kind), pooled("hand-written", kind), strict=True))

        print(f"host time per step on a tiny step (medians over the rounds): hand-written "
              f"{statistics.median(pooled('hand-written', 'wall')):.1f} us wall, "
              f"{statistics.median(pooled('hand-written', 'cpu')):.1f} us loop-thread CPU; "
              "jaxloop adds " + ", ".join(
                  f"{v}: {added(v, 'wall'):+.1f} us wall, {added(v, 'cpu'):+.1f} us CPU"
                  for v in runs[0]["tiny"] if v != "hand-written"))
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop-steps", type=int, default=200,
                        help="steps per train loop and timed window (the CNN's 1/5, "
                        "the 8-device cases' 1/4)")
    parser.add_argument("--rounds", type=int, default=60,
                        help="timed windows of each variant per process, taking turns")
    parser.add_argument("--processes", type=int, default=3,
                        help="processes measuring the 1-device cases, one after another")
    parser.add_argument("--only", default="",
                        help="run only the cases whose name contains this ('tiny': overhead)")
    parser.add_argument("--devices", type=int, choices=(1, 8),
                        help="measure one device-count group in this process and write "
                        "its results as JSON to --out (used internally)")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.devices is not None:
        with open(args.out, "w") as f:
            json.dump(run_group(args.devices, args.loop_steps, args.rounds, args.only), f)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for devices in (1, 8):
            env = dict(os.environ)
            flags = [f for f in env.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
            if devices > 1:  # forced CPU devices, whatever accelerator this machine has
                flags.append(f"--xla_force_host_platform_device_count={devices}")
                env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = " ".join(flags)
            runs = []
            # Each process places its arrays anew: the same variant measured 0.93-0.99x
            # the hand-written loop from one process to the next.
            for i in range(args.processes if devices == 1 else 1):
                out = os.path.join(tmp, f"{devices}-{i}.json")
                subprocess.run(
                    [sys.executable, __file__, "--devices", str(devices),
                     "--loop-steps", str(args.loop_steps), "--rounds", str(args.rounds),
                     "--only", args.only, "--out", out],
                    env=env, check=True,
                )
                with open(out) as f:
                    runs.append(json.load(f))
            if runs[0]:
                report(devices, runs, args.rounds)


if __name__ == "__main__":
    main()
