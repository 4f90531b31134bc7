#!/usr/bin/env bash
# The main job: trains the digits example and prints its results.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
python -m jaxloop.examples.digits "$@"
