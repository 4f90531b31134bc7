#!/usr/bin/env bash
# The full test suite: lint, then the TensorFlow-free tier with TensorFlow blocked from import,
# then the tier that needs TensorFlow.
set -euo pipefail
cd "$(dirname "$0")/.."
JAXLOOP_EXTRAS=tf,examples,test source scripts/env.sh
ruff check jaxloop tests benchmarks
# Two xdist workers: one runs the multi-process jobs in turn, the other the rest (see
# tests/conftest.py).
JAXLOOP_BLOCK_TF=1 pytest -m "not tf" -n 2 --dist loadgroup "$@"
pytest -m tf -n 2 --dist loadgroup "$@"
