"""Importing the step or the train loop loads no checkpointing (orbax) nor data (grain)
library; the package's names still come when asked for.

Each scenario is a user's fresh interpreter (``python -c``), since an import already made by
another test would hide what the import itself loads.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jaxloop

# The interpreter starts where it imports the jaxloop under test (``-c`` puts its working
# directory first on the path).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxloop.__file__)))

# The heavy libraries a script that only builds a step and trains it should not pay for.
_HEAVY = "('orbax', 'grain')"

_NOT_LOADED = (
    "import sys\n"
    "loaded = sorted({m.split('.')[0] for m in sys.modules} & set(" + _HEAVY + "))\n"
    "assert not loaded, f'{loaded} imported'\n"
)


def _run_script(code: str) -> None:
    """Runs `code` as a user's script in a fresh interpreter; fails with its error."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code + "print('ok')\n"], env=env,
                          cwd=_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize("module", ["jaxloop.step", "jaxloop.train_loop"])
def test_importing_the_step_or_train_loop_loads_neither_orbax_nor_grain(module):
    # The user's script: import the module, then (after the check) the package's names
    # and the checkpoint action are there as before, loaded on first use.
    code = (
        f"import {module}\n"
        + _NOT_LOADED
        + "import jaxloop\n"
        "from jaxloop import CheckpointAction, TrainLoop, actions\n"
        "assert jaxloop.CheckpointAction is CheckpointAction is actions.CheckpointAction\n"
        "assert jaxloop.checkpointing.checkpoint_actions.CheckpointAction is CheckpointAction\n"
        "assert jaxloop.TrainLoop is TrainLoop and jaxloop.train_loop.TrainLoop is TrainLoop\n"
        "assert 'orbax' in sys.modules  # loaded by the first use of the checkpoint action\n"
        "assert {'CheckpointAction', 'OuterLoop', 'outer_loop'} <= set(dir(jaxloop))\n"
        "assert {'CheckpointAction', 'ProgressAction'} <= set(dir(actions))\n"
    )
    _run_script(code)


def test_every_exported_name_of_the_package_and_actions_resolves():
    # `from jaxloop import *` and each name of `jaxloop.__all__` / `actions.__all__`, in a
    # fresh interpreter; a name no module defines is a clear AttributeError.
    code = (
        "import jaxloop\n"
        "from jaxloop import *  # noqa\n"
        "from jaxloop import actions\n"
        "for mod in (jaxloop, actions):\n"
        "    missing = [n for n in mod.__all__ if getattr(mod, n, None) is None]\n"
        "    assert not missing, missing\n"
        "assert StepNumberAction is actions.StepNumberAction\n"
        "assert actions.ProgressAction.__module__ == 'jaxloop.metrics.progress'\n"
        "for mod, name in ((jaxloop, 'NoSuchName'), (actions, 'NoSuchAction')):\n"
        "    try:\n"
        "        getattr(mod, name)\n"
        "    except AttributeError as e:\n"
        "        assert name in str(e) and mod.__name__ in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(f'no error for {mod.__name__}.{name}')\n"
    )
    _run_script(code)
