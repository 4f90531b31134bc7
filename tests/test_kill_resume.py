"""Real processes killed and restarted: the digits job ends bit-identical to an uninterrupted run.

SIGKILL lands during a checkpoint write, during start-up and mid-loop; SIGTERM makes the job
save at the next step boundary and exit 143. Re-running the same command resumes.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxloop.checkpointing import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ARGS = ["--train-steps", "300", "--train-loop-steps", "25", "--batch-size", "32"]
JOB = Path(__file__).resolve().parent / "multihost_job.py"


def results_dir(workdir):
    return workdir.parent / f"{workdir.name}-results"


def start(workdir):
    """The digits job through tests/multihost_job.py, which writes its results to a file
    (never parsed from the output streams)."""
    results = results_dir(workdir)
    results.mkdir(exist_ok=True)
    (results / "result-0.json").unlink(missing_ok=True)
    return subprocess.Popen(
        [sys.executable, str(JOB), "digits", str(results), "--workdir", str(workdir), *ARGS],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def finish(proc, timeout=300):
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def result_of(workdir):
    return json.loads((results_dir(workdir) / "result-0.json").read_text())


def fingerprint_of(workdir):
    code, err = finish(start(workdir))
    assert code == 0, err[-3000:]
    result = result_of(workdir)
    return result["step"], result["fingerprint"]


def wait_for(predicate, proc, timeout=240, poll=0.002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    raise TimeoutError("condition not reached")


def kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return fingerprint_of(tmp_path_factory.mktemp("uninterrupted"))


def test_sigkill_at_several_moments_then_resume(tmp_path, uninterrupted):
    ckpt = tmp_path / "checkpoints"

    def writing():
        return ckpt.exists() and any("tmp" in name for name in os.listdir(ckpt))

    # 1. During a checkpoint write (orbax writes into a tmp directory, then renames it).
    proc = start(tmp_path)
    caught = wait_for(writing, proc)
    kill(proc)
    assert caught, "the job finished before a checkpoint write was caught"
    done_before = checkpoint.all_steps(ckpt)
    # 2. During start-up of the next run (restore, compilation).
    proc = start(tmp_path)
    time.sleep(1.0)
    kill(proc)
    # 3. Mid-training, after two more checkpoints completed.
    proc = start(tmp_path)
    target = (max(done_before) if done_before else 0) + 50
    wait_for(lambda: any(s >= target for s in checkpoint.all_steps(ckpt)), proc)
    time.sleep(0.1)
    kill(proc)
    assert max(checkpoint.all_steps(ckpt)) < 300
    # 4. The same command finishes the run.
    assert fingerprint_of(tmp_path) == uninterrupted


def test_sigterm_saves_exits_143_and_resumes(tmp_path, uninterrupted):
    proc = start(tmp_path)
    wait_for(lambda: 25 in checkpoint.all_steps(tmp_path / "checkpoints"), proc, poll=0.01)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 143, err[-3000:]
    stopped = result_of(tmp_path)["preempted_step"]
    assert 25 <= stopped < 300
    assert max(checkpoint.all_steps(tmp_path / "checkpoints")) == stopped
    assert not (tmp_path / "checkpoints.STOPPED").exists()  # not finished: no marker
    assert not (tmp_path / "checkpoints" / "STOPPED").exists()
    assert fingerprint_of(tmp_path) == uninterrupted
    # Finished: the marker lies beside the directory, which holds step folders only.
    assert (tmp_path / "checkpoints.STOPPED").exists()
    assert all(name.isdigit() for name in os.listdir(tmp_path / "checkpoints"))
