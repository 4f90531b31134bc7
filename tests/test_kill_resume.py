"""Real processes killed and restarted: the digits job ends bit-identical to an uninterrupted run.

SIGKILL lands during a checkpoint write, during start-up and mid-loop; SIGTERM makes the job
save at the next step boundary and exit 143. Re-running the same command resumes.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxloop import checkpoint

pytestmark = pytest.mark.slow

ARGS = ["--train-steps", "300", "--train-loop-steps", "25", "--batch-size", "32"]
FINAL = re.compile(r"final step=(\d+) .* fingerprint=([0-9a-f]{64})")


def start(workdir):
    return subprocess.Popen(
        [sys.executable, "-m", "jaxloop.examples.digits", "--workdir", str(workdir), *ARGS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def fingerprint_of(workdir):
    code, out, err = finish(start(workdir))
    assert code == 0, err[-3000:]
    match = FINAL.search(out)
    assert match, out
    return int(match.group(1)), match.group(2)


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
    code, _, err = finish(proc)
    assert code == 143, err[-3000:]
    stopped = int(re.search(r"Preempted at step (\d+)", err).group(1))
    assert 25 <= stopped < 300
    assert max(checkpoint.all_steps(tmp_path / "checkpoints")) == stopped
    assert not (tmp_path / "checkpoints" / "STOPPED").exists()
    assert fingerprint_of(tmp_path) == uninterrupted
