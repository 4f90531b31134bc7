"""The main job: the digits example trains to >= 0.95 held-out accuracy and prints its line,
and resumes the checkpoints of the previous release."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FINAL = re.compile(
    r"^final step=(\d+) eval_accuracy=([0-9.]+) eval_loss=([0-9.]+) fingerprint=([0-9a-f]{64})$"
)


def optimized_env(**extra):
    """This process's environment with XLA's optimisation passes back on (tests/conftest.py
    turns them off): a job that trains hundreds of steps runs more than it compiles."""
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "")
    return {**os.environ, "XLA_FLAGS": flags.strip(), **extra}


def run_digits(workdir, *flags, env=None):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxloop.examples.digits", "--workdir", str(workdir), *flags],
        capture_output=True, text=True, timeout=600, env=optimized_env() if env is None else env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The job's result line, wherever it is: other libraries may print lines of their own.
    matches = [m for m in map(FINAL.match, proc.stdout.splitlines()) if m]
    assert matches, proc.stdout[-2000:]
    match = matches[-1]
    return int(match.group(1)), float(match.group(2)), float(match.group(3)), match.group(4)


def test_digits_default_run_meets_accuracy(tmp_path):
    step, accuracy, loss, _ = run_digits(tmp_path)
    assert step == 600
    assert accuracy >= 0.95 and loss < 0.3
    assert os.listdir(tmp_path / "train") and os.listdir(tmp_path / "eval")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["400", "500", "600"]
    assert (tmp_path / "checkpoints.STOPPED").exists()


@pytest.mark.parametrize("partitioner", ["single", "fsdp"])
def test_digits_other_partitioners(tmp_path, partitioner):
    step, accuracy, _, _ = run_digits(
        tmp_path, "--partitioner", partitioner, "--train-steps", "200",
        "--train-loop-steps", "100")
    assert step == 200 and accuracy > 0.9


def test_digits_rejects_bad_flags(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxloop.examples.digits", "--workdir", str(tmp_path),
         "--train-steps", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--train-steps must be positive" in proc.stderr


TESTS = Path(__file__).resolve().parent


def test_digits_resumes_a_checkpoint_of_the_previous_release(tmp_path):
    """tests/data/digits-0d51892 holds the step-50 checkpoint that jaxloop 0d51892 wrote for
    this job (its data position inside the old layout's JSON item; see its README). The
    same command with --train-steps 100 resumes it and finishes."""
    shutil.copytree(TESTS / "data" / "digits-0d51892" / "checkpoints", tmp_path / "checkpoints")
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(TESTS / "multihost_job.py"), "digits", str(results),
         "--workdir", str(tmp_path), "--train-steps", "100", "--train-loop-steps", "50",
         "--batch-size", "64"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((results / "result-0.json").read_text())
    assert result["restored_step"] == 50 and result["step"] == 100
    assert result["eval_accuracy"] > 0.9
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["100", "50"]
    assert (tmp_path / "checkpoints.STOPPED").exists()
