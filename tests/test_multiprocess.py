"""Multi-process training on one machine: 2 processes x 4 CPU devices behave like 1 x 8.

Every test starts real processes that talk over 127.0.0.1 (gloo collectives, JAX's
coordination service), so they are all marked slow. Each process gets its own
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and ``JAX_PLATFORMS=cpu``; the
inherited flags (conftest forces 8 devices) are removed first.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest

from jaxloop import distributed

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
FINAL = re.compile(
    r"^final step=(\d+) eval_accuracy=([0-9.]+) eval_loss=([0-9.]+) fingerprint=([0-9a-f]{64})$"
)
STEPS = ("--train-steps", "200", "--train-loop-steps", "100", "--batch-size", "64")
RUN_TIMEOUT = 300  # seconds for one digits run (all its processes)
# Short failure timeouts, so a broken run fails the test instead of hanging it.
HEARTBEAT_TIMEOUT = 30
SHUTDOWN_TIMEOUT = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items()
        if k != "XLA_FLAGS" and not k.startswith(("JAXLOOP_", "JAX_COORDINATOR"))
    }
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        JAXLOOP_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT),
        JAXLOOP_SHUTDOWN_TIMEOUT=str(SHUTDOWN_TIMEOUT),
    )
    env.update(extra)
    return env


class Finished(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def started(
    commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], logdir: Path
) -> Iterator[list[subprocess.Popen]]:
    """Starts one process per command (output to files, so no pipe can fill up and block);
    kills whatever is still running on the way out."""
    logdir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for i, (cmd, env) in enumerate(zip(commands, envs, strict=True)):
            out = open(logdir / f"p{i}.out", "w")
            err = open(logdir / f"p{i}.err", "w")
            files += [out, err]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=REPO))
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        for f in files:
            f.close()


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]


GLOO_LINE = re.compile(r"\[Gloo\]|connected to \d+ peer ranks")


def _program_output(text: str) -> str:
    # gloo's C++ threads print their connection set-up to stdout, sometimes interleaved
    # mid-line; keep only the program's own lines.
    return "".join(line for line in text.splitlines(True) if not GLOO_LINE.search(line))


def read_logs(logdir: Path, n: int) -> list[Finished]:
    return [
        Finished(
            -1,
            _program_output((logdir / f"p{i}.out").read_text()),
            (logdir / f"p{i}.err").read_text(),
        )
        for i in range(n)
    ]


class Result(NamedTuple):
    step: int
    accuracy: float
    loss: float
    fingerprint: str
    stderr: str


def run_digits(workdir: Path, *flags: str, processes: int = 2) -> Result:
    """Runs the digits job as `processes` processes (4 devices each) or, with 1, as one
    process with 8 devices; returns process 0's final line."""
    base = [sys.executable, "-m", "jaxloop.examples.digits", "--workdir", str(workdir), *flags]
    if processes == 1:
        commands, envs = [base], [process_env(8)]
    else:
        port = free_port()
        commands = [
            [*base, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
             "--process-id", str(i)]
            for i in range(processes)
        ]
        envs = [process_env(4)] * processes
    logdir = workdir.parent / f"{workdir.name}-logs-{time.monotonic_ns()}"
    with started(commands, envs, logdir) as procs:
        try:
            codes = wait_all(procs, RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            codes = [p.poll() for p in procs]
        logs = read_logs(logdir, len(procs))
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{log.stderr[-4000:]}"
    lines = logs[0].stdout.strip().splitlines()
    match = FINAL.match(lines[-1]) if lines else None
    assert match, f"process 0 printed no final line: {logs[0].stdout[-2000:]}"
    for log in logs[1:]:
        assert not log.stdout.strip(), f"a non-main process printed: {log.stdout[-500:]}"
    return Result(
        int(match.group(1)), float(match.group(2)), float(match.group(3)), match.group(4),
        logs[0].stderr,
    )


@pytest.fixture(scope="module")
def dp_two_processes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    workdir = tmp_path_factory.mktemp("dp2") / "work"
    return run_digits(workdir, "--partitioner", "dp", *STEPS), workdir


@pytest.fixture(scope="module")
def dp_one_process(tmp_path_factory: pytest.TempPathFactory) -> Result:
    workdir = tmp_path_factory.mktemp("dp1") / "work"
    return run_digits(workdir, "--partitioner", "dp", *STEPS, processes=1)


def test_two_processes_train_and_checkpoint_together(dp_two_processes):
    result, workdir = dp_two_processes
    assert result.step == 200 and result.accuracy > 0.9
    # One set of checkpoints and event files, written jointly / by process 0 only.
    assert sorted(os.listdir(workdir / "checkpoints")) == ["100", "200", "STOPPED"]
    assert os.listdir(workdir / "train") and os.listdir(workdir / "eval")


def test_two_processes_match_one_process_with_eight_devices(dp_two_processes, dp_one_process):
    two, _ = dp_two_processes
    one = dp_one_process
    assert one.step == two.step == 200
    # Same global batches, seed and steps: only the order of floating-point reductions
    # (gloo across processes vs in-process all-reduce) differs, so the fingerprints may differ.
    assert abs(one.loss - two.loss) < 1e-4, (one, two)
    print(f"1x8: loss={one.loss} {one.fingerprint}\n2x4: loss={two.loss} {two.fingerprint}")


def test_two_processes_fsdp_matches_dp(dp_two_processes, tmp_path):
    dp, _ = dp_two_processes
    fsdp = run_digits(tmp_path / "work", "--partitioner", "fsdp", *STEPS)
    assert fsdp.step == 200
    assert abs(fsdp.loss - dp.loss) < 1e-4, (fsdp, dp)
    print(f"fsdp: loss={fsdp.loss} {fsdp.fingerprint}\ndp:   loss={dp.loss} {dp.fingerprint}")


def test_resume_under_two_processes_and_under_one(dp_two_processes, tmp_path):
    uninterrupted, _ = dp_two_processes
    workdir = tmp_path / "work"
    first = run_digits(workdir, "--partitioner", "dp", *STEPS[:1], "100", *STEPS[2:])
    assert first.step == 100
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)

    resumed = run_digits(workdir, "--partitioner", "dp", *STEPS)
    assert "Restored checkpoint step 100" in resumed.stderr
    assert resumed.step == 200
    assert resumed.fingerprint == uninterrupted.fingerprint
    assert resumed.loss == uninterrupted.loss

    # The 2-process checkpoint restores into a 1-process, 8-device run.
    single = run_digits(copy, "--partitioner", "dp", *STEPS, processes=1)
    assert "Restored checkpoint step 100" in single.stderr
    assert single.step == 200
    assert abs(single.loss - uninterrupted.loss) < 1e-4, (single, uninterrupted)


