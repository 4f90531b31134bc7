#!/usr/bin/env bash
# The main job: trains the digits example and prints its results.
set -euo pipefail
cd "$(dirname "$0")/.."
JAXLOOP_EXTRAS=examples source scripts/env.sh  # the example's needs only
python -m jaxloop.examples.digits "$@"
