"""Peak device bytes of a training run, as multiples of one state's bytes, side by side.

Variants (FSDP over 8 CPU devices, adam, the benchmarks' 784-1024-1024-10 MLP):
- default: the caller keeps the state it passes (a notebook's untrained state); the loop
  copies it once and donates only the states its steps produce;
- opt-in: ``TrainLoop(..., donate_input_state=True)`` consumes the state passed in;
- resume: `OuterLoop` restores a checkpoint onto ``step.abstract_state(spec)``: the
  restored state is the run's own, never copied;
- reads: as opt-in, over 4 loops whose end action reads the state (a norm) and keeps
  nothing: every step still donates;
- keeps: the same action also keeps the state of every loop (``self.kept.append(state)``):
  those stay usable, and cost their memory.

Device bytes are those of every live array's addressable shards (what the devices hold
between XLA programs; a step's temporaries are not arrays and are not counted). They are
sampled after every step (a step end action).

    python benchmarks/state_memory.py
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import MLP, TrainStep  # noqa: E402

from jaxloop import actions, outer_loop, partition, train_loop  # noqa: E402
from jaxloop.checkpointing import checkpoint  # noqa: E402
from jaxloop.diagnostics import memory  # noqa: E402

SPEC = [1, 784]


class Peak(actions.Action):
    """The most device bytes seen above `base`, sampled after each step (in the training
    thread: a sampling thread would hold the arrays while the loop looks for holders)."""

    def __init__(self) -> None:
        super().__init__(interval=1)
        self.base = self.peak = 0

    def __call__(self, state, outputs, **kwargs) -> None:
        self.peak = max(self.peak, memory.live_device_bytes() - self.base)

    def __enter__(self) -> Peak:
        gc.collect()
        self.base = memory.live_device_bytes()
        return self

    def __exit__(self, *exc) -> None:
        pass


class ReadsState(actions.Action):
    """A loop-end action that reads the state (its first kernel's norm), keeping it if asked."""

    def __init__(self, keep: bool) -> None:
        super().__init__(interval=1)
        self.keep, self.kept, self.norms = keep, [], []

    def __call__(self, state, outputs, **kwargs) -> None:
        self.norms.append(float(np.linalg.norm(np.asarray(jax.tree.leaves(state.params)[0]))))
        if self.keep:
            self.kept.append(state)


def batches(n: int = 64):
    rng = np.random.default_rng(0)
    while True:
        x = rng.normal(size=(n, 784)).astype(np.float32)
        yield {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}


def make_step(peak: Peak) -> TrainStep:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.FSDPPartitioner(mesh, "data", min_weight_size=2**10)
    return TrainStep(jax.random.key(0), MLP(), optimizer=optax.adam(1e-3), partitioner=part,
                train=True, end_actions=[peak])


def state_bytes(state) -> int:
    return sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)


def run(variant: str, steps: int, workdir: str) -> tuple[float, int]:
    """Peak device bytes of `variant` above what was live before, and one state's bytes."""
    peak = Peak()
    train = make_step(peak)
    if variant == "resume":
        state = train.initialize_model(SPEC)
        one = state_bytes(state)
        manager = checkpoint.make_manager(workdir)
        checkpoint.save(manager, 0, state)
        manager.wait_until_finished()
        del state
        outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(train),
                                     checkpoint_spec=outer_loop.CheckpointSpec(workdir),
                                     prefetch=0)
        with peak:
            abstract = train.abstract_state(SPEC)
            final, _ = outer(abstract, train_dataset=batches(), train_total_steps=steps,
                             train_loop_steps=steps)
            peak(None, None)
        return peak.peak / one, one
    state = train.initialize_model(SPEC)  # the caller's: it stays live in both variants
    one = state_bytes(state)
    if variant in ("reads", "keeps"):
        reads = ReadsState(keep=variant == "keeps")
        loop = train_loop.TrainLoop(train, donate_input_state=True, end_actions=[reads])
        with peak:
            it = batches()
            for _ in range(4):
                state, _ = loop(state, it, num_steps=steps // 4)
            peak(None, None)
        # The passed state was live before the run (in `base`), then consumed.
        return (peak.peak + one) / one, one
    loop = train_loop.TrainLoop(train, donate_input_state=variant == "opt-in")
    with peak:
        final, _ = loop(state, batches(), num_steps=steps)
        peak(None, None)
    # The caller's state was live before the run (in `base`): count it in the peak.
    return (peak.peak + one) / one, one


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"{jax.device_count()} devices ({jax.devices()[0].platform}), {args.steps} steps")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("default", "opt-in", "resume", "reads", "keeps"):
            ratio, one = run(variant, args.steps, os.path.join(tmp, variant))
            rows.append((variant, ratio, one))
            gc.collect()
    for variant, ratio, one in rows:
        print(f"{variant:8s} peak live device bytes = {ratio:.2f} x one state ({one} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
