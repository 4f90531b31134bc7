#!/usr/bin/env bash
# Creates (or reuses) .venv with the pinned versions in constraints.txt and the extras in
# JAXLOOP_EXTRAS (the main job sets "examples"; the notebooks "examples,notebooks"; the tests
# "tf,examples,test", which holds the notebooks').
# Sourced by the two set-up commands; installs again only when the pins, pyproject or the
# extras asked for change.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
extras="${JAXLOOP_EXTRAS:-tf,examples,test}"
stamp="$venv/.jaxloop-installed-${extras//,/-}"
want="$(cat "$root/constraints.txt" "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip "uv==0.13.8"
  "$venv/bin/uv" pip install -q --python "$venv/bin/python" -c "$root/constraints.txt" \
    -e "$root[$extras]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
# Python caches compiled modules in __pycache__; where the environment turns that off, every
# process (each test subprocess, each host of a multi-process test) recompiles jax, flax and the
# rest from source: about 6 s of CPU per process on this machine's 2 cores.
unset PYTHONDONTWRITEBYTECODE
