#!/usr/bin/env bash
# The performance checks on whatever accelerator this machine has (a GPU, a TPU, or only the
# CPU), printing each one's ratios:
#   1. the devices: `nvidia-smi -L` and `jax.devices()`;
#   2. benchmarks/overhead.py: jaxloop's loops against a hand-written jax.jit loop;
#   3. benchmarks/async_device.py: the same on a device-bound step (is the device kept busy?);
#   4. the step time with batches placed ahead in the prefetch thread
#      (`loop.prefetching(it, size=2, place=True)`) against placed by jit in its dispatch
#      (`place=False`), in alternating rounds.
# It installs nothing: it runs the project's .venv/bin/python, else `python` on PATH, with
# this checkout's jaxloop first on PYTHONPATH. JAX runs on its default backend (the
# accelerator where there is one) unless JAX_PLATFORMS says otherwise.
#
#   bash benchmarks/gpu_check.sh                   # full settings (tens of minutes)
#   QUICK=1 bash benchmarks/gpu_check.sh           # short settings, a minute or two
#   bash benchmarks/gpu_check.sh --only mlp        # arguments go to overhead.py
#
# Each part runs even when an earlier one failed; the exit status is 1 if any failed.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
if [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
elif command -v python >/dev/null 2>&1; then
  PY="$(command -v python)"
else
  echo "gpu_check: no .venv/bin/python and no python on PATH" >&2
  exit 1
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
QUICK="${QUICK:-0}"
FAILED=()

section() { printf '\n== %s\n' "$*"; }
run_part() {  # run_part NAME COMMAND...: runs it, notes a failure by name
  local name="$1"
  shift
  local start=$SECONDS
  "$@"
  local rc=$?
  if [ $rc -ne 0 ]; then
    FAILED+=("$name (exit $rc)")
    echo "gpu_check: $name failed with exit status $rc"
  fi
  echo "($name: $((SECONDS - start)) s)"
}

section "devices"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || FAILED+=("nvidia-smi")
else
  echo "nvidia-smi: not found (no NVIDIA driver on this machine)"
fi
if [ -z "${JAX_PLATFORMS+x}" ]; then
  # overhead.py runs on the CPU unless JAX_PLATFORMS is set: set it to the default backend.
  BACKEND="$("$PY" -c 'import jax; print(jax.default_backend())')" || BACKEND=""
  if [ -z "$BACKEND" ]; then
    echo "gpu_check: jax does not start with $PY" >&2
    exit 1
  fi
  export JAX_PLATFORMS="$BACKEND"
fi
"$PY" -c 'import jax, jaxloop; print("jax", jax.__version__, "| backend", jax.default_backend(), "|", jax.devices()); print("jaxloop from", jaxloop.__file__)' \
  || FAILED+=("jax.devices")
echo "python $PY; JAX_PLATFORMS=$JAX_PLATFORMS; QUICK=$QUICK"

section "benchmarks/overhead.py"
if [ "$QUICK" = 1 ] && [ $# -eq 0 ]; then
  set -- --only tiny --rounds 3 --processes 1
fi
echo "python benchmarks/overhead.py $*"
run_part overhead.py "$PY" benchmarks/overhead.py "$@"

section "benchmarks/async_device.py"
if [ "$QUICK" = 1 ]; then
  run_part async_device.py "$PY" benchmarks/async_device.py --quick
else
  run_part async_device.py "$PY" benchmarks/async_device.py
fi

section "batches placed ahead (prefetch thread) against placed by jit"
place_ahead() {
  QUICK="$QUICK" "$PY" - <<'EOF'
"""Step time of a TrainLoop reading host batches through `loop.prefetching(it, size=2,
place=...)`: placed on the devices in the prefetch thread (place=True) or handed to the
step as host arrays that jit copies in its dispatch (place=False); alternating rounds, the
ratio taken within each round."""
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
EOF
}
run_part place-ahead place_ahead

section "summary"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_check: failed: ${FAILED[*]}"
  exit 1
fi
echo "gpu_check: all parts ran"