# A small job: every iteration all-reduces across both processes.
WORKER = textwrap.dedent(
    """
    import os, time
    from jaxloop import distributed
    distributed.initialize()
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.ones(4, np.float32))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    assert float(total(x)) == 8.0, float(total(x))
    print("ready", jax.process_index(), jax.process_count(), jax.device_count(), flush=True)
    start = time.monotonic()
    steps = int(os.environ.get("STEPS", "0"))  # 0: forever
    for _ in iter(int, 1) if not steps else range(steps):
        float(total(x))
        if os.environ.get("RAISE_IN") == str(jax.process_index()) and time.monotonic() > start + 2:
            raise RuntimeError("simulated failure")
    """
)
FAILURE_HEARTBEAT = 10
FAILURE_SHUTDOWN = 10
FAILURE_BOUND = 60  # seconds from the failure to the survivor's exit


def wait_for_ready(logdir: Path, n: int, procs: Sequence[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all("ready" in (logdir / f"p{i}.out").read_text() for i in range(n)):
            return
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead, f"a worker exited early: {read_logs(logdir, n)}"
        time.sleep(0.2)
    pytest.fail("workers did not get ready in 120 s")


@pytest.mark.parametrize(
    "failure, survivor",
    [("kill-worker", 0), ("kill-coordinator", 1), ("worker-raises", 0)],
)
def test_survivor_exits_when_a_peer_fails(tmp_path, failure, survivor):
    port = free_port()
    envs = [
        process_env(
            4, JAXLOOP_COORDINATOR=f"127.0.0.1:{port}", JAXLOOP_NUM_PROCESSES="2",
            JAXLOOP_PROCESS_ID=str(i), JAXLOOP_HEARTBEAT_TIMEOUT=str(FAILURE_HEARTBEAT),
            JAXLOOP_SHUTDOWN_TIMEOUT=str(FAILURE_SHUTDOWN),
            **({"RAISE_IN": "1"} if failure == "worker-raises" else {}),
        )
        for i in range(2)
    ]
    commands = [[sys.executable, "-c", WORKER]] * 2
    with started(commands, envs, tmp_path) as procs:
        wait_for_ready(tmp_path, 2, procs)
        if failure.startswith("kill"):
            os.kill(procs[1 - survivor].pid, signal.SIGKILL)
        start = time.monotonic()
        try:
            code = procs[survivor].wait(timeout=FAILURE_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{failure}: process {survivor} still running after {FAILURE_BOUND} s")
        elapsed = time.monotonic() - start
        err = read_logs(tmp_path, 2)[survivor].stderr
    print(f"{failure}: process {survivor} exited {code} after {elapsed:.1f} s")
    assert code != 0, err[-3000:]
    assert "distributed service detected fatal errors" in err, err[-3000:]


def test_initialize_detects_a_slurm_job(tmp_path):
    """With no arguments JAX reads SLURM's variables (the port derives from the job id)."""
    for job_id in range(4000, 0, -37):  # port 61440 + job_id % 4096, outside Linux's
        port = 61440 + job_id  # ephemeral range
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            break
    envs = [
        process_env(
            4, STEPS="5", SLURM_JOB_ID=str(job_id), SLURM_STEP_NODELIST="127.0.0.1",
            SLURM_NTASKS="2", SLURM_PROCID=str(i), SLURM_LOCALID=str(i),
        )
        for i in range(2)
    ]
    with started([[sys.executable, "-c", WORKER]] * 2, envs, tmp_path) as procs:
        codes = wait_all(procs, 120)
        logs = read_logs(tmp_path, 2)
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        assert code == 0, log.stderr[-3000:]
        assert log.stdout.split() == ["ready", str(i), "2", "8"], log.stdout


def test_initialize_single_process_job_is_idempotent(tmp_path):
    """Runs in a fresh process: initialising needs a JAX whose backends are not up yet."""
    script = textwrap.dedent(
        """
        import os, jax
        from jaxloop import distributed
        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("JAXLOOP_")}
        try:  # no address and no cluster to detect one from
            distributed.initialize(num_processes=2, process_id=1)
        except ValueError as e:
            assert "not given coordinator_address, and JAX found no cluster" in str(e), e
        else:
            raise AssertionError("initialised without an address")
        distributed.initialize(num_processes=1)  # a 1-process job: nothing to do
        assert not distributed.is_initialized()
        os.environ.update(saved)
        address = os.environ["JAXLOOP_COORDINATOR"]
        distributed.initialize()  # everything from the environment
        assert distributed.is_initialized()
        assert jax.config.jax_cpu_collectives_implementation == "gloo"
        distributed.initialize()  # no-op
        distributed.initialize(address, 1, 0)  # no-op: same settings
        host, port = address.rsplit(":", 1)
        try:
            distributed.initialize(f"{host}:{int(port) + 1}", 1, 0)
        except RuntimeError as e:
            assert "already initialised with other settings" in str(e), e
        else:
            raise AssertionError("different settings were accepted")
        assert jax.process_count() == 1 and distributed.is_main_process()
        distributed.shutdown()
        assert not distributed.is_initialized()
        try:
            distributed.initialize(address, 1, 0)
        except RuntimeError as e:
            assert "must run before any JAX computation" in str(e), e
        else:
            raise AssertionError("initialised after the backends were up")
        print("ok")
        """
    )
    env = process_env(
        1, JAXLOOP_COORDINATOR=f"127.0.0.1:{free_port()}", JAXLOOP_NUM_PROCESSES="1",
        JAXLOOP_PROCESS_ID="0",
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize(
    "args, error, message",
    [
        (("127.0.0.1", 2, 0), ValueError, "'127.0.0.1'"),
        (("127.0.0.1:0", 2, 0), ValueError, "'127.0.0.1:0'"),
        (("127.0.0.1:70000", 2, 0), ValueError, "'127.0.0.1:70000'"),
        (("http://host:1234", 2, 0), ValueError, "'http://host:1234'"),
        (("127.0.0.1:1234", 2, 2), ValueError, "process_id=2"),
        (("127.0.0.1:1234", 2, -1), ValueError, "got -1"),
        (("127.0.0.1:1234", 0, 0), ValueError, "num_processes must be >= 1, got 0"),
        (("127.0.0.1:1234", "2", 0), TypeError, "'2'"),
        ((1234, 2, 0), TypeError, "1234"),
    ],
)
def test_initialize_rejects_bad_arguments(args, error, message):
    with pytest.raises(error, match=re.escape(message)):
        distributed.initialize(*args, initialization_timeout=1)


def test_initialize_rejects_bad_environment(monkeypatch):
    monkeypatch.setenv("JAXLOOP_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("JAXLOOP_NUM_PROCESSES", "two")
    monkeypatch.setenv("JAXLOOP_PROCESS_ID", "0")
    with pytest.raises(ValueError, match="JAXLOOP_NUM_PROCESSES='two'"):
        distributed.initialize(initialization_timeout=1)
    monkeypatch.setenv("JAXLOOP_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXLOOP_PROCESS_ID", "5")
    with pytest.raises(ValueError, match="process_id=5"):
        distributed.initialize(initialization_timeout=1)
