#!/usr/bin/env bash
# JupyterLab on notebooks/, in .venv with the notebooks extra (a kernel, the progress bar's
# widget, matplotlib, TensorBoard, JupyterLab), from a fresh clone. Arguments go to JupyterLab
# (e.g. --no-browser --port 8889).
set -euo pipefail
cd "$(dirname "$0")/.."
JAXLOOP_EXTRAS=examples,notebooks source scripts/env.sh
exec jupyter lab notebooks "$@"
