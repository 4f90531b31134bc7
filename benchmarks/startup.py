"""Start-up time with JAX's persistent compilation cache: the digits example started three
times as separate processes, each with a fresh work directory (no resume): without the
cache, with an empty cache (first start, fills it) and with the filled cache (second start).

Reported per start: the process's wall time and its XLA compile time (the sum of JAX's
``/jax/core/compile/backend_compile_duration`` events; programs loaded from the cache are
not compiled), so the saving is visible even where training dominates the wall time.

    python benchmarks/startup.py --train-steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
import jax
durations = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: durations.append(secs)
    if name == "/jax/core/compile/backend_compile_duration" else None)
from jaxloop.examples import digits
digits.main(sys.argv[1:])
print("COMPILE_SECS", json.dumps(sum(durations)))
"""


def start(workdir: str, steps: int, cache: str | None) -> tuple[float, float]:
    argv = ["--workdir", workdir, "--train-steps", str(steps),
            "--train-loop-steps", str(steps)]
    if cache:
        argv += ["--compilation-cache", cache]
    begin = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True,
                          text=True, timeout=900,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    wall = time.perf_counter() - begin
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("COMPILE_SECS"))
    return wall, json.loads(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-steps", type=int, default=20)
    args = parser.parse_args()
    root = tempfile.mkdtemp()
    cache = os.path.join(root, "cache")
    rows = [
        ("no cache", start(os.path.join(root, "w0"), args.train_steps, None)),
        ("first start (empty cache)", start(os.path.join(root, "w1"), args.train_steps, cache)),
        ("second start (filled cache)", start(os.path.join(root, "w2"), args.train_steps, cache)),
    ]
    print(f"digits example, {args.train_steps} steps + 1 evaluation, fresh workdir each start")
    for name, (wall, compile_secs) in rows:
        print(f"  {name:28s} wall {wall:6.1f} s   XLA compile {compile_secs:6.2f} s")
    print(f"  second/first wall: {rows[2][1][0] / rows[1][1][0]:.2f}; "
          f"compile: {rows[2][1][1] / max(rows[1][1][1], 1e-9):.2f}")


if __name__ == "__main__":
    main()
