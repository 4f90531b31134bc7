#!/usr/bin/env bash
# The performance checks on whatever accelerator this machine has (a GPU, a TPU, or only the
# CPU), printing each one's ratios:
#   1. the devices: `nvidia-smi -L` and `jax.devices()`;
#   2. benchmarks/overhead.py: jaxloop's loops against a hand-written jax.jit loop;
#   3. benchmarks/async_device.py: the same on a device-bound step (is the device kept busy?);
#   4. the step time with batches placed ahead in the prefetch thread
#      (`loop.prefetching(it, size=2, place=True)`) against placed by jit in its dispatch
#      (`place=False`), in alternating rounds.
# On a machine without this project's .venv (the lent GPU machines: their image has jax with
# CUDA, flax, optax and orbax, no network) it first installs the wheels that
# `scripts/gpu_wheels.sh` downloaded into .whl/ (carried with the checkout) with `pip
# --no-index --no-deps --target` into a fresh folder, and runs on the image's `python3`, with
# this checkout's jaxloop first on PYTHONPATH. JAX runs on its default backend (the
# accelerator where there is one) unless JAX_PLATFORMS says otherwise. Each part is bounded by
# PART_SECS (default 150 s), so the whole check ends inside one 10-minute device call.
#
#   bash benchmarks/gpu_check.sh                   # the settings for a lent GPU (minutes)
#   QUICK=1 bash benchmarks/gpu_check.sh           # short settings
#   bash benchmarks/gpu_check.sh --only mlp        # arguments go to overhead.py
#   PY=/path/python WHL=/tmp/whl bash benchmarks/gpu_check.sh   # another interpreter, wheels
#
# Each part runs even when an earlier one failed; the exit status is 1 if any failed.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
WHL="${WHL:-$ROOT/.whl}"
if [ -n "${PY:-}" ]; then
  :
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
elif command -v python3 >/dev/null 2>&1; then
  PY="$(command -v python3)"
else
  echo "gpu_check: no .venv/bin/python and no python3 on PATH" >&2
  exit 1
fi
SITE=""
if [ -d "$WHL" ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
  SITE="${SITE_DIR:-$(mktemp -d /tmp/jaxloop-site.XXXXXX)}"
  echo "installing $(ls "$WHL"/*.whl | wc -l) wheels from $WHL into $SITE (no index)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHL"/*.whl || { echo "gpu_check: installing the wheels failed" >&2; exit 1; }
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
QUICK="${QUICK:-0}"
PART_SECS="${PART_SECS:-150}"
FAILED=()

section() { printf '\n== %s\n' "$*"; }
run_part() {  # run_part NAME COMMAND...: runs it, notes a failure by name
  local name="$1"
  shift
  local start=$SECONDS
  timeout --kill-after=10 "$PART_SECS" "$@"
  local rc=$?
  [ $rc -eq 124 ] && echo "gpu_check: $name stopped at its ${PART_SECS} s bound"
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
  if [ "$BACKEND" = gpu ]; then  # JAX_PLATFORMS names the plugin: gpu would also try rocm
    if command -v nvidia-smi >/dev/null 2>&1; then BACKEND=cuda; else BACKEND=rocm; fi
  fi
  # The CPU too, listed second: io_callback (async_device.py's device sleep) runs on it.
  export JAX_PLATFORMS="$BACKEND${BACKEND:+,}cpu"
  [ "$BACKEND" = cpu ] && export JAX_PLATFORMS=cpu
fi
"$PY" -c 'import jax, jaxloop; print("jax", jax.__version__, "| backend", jax.default_backend(), "|", jax.devices()); print("jaxloop from", jaxloop.__file__)' \
  || FAILED+=("jax.devices")
echo "python $PY; JAX_PLATFORMS=$JAX_PLATFORMS; QUICK=$QUICK"

section "benchmarks/overhead.py"
if [ "$QUICK" = 1 ] && [ $# -eq 0 ]; then
  set -- --only tiny --rounds 3 --processes 1
elif [ $# -eq 0 ]; then
  set -- --rounds 5 --processes 1  # inside PART_SECS on a GPU; the README's are 30 x 5
fi
echo "python benchmarks/overhead.py $*"
run_part overhead.py "$PY" benchmarks/overhead.py "$@"

section "benchmarks/async_device.py"
if [ "$QUICK" = 1 ]; then
  run_part async_device.py "$PY" benchmarks/async_device.py --quick
else
  run_part async_device.py "$PY" benchmarks/async_device.py --rounds 3 --steps 100
fi

section "batches placed ahead (prefetch thread) against placed by jit"
run_part place-ahead env QUICK="$QUICK" "$PY" benchmarks/place_ahead.py

section "summary"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_check: failed: ${FAILED[*]}"
  exit 1
fi
echo "gpu_check: all parts ran"
