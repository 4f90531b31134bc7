#!/usr/bin/env bash
# Downloads, here, the wheels that the lent GPU machines' image lacks, for its Python (3.12 on
# x86-64), into .whl/ (ignored by git; `carry` it to the device call). That image has jax with
# CUDA, flax, optax, orbax-checkpoint, numpy, etils and tqdm, and no network: the rest of what
# benchmarks/gpu_check.sh imports travels as these wheels, at the versions of constraints.txt.
#
#   bash scripts/gpu_wheels.sh                 # Python 3.12 wheels into .whl/
#   PYVER=3.11 WHL=/tmp/w bash scripts/gpu_wheels.sh   # this machine's Python (the rehearsal)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYVER="${PYVER:-3.12}"
WHL="${WHL:-$ROOT/.whl}"
# jaxloop's needs beyond the image (clu.metrics, grain iterators, TensorBoard writers) and
# theirs; the image's own packages bring their own needs.
NAMES=(clu ml-collections grain array-record portpicker tensorboardx importlib-resources)
PY="${PYTHON:-python3}"
mkdir -p "$WHL"
pins=()
for name in "${NAMES[@]}"; do
  pin="$(grep -i -E "^${name}==" "$ROOT/constraints.txt" || true)"
  pins+=("${pin:-$name}")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$WHL" "${pins[@]}"
ls "$WHL"
