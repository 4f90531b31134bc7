"""What `integrity.check_replicas` costs next to one train step of the same state.

The transformer example's model and optimizer (defaults: 112k parameters, Adam), batch 32 x
64 characters, on 8 forced host devices: under ``spmd-fsdp`` (FSDP x tensor parallelism on
a 4x2 ``('data', 'model')`` mesh: norms, biases and some kernels have copies) and ``dp``
(every leaf replicated 8 times: the most there is to compare). Alternating a train step and
a check, each timed to completion; the median of --repeats of each, and their ratio.

    python benchmarks/replica_check.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxloop import partition  # noqa: E402
from jaxloop.diagnostics import integrity  # noqa: E402
from jaxloop.examples import transformer  # noqa: E402


def make_step(kind: str) -> transformer.LMStep:
    if kind == "spmd-fsdp":
        mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1, 2), ("data", "model"))
        part, axis = partition.SPMDPartitioner(mesh, "data", fsdp_min_weight_size=2**10), "model"
    else:
        part, axis = transformer.make_partitioner(kind)
    model = transformer.TransformerLM(transformer.LMConfig(), model_axis=axis)
    return transformer.LMStep(jax.random.key(0), model,
                              optimizer=transformer.make_optimizer(1e-2, 1000),
                              partitioner=part, train=True)


def timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    tokens = np.random.default_rng(0).integers(0, 128, (args.batch, 65), dtype=np.int32)
    batch = {"tokens": tokens}
    for kind in ("spmd-fsdp", "dp"):
        step = make_step(kind)
        holder = [step.initialize_model(([1, 64], "int32"))]

        def train(step=step, holder=holder):
            holder[0], outputs = step(holder[0], batch)
            return outputs

        def check(holder=holder):
            return integrity.check_replicas(holder[0])

        train(), check()  # compile both
        steps, checks = [], []
        for _ in range(args.repeats):
            steps.append(timed(train))
            checks.append(timed(check))
        s, c = statistics.median(steps), statistics.median(checks)
        print(f"{kind}: {len(check())} replicated leaves checked; train step {s * 1e3:.2f} ms, "
              f"check {c * 1e3:.2f} ms, ratio {c / s:.3f}")


if __name__ == "__main__":
    main()
