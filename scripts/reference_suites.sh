#!/usr/bin/env bash
# Runs google/jaxloop's own test suites (core and trainers) and its notebooks against this
# checkout's jaxloop, outside the repository.
#
#   bash scripts/reference_suites.sh SNAPSHOT [WORKDIR]
#
# SNAPSHOT: a google/jaxloop checkout or `git archive` of one (it has src/jaxloop and
# notebooks/). WORKDIR (default /tmp/jaxloop-refsuite) receives copies of its tests and
# notebooks and the logs; nothing is written into this repository. The counts are the last
# lines. docs/compatibility.md lists the failures that are deliberate differences.
# The Transformer notebook is skipped: it downloads Gemma weights. The other notebooks run
# as written but for three edits: Colab's adhoc_import lines go, `tfds.load` reads
# tfds.testing.mock_data, and plots go to matplotlib's Agg backend.
set -uo pipefail

SNAPSHOT=$(cd "${1:?usage: reference_suites.sh SNAPSHOT [WORKDIR]}" && pwd)
WORK=${2:-/tmp/jaxloop-refsuite}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python)

rm -rf "$WORK" && mkdir -p "$WORK/core" "$WORK/trainers" "$WORK/notebooks" "$WORK/site"
SRC=$SNAPSHOT/src/jaxloop
cp "$SRC"/*_test.py "$WORK/core/"
mkdir -p "$WORK/core/tests" "$WORK/core/step_number_writer"
cp "$SRC"/tests/*_test.py "$WORK/core/tests/"
# It downloads MNIST (tfds.load with a data_dir of its own, which tfds' mock data does not
# serve); run it where the network is reachable by deleting this line.
rm "$WORK/core/tests/mnist_test.py"
cp "$SRC"/step_number_writer/*_test.py "$WORK/core/step_number_writer/"
cp "$SRC"/trainers/*_test.py "$WORK/trainers/"
cp "$SNAPSHOT"/notebooks/*.ipynb "$WORK/notebooks/"
# google/jaxloop's tests, code and notebooks use jaxtyping and chex (with toolz), which this
# package does not need; installed without dependencies so the environment's jax is the one.
for module in jaxtyping wadler_lindig chex toolz; do
    "$PY" -c "import $module" 2>/dev/null || "$PY" -m pip install -q --no-deps \
        --target "$WORK/site" "${module/_/-}" >/dev/null 2>&1
done
# tests/actions_test.py matches a call argument with Google's internal
# google3.testing.pymocks.matchers.IS(predicate): an object equal to what satisfies it.
mkdir -p "$WORK/site/google3/testing/pymocks"
touch "$WORK/site/google3/__init__.py" "$WORK/site/google3/testing/__init__.py" \
    "$WORK/site/google3/testing/pymocks/__init__.py"
cat >"$WORK/site/google3/testing/pymocks/matchers.py" <<'PY'
class IS:
    def __init__(self, predicate):
        self.predicate = predicate

    def __eq__(self, other):
        return bool(self.predicate(other))
PY
# Its tests are absltest modules, run here by pytest: parse absl's flags (their defaults, as
# absltest.main does) before they read --test_tmpdir; loop_test.py imports typing.override,
# which Python 3.11 lacks (typing_extensions has it).
cat >"$WORK/conftest.py" <<'PY'
import typing

import typing_extensions
from absl import flags

flags.FLAGS(["pytest"], known_only=True)
if not hasattr(typing, "override"):
    typing.override = typing_extensions.override
PY
export PYTHONPATH=$REPO:$WORK/site JAX_PLATFORMS=cpu

# As its tests expect (partition_test.py: "sharded onto 8 TPU cores"), 8 devices.
for suite in core trainers; do
    (cd "$WORK" && XLA_FLAGS=--xla_force_host_platform_device_count=8 "$PY" -m pytest -q \
        -p no:cacheprovider -p no:randomly --import-mode=importlib "$suite" \
        >"$WORK/$suite.log" 2>&1)
done

"$PY" - "$WORK/notebooks" >"$WORK/notebooks.log" 2>&1 <<'EOF'
import pathlib
import re
import sys
import textwrap

import nbclient
import nbformat

PRELUDE = """
import matplotlib
matplotlib.use('Agg')
import tensorflow_datasets as tfds
_mock = tfds.testing.mock_data(num_examples=512)
_mock.__enter__()
"""


def as_written(source: str) -> str:
    """The cell without Colab's adhoc_import (its `with` blocks' bodies dedented)."""
    out, lines, i = [], source.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"\s*from colabtools import adhoc_import", line):
            i += 1
            continue
        if re.match(r"\s*with adhoc_import\.", line):
            indent = len(line) - len(line.lstrip())
            body = []
            i += 1
            while i < len(lines) and (not lines[i].strip() or
                                      len(lines[i]) - len(lines[i].lstrip()) > indent):
                body.append(lines[i])
                i += 1
            out += textwrap.indent(textwrap.dedent("\n".join(body)), " " * indent).splitlines()
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


passed = failed = 0
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.ipynb")):
    if "Transformer" in path.name:
        print(f"SKIPPED {path.name}: downloads Gemma weights")
        continue
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = as_written(cell.source)
    nb.cells.insert(0, nbformat.v4.new_code_cell(PRELUDE))
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3").execute()
    except Exception as e:  # noqa: BLE001 (the notebook's error is the result)
        failed += 1
        print(f"FAILED {path.name}: {type(e).__name__}: {str(e)[-2000:]}")
    else:
        passed += 1
        print(f"PASSED {path.name}")
print(f"notebooks: {passed} passed, {failed} failed")
EOF

echo "google/jaxloop at $(git -C "$SNAPSHOT" rev-parse HEAD 2>/dev/null || echo "$SNAPSHOT")"
for suite in core trainers; do
    echo "$suite: $(tail -n 1 "$WORK/$suite.log")"
done
tail -n 1 "$WORK/notebooks.log"
echo "logs: $WORK/{core,trainers,notebooks}.log"
