"""A user's own grain pipeline with worker processes (``mp_prefetch``), given to `OuterLoop`
as its train and eval datasets, in a script and in a notebook where nobody set up absl's
flags (grain reads one as it starts its workers): it trains, resumes exactly, and the script
exits without tracebacks from the workers (grain's finalizer printed ``OSError: handle is
closed`` for each after a resume)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP
from user_pipeline_job import pipeline

from jaxloop import outer_loop, train_loop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

JOB = Path(__file__).resolve().parent / "user_pipeline_job.py"
FINAL = re.compile(r"^final step=(\d+) fingerprint=([0-9a-f]{64})$", re.M)


def run_job(workdir: Path, total: int) -> tuple[int, str]:
    done = subprocess.run([sys.executable, str(JOB), str(workdir), str(total)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # Nothing the workers or their clean-up print: no traceback of any kind.
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    found = FINAL.findall(done.stdout)
    assert found, done.stdout[-2000:]
    return int(found[-1][0]), found[-1][1]


def fingerprint(params) -> str:
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
    return digest.hexdigest()


def test_a_script_trains_on_its_own_worker_pipelines_resumes_exactly_and_exits_cleanly(
        tmp_path):
    assert run_job(tmp_path, 20)[0] == 20
    step, resumed = run_job(tmp_path, 30)  # the second run resumes at step 20
    assert step == 30
    # The same 30 steps uninterrupted, the same batches read in this process.
    train = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                           train=True)
    state, _ = outer_loop.OuterLoop(train_loop.TrainLoop(train))(
        train.initialize_model([1, 16]), pipeline(256, 1, workers=0), train_total_steps=30,
        train_loop_steps=10)
    assert resumed == fingerprint(state.params)


nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from test_notebooks import kernel_env  # noqa: E402, F401 (the fixture: a kernel on this Python)

CELL = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax, optax
    from models import ClassifierStep, LinenMLP
    from user_pipeline_job import pipeline
    from jaxloop import actions, eval_loop, outer_loop, train_loop

    class Evaluated(actions.Action):
        steps = []

        def __call__(self, state, outputs, **kwargs):
            self.steps.append(int(state.step))

    train = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    outer = outer_loop.OuterLoop(
        train_loop.TrainLoop(train),
        eval_loops=[eval_loop.EvalLoop(ClassifierStep(jax.random.key(0), LinenMLP()),
                                       end_actions=[Evaluated()])])
    state, _ = outer(train.initialize_model([1, 16]), pipeline(256, 1), train_total_steps=10,
                     train_loop_steps=5,
                     eval_specs=[outer_loop.EvalSpec(pipeline(64, 2), num_steps=2,
                                                     eval_loop_interval=2)])
    print("trained to", int(state.step), "evaluated at", Evaluated.steps)
""")


@pytest.mark.usefixtures("kernel_env")
def test_a_notebook_trains_and_evaluates_on_its_own_worker_pipelines(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        CELL.format(tests=str(Path(__file__).parent)))])
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.output_type == "stream")
    assert "trained to 10 evaluated at [10]" in text, text[-2000:]
