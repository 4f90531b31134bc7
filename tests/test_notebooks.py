"""The notebooks run top to bottom in a fresh kernel, print what they promise, and are saved
without outputs.

Each notebook is executed with nbclient in a kernel started from this interpreter (a
kernelspec written to a temporary directory, so a user-level ``python3`` kernelspec that
points at another Python cannot be picked up). The kernel inherits the test environment,
including the 8 forced CPU devices from conftest.
"""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["01_quick_start", "02_intermediate", "03_custom_loop_and_action", "04_simple_trainer",
         "05_keep_your_state", "06_nnx"]

# Appended to the executed copy only: TensorFlow must stay out of the notebooks even where it
# is installed (the kernel does not inherit the TF-free tier's import block), and the kernel
# must run this interpreter.
_KERNEL_CHECK = (
    "import sys\n"
    "print('tensorflow imported:', 'tensorflow' in sys.modules)\n"
    "print('kernel python:', sys.executable)"
)


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A ``python3`` kernelspec that runs this interpreter, found first on JUPYTER_PATH."""
    prefix = tmp_path_factory.mktemp("jupyter")
    kernelspec.install(kernel_name="python3", prefix=str(prefix))
    spec_dir = prefix / "share" / "jupyter"
    argv = json.loads((spec_dir / "kernels" / "python3" / "kernel.json").read_text())["argv"]
    assert argv[0] == sys.executable, argv
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(spec_dir), old]))
    # Non-interactive plotting in the kernel (the notebooks' %matplotlib inline still works).
    old_backend = os.environ.get("MPLBACKEND")
    os.environ["MPLBACKEND"] = "Agg"
    yield
    for key, value in (("JUPYTER_PATH", old), ("MPLBACKEND", old_backend)):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def load(name):
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


def execute(name, workdir):
    """Runs the notebook in `workdir`; returns (all stdout text, list of output dicts, secs)."""
    nb = load(name)
    nb.cells.append(nbformat.v4.new_code_cell(_KERNEL_CHECK))
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and traceback, on an error
    seconds = time.perf_counter() - start
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    errors = [out for out in outputs if out.output_type == "error"]
    assert not errors, errors
    text = "".join(
        out.get("text", "") for out in outputs
        if out.output_type == "stream" and out.get("name") == "stdout"
    )
    assert f"kernel python: {sys.executable}\n" in text
    return text, outputs, seconds


def number(pattern, text):
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in:\n{text[-3000:]}"
    return float(match.group(1))


@pytest.mark.parametrize("name", NAMES)
def test_saved_notebook_is_clean(name):
    nb = load(name)
    nbformat.validate(nb)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
    sources = "\n".join(cell.source for cell in code)
    assert "IN_COLAB" in sources  # the Colab-only install cell
    assert "tensorflow" not in sources


@pytest.mark.slow
def test_01_quick_start(kernel_env, tmp_path):
    text, outputs, seconds = execute("01_quick_start", tmp_path)
    assert number(r"final eval accuracy: ([0-9.]+)", text) >= 0.9
    # outer.history: a train loss per step from 21 to 500, an evaluation per loop (at 70,
    # 120, ..., 470 and 500), and the plot draws them all.
    train_points = number(r"train loss points: (\d+)", text)
    eval_points = number(r"eval accuracy points: (\d+)", text)
    assert (train_points, eval_points) == (480, 10)
    plotted = re.search(r"plotted points: .*'accuracy': \[(\d+), (\d+)\]", text)
    assert plotted and tuple(map(int, plotted.groups())) == (eval_points, train_points), text
    assert number(r"(\d+) rows; the last:", text) > train_points
    pngs = [out for out in outputs
            if out.output_type == "display_data" and "image/png" in out.get("data", {})]
    assert pngs  # the history's plot, shown
    # log_num_params=True shows in a kernel where nobody configured logging, once.
    logged = "".join(out.get("text", "") for out in outputs
                     if out.output_type == "stream" and out.get("name") == "stderr")
    assert logged.count("Number of parameters: ") == 1, logged
    assert "tensorflow imported: False" in text
    print(f"01_quick_start ran in {seconds:.1f} s")


@pytest.mark.slow
def test_02_intermediate(kernel_env, tmp_path):
    text, outputs, seconds = execute("02_intermediate", tmp_path)
    assert number(r"devices: (\d+)", text) == 8
    dp = number(r"data parallel: ([0-9.]+) KiB per device", text)
    fsdp = number(r"FSDP: ([0-9.]+) KiB per device", text)
    assert fsdp < dp / 4, (dp, fsdp)
    assert number(r"largest loss difference FSDP vs DP: ([0-9.e+-]+)", text) < 1e-3
    assert number(r"checkpoints after the first run: \[.*?(\d+)\]", text) == 100
    assert number(r"resumed at step (\d+)", text) == 100
    assert number(r"finished at step (\d+)", text) == 150
    assert number(r"restored for evaluation: step (\d+)", text) == 150
    assert number(r"learning rate at step 200: ([0-9.e+-]+)", text) > 0
    stopped = number(r"early stopping at step (\d+) of 3000", text)
    assert 0 < stopped < 3000
    assert any("image/png" in out.get("data", {}) for out in outputs)
    assert "tensorflow imported: False" in text
    print(f"02_intermediate ran in {seconds:.1f} s")


@pytest.mark.slow
def test_03_custom_loop_and_action(kernel_env, tmp_path):
    text, _, seconds = execute("03_custom_loop_and_action", tmp_path)
    assert number(r"batches read in the loop: (\d+)", text) == 50
    assert number(r"confusion matrix total: (\d+)", text) == 359
    stopped = number(r"stopped at step (\d+) of 2000", text)
    assert stopped < 2000
    assert number(r"with eval accuracy ([0-9.]+)", text) >= 0.95
    # The best state the stopping action kept is readable after training went on.
    assert 0 < number(r"best kept state: step (\d+)", text) <= stopped
    # The action's context counted that step on the host.
    assert number(r"the context said (\d+)", text) == number(r"best kept state: step (\d+)", text)
    assert number(r"predictions: (\d+)", text) == 359
    assert "tensorflow imported: False" in text
    print(f"03_custom_loop_and_action ran in {seconds:.1f} s")


@pytest.mark.slow
def test_04_simple_trainer(kernel_env, tmp_path):
    text, outputs, seconds = execute("04_simple_trainer", tmp_path)
    assert number(r"trained to step (\d+)", text) == 1000
    assert number(r"initialised at step (\d+)", text) == 0
    assert number(r"finished at step (\d+)", text) == 1400  # resumed from step 1000
    assert number(r"sine held-out mse: ([0-9.]+)", text) < 0.01
    assert number(r"digits eval accuracy: ([0-9.]+)", text) >= 0.9
    assert number(r"on (\d+) images", text) == 360
    assert any("image/png" in out.get("data", {}) for out in outputs)
    assert "tensorflow imported: False" in text
    print(f"04_simple_trainer ran in {seconds:.1f} s")


@pytest.mark.slow
def test_05_keep_your_state(kernel_env, tmp_path):
    text, outputs, seconds = execute("05_keep_your_state", tmp_path)
    assert "state class: MetricsState" in text
    assert number(r"untrained still at step (\d+)", text) == 0
    assert number(r"untrained accuracy: ([0-9.]+)", text) < 0.3
    assert number(r"(?m)^trained accuracy: ([0-9.]+)", text) >= 0.9
    assert number(r"the first state is at step (\d+)", text) == 0
    assert number(r"continued to step (\d+)", text) == 250
    assert "passed-in state deleted: True" in text
    assert any("image/png" in out.get("data", {}) for out in outputs)
    assert "tensorflow imported: False" in text
    print(f"05_keep_your_state ran in {seconds:.1f} s")


@pytest.mark.slow
def test_06_nnx(kernel_env, tmp_path):
    text, _, seconds = execute("06_nnx", tmp_path)
    assert number(r"final eval accuracy: ([0-9.]+)", text) >= 0.9
    assert "caller's model unchanged: True" in text
    # The state's arrays in an nnx model give the evaluation's accuracy back.
    assert number(r"trained model accuracy: ([0-9.]+)", text) == number(
        r"final eval accuracy: ([0-9.]+)", text)
    assert "tensorflow imported: False" in text
    print(f"06_nnx ran in {seconds:.1f} s")
