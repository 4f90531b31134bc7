"""Multi-process training on one machine: 2 processes x 4 CPU devices behave like 1 x 8.

Every test starts real processes that talk over 127.0.0.1 (gloo collectives, JAX's
coordination service), so they are all marked slow. Each process gets its own
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` and ``JAX_PLATFORMS=cpu``; the
inherited flags (conftest forces 8 devices) are removed first.
"""

from __future__ import annotations

import contextlib
import json
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

import numpy as np
import pytest

from jaxloop.checkpointing import checkpoint
from jaxloop.launch import distributed

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[1]
STEPS = ("--train-steps", "100", "--train-loop-steps", "50", "--batch-size", "64")
RUN_TIMEOUT = 300  # seconds for one digits run (all its processes)
# Short failure timeouts, so a broken run fails the test instead of hanging it.
HEARTBEAT_TIMEOUT = 30
SHUTDOWN_TIMEOUT = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int, optimized: bool = False, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items()
        if k != "XLA_FLAGS" and not k.startswith(("JAXLOOP_", "JAX_COORDINATOR"))
    }
    env.update(
        # Unoptimised code, as in-process tests (tests/conftest.py), unless `optimized`:
        # most of these jobs compile more than they run.
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
                  + ("" if optimized else " --xla_backend_optimization_level=0"),
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


def read_logs(logdir: Path, n: int) -> list[Finished]:
    """The processes' output, for failure messages only: gloo's C++ threads write to
    stdout, even mid-line, so no test reads results from these streams. Results come
    from files the processes write (see tests/multihost_job.py)."""
    return [
        Finished(-1, (logdir / f"p{i}.out").read_text(), (logdir / f"p{i}.err").read_text())
        for i in range(n)
    ]


class Result(NamedTuple):
    step: int
    accuracy: float
    loss: float
    fingerprint: str
    restored_step: int | None


JOB = REPO / "tests" / "multihost_job.py"


def job_envs(processes: int, optimized: bool = False) -> list[dict[str, str]]:
    """The environments of a job's processes: `processes` x 4 CPU devices joined through a
    coordinator on a free local port, or, with 1, one process with 8 devices."""
    if processes == 1:
        return [process_env(8, optimized)]
    port = free_port()
    return [
        process_env(4, optimized, JAXLOOP_COORDINATOR=f"127.0.0.1:{port}",
                    JAXLOOP_NUM_PROCESSES=str(processes), JAXLOOP_PROCESS_ID=str(i))
        for i in range(processes)
    ]


def run_digits(workdir: Path, *flags: str, processes: int = 2, optimized: bool = False
               ) -> Result:
    """Runs the digits job as `processes` processes (4 devices each) or, with 1, as one
    process with 8 devices; returns its results (the same in every process)."""
    result_dir = workdir.parent / f"{workdir.name}-run-{time.monotonic_ns()}"
    command = [sys.executable, str(JOB), "digits", str(result_dir), "--workdir", str(workdir),
               *flags]
    envs = job_envs(processes, optimized)
    with started([command] * processes, envs, result_dir / "logs") as procs:
        try:
            codes = wait_all(procs, RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            codes = [p.poll() for p in procs]
        logs = read_logs(result_dir / "logs", processes)
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        assert code == 0, f"process {i} exited {code}:\n{log.stderr[-4000:]}"
    results = [json.loads((result_dir / f"result-{i}.json").read_text())
               for i in range(processes)]
    for other in results[1:]:
        assert other["fingerprint"] == results[0]["fingerprint"], results
    r = results[0]
    return Result(r["step"], r["eval_accuracy"], r["eval_loss"], r["fingerprint"],
                  r["restored_step"])


# The uninterrupted reference runs, made once per worker process: pytest tears a module
# fixture down whenever xdist hands the worker a test of another module in between, and
# would run them again.
_REFERENCE_RUNS: dict[int, tuple[Result, Path]] = {}


def reference_run(tmp_path_factory: pytest.TempPathFactory, processes: int) -> tuple[Result, Path]:
    if processes not in _REFERENCE_RUNS:
        workdir = tmp_path_factory.mktemp(f"dp{processes}") / "work"
        result = run_digits(workdir, "--partitioner", "dp", *STEPS, processes=processes)
        _REFERENCE_RUNS[processes] = result, workdir
    return _REFERENCE_RUNS[processes]


@pytest.fixture
def dp_two_processes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    return reference_run(tmp_path_factory, 2)


@pytest.fixture
def dp_one_process(tmp_path_factory: pytest.TempPathFactory) -> Result:
    return reference_run(tmp_path_factory, 1)[0]


def test_two_processes_train_and_checkpoint_together(dp_two_processes):
    result, workdir = dp_two_processes
    assert result.step == 100 and result.accuracy > 0.9
    # One set of checkpoints and event files, written jointly / by process 0 only.
    assert sorted(os.listdir(workdir / "checkpoints")) == ["100", "50"]
    assert (workdir / "checkpoints.STOPPED").exists()
    assert os.listdir(workdir / "train") and os.listdir(workdir / "eval")


def test_two_processes_match_one_process_with_eight_devices(dp_two_processes, dp_one_process):
    two, _ = dp_two_processes
    one = dp_one_process
    assert one.step == two.step == 100
    # Same global batches, seed and steps: only the order of floating-point reductions
    # (gloo across processes vs in-process all-reduce) differs, so the fingerprints may differ.
    assert abs(one.loss - two.loss) < 1e-4, (one, two)
    print(f"1x8: loss={one.loss} {one.fingerprint}\n2x4: loss={two.loss} {two.fingerprint}")


def test_two_processes_fsdp_matches_dp(dp_two_processes, tmp_path):
    dp, _ = dp_two_processes
    fsdp = run_digits(tmp_path / "work", "--partitioner", "fsdp", *STEPS)
    assert fsdp.step == 100
    assert abs(fsdp.loss - dp.loss) < 1e-4, (fsdp, dp)
    print(f"fsdp: loss={fsdp.loss} {fsdp.fingerprint}\ndp:   loss={dp.loss} {dp.fingerprint}")


def test_resume_under_two_processes_and_under_one(dp_two_processes, tmp_path):
    uninterrupted, _ = dp_two_processes
    workdir = tmp_path / "work"
    first = run_digits(workdir, "--partitioner", "dp", *STEPS[:1], "50", *STEPS[2:])
    assert first.step == 50
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)

    resumed = run_digits(workdir, "--partitioner", "dp", *STEPS)
    assert resumed.restored_step == 50
    assert resumed.step == 100
    assert resumed.fingerprint == uninterrupted.fingerprint
    assert resumed.loss == uninterrupted.loss

    # The 2-process checkpoint restores into a 1-process, 8-device run.
    single = run_digits(copy, "--partitioner", "dp", *STEPS, processes=1)
    assert single.restored_step == 50
    assert single.step == 100
    assert abs(single.loss - uninterrupted.loss) < 1e-4, (single, uninterrupted)


# A small job: every iteration all-reduces across both processes.
WORKER = textwrap.dedent(
    """
    import os, time
    from jaxloop.launch import distributed
    distributed.initialize()
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.ones(4, np.float32))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    assert float(total(x)) == 8.0, float(total(x))
    # Readiness goes to a file: gloo writes its own lines to stdout.
    ready = os.path.join(os.environ["READY_DIR"], f"ready-{jax.process_index()}")
    with open(ready + ".tmp", "w") as f:
        f.write(f"{jax.process_index()} {jax.process_count()} {jax.device_count()}")
    os.replace(ready + ".tmp", ready)
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
        if all((logdir / f"ready-{i}").exists() for i in range(n)):
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
            READY_DIR=str(tmp_path), **({"RAISE_IN": "1"} if failure == "worker-raises" else {}),
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
    # JAX's own message about the failure is not asserted on (another library's output);
    # exiting with an error within the bound is the behaviour that matters.
    assert code != 0, err[-3000:]


def test_initialize_detects_a_slurm_job(tmp_path):
    """With no arguments JAX reads SLURM's variables (the port derives from the job id)."""
    for job_id in range(4000, 0, -37):  # port 61440 + job_id % 4096, outside Linux's
        port = 61440 + job_id  # ephemeral range
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            break
    envs = [
        process_env(
            4, STEPS="5", READY_DIR=str(tmp_path), SLURM_JOB_ID=str(job_id),
            SLURM_STEP_NODELIST="127.0.0.1",
            SLURM_NTASKS="2", SLURM_PROCID=str(i), SLURM_LOCALID=str(i),
        )
        for i in range(2)
    ]
    with started([[sys.executable, "-c", WORKER]] * 2, envs, tmp_path) as procs:
        codes = wait_all(procs, 120)
        logs = read_logs(tmp_path, 2)
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        assert code == 0, log.stderr[-3000:]
        assert (tmp_path / f"ready-{i}").read_text().split() == [str(i), "2", "8"]


def test_initialize_single_process_job_is_idempotent(tmp_path):
    """Runs in a fresh process: initialising needs a JAX whose backends are not up yet."""
    script = textwrap.dedent(
        """
        import os, jax
        from jaxloop.launch import distributed
        saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("JAXLOOP_")}
        try:  # no address and no cluster to detect one from
            distributed.initialize(num_processes=2, process_id=1)
        except ValueError as e:
            assert "not given coordinator_address" in str(e), e
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
        try:  # JAX refuses (its documented RuntimeError) once its backends are up
            distributed.initialize(address, 1, 0)
        except RuntimeError:
            pass
        else:
            raise AssertionError("initialised after the backends were up")
        open(os.environ["OK_FILE"], "w").close()  # a file, not stdout: see read_logs
        """
    )
    env = process_env(
        1, JAXLOOP_COORDINATOR=f"127.0.0.1:{free_port()}", JAXLOOP_NUM_PROCESSES="1",
        JAXLOOP_PROCESS_ID="0", OK_FILE=str(tmp_path / "ok"),
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and (tmp_path / "ok").exists(), proc.stderr[-3000:]


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


# ----------------------------------------------------------------------------------------
# Jobs of tests/multihost_job.py: each process writes its results to a JSON file.
# ----------------------------------------------------------------------------------------

JOB_TIMEOUT = 240


def run_to_success(what: str, commands: Sequence[Sequence[str]],
                   envs: Sequence[dict[str, str]], logdir: Path,
                   timeout: float = JOB_TIMEOUT) -> None:
    """Runs the processes together; fails the test if they are still running after
    `timeout` seconds (a hang) or any exits with an error (its stderr in the message)."""
    with started(commands, envs, logdir) as procs:
        try:
            codes = wait_all(procs, timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what}: still running after {timeout} s (a hang)")
        logs = read_logs(logdir, len(procs))
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        assert code == 0, f"{what}: process {i} exited {code}:\n{log.stderr[-4000:]}"


def run_job(scenario: str, result_dir: Path, processes: int = 2, job: Path = JOB) -> list[dict]:
    """Runs a scenario of `job` (multihost_job by default) as `processes` processes x 4
    devices (1: one process with 8 devices) and returns each process's results, read from
    its result file (`job_results.write`)."""
    result_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(job), scenario, str(result_dir)]
    run_to_success(scenario, [command] * processes, job_envs(processes), result_dir / "logs")
    return [json.loads((result_dir / f"result-{i}.json").read_text()) for i in range(processes)]


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_actions_with_per_example_outputs_across_processes(tmp_path):
    """Logits sharded over the data axis beside the scalars: summaries every step and every
    loop, checkpoints, best checkpoints and eval summaries all work with 2 processes."""
    results = run_job("actions", tmp_path)
    first, second = results
    assert first["process_count"] == 2 and first["step"] == 12
    # Both processes computed the same metrics and saw the same checkpoints.
    for key in ("eval", "train_loss", "checkpoints", "best", "fingerprint"):
        assert first[key] == second[key], key
    assert first["checkpoints"] == [8, 12] and len(first["best"]) == 1
    assert sorted(first["eval"]) == ["12", "4", "8"]
    # Process 0 wrote the event files; the eval mean is over the 72 real examples.
    eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    train = eam.EventAccumulator(str(tmp_path / "work" / "train"), size_guidance={
        eam.SCALARS: 0, eam.HISTOGRAMS: 0})
    train.Reload()
    assert sorted(e.step for e in train.Scalars("loss")) == sorted(list(range(1, 13)) * 2)
    assert train.Histograms("logit_hist")
    evals = eam.EventAccumulator(str(tmp_path / "work" / "eval"))
    evals.Reload()
    assert [e.step for e in evals.Scalars("loss")] == [4, 8, 12]
    assert evals.Scalars("loss")[-1].value == pytest.approx(first["eval"]["12"]["loss"], 1e-6)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_fused_steps_agree_across_processes_and_with_single_steps(tmp_path):
    """Every process runs the same executions (cut around a step action every 3 steps), and
    they train exactly as k=1 does."""
    first, second = run_job("fused", tmp_path)
    for result in (first, second):
        assert result["4"]["step"] == result["1"]["step"] == 28
        assert result["4"]["fired"] == result["1"]["fired"] == [3, 6, 9, 12, 15, 18, 3, 6]
        assert result["4"]["fingerprint"] == result["1"]["fingerprint"]
        np.testing.assert_array_equal(result["4"]["losses"], result["1"]["losses"])
    assert first["4"]["fingerprint"] == second["4"]["fingerprint"]


@pytest.mark.timeout(2 * JOB_TIMEOUT + 60)
def test_rows_follow_the_mesh_data_coordinate(tmp_path):
    """data=4 x model=2 with 'model' across the processes: both processes hold every data
    coordinate, so both read the whole global batch, and training equals one process."""
    two = run_job("cross_mesh", tmp_path / "two")
    (one,) = run_job("cross_mesh", tmp_path / "one", processes=1)
    for result in two:
        assert result["rows"] == [0, 32] and result["global_batch_shape"] == [32, 16]
        assert result["first_batch"] == one["first_batch"]
        assert result["step"] == one["step"] == 20
        # Same batches and seed: only the reduction order across processes differs.
        np.testing.assert_allclose(result["losses"], one["losses"], rtol=1e-5, atol=1e-6)


def job_commands(args: Sequence[str], result_dir: Path, processes: int = 2):
    port = free_port()
    command = [sys.executable, str(JOB), *args[:1], str(result_dir), *args[1:]]
    envs = [
        process_env(4, JAXLOOP_COORDINATOR=f"127.0.0.1:{port}",
                    JAXLOOP_NUM_PROCESSES=str(processes), JAXLOOP_PROCESS_ID=str(i))
        for i in range(processes)
    ]
    return [command] * processes, envs


PREEMPT_STEPS = ("--train-steps", "100", "--train-loop-steps", "20", "--batch-size", "64")
NOTICES = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "request": signal.SIGUSR1}


@pytest.mark.timeout(3 * JOB_TIMEOUT)
@pytest.mark.parametrize("notice", ["SIGTERM", "SIGINT", "request"])
def test_preemption_reaching_one_process_stops_all_at_one_step(
    dp_two_processes, tmp_path, notice
):
    """A notice delivered to process 1 only: both stop at the same step, one checkpoint of
    that step is written, both exit 143 (130 for the process that got SIGINT); the same
    command then finishes the run exactly."""
    uninterrupted, _ = dp_two_processes
    result_dir = tmp_path / "run"
    workdir = tmp_path / "work"
    args = ["digits", "--workdir", str(workdir), "--partitioner", "dp", *PREEMPT_STEPS]
    commands, envs = job_commands(args, result_dir)
    ckpt = workdir / "checkpoints"
    with started(commands, envs, tmp_path / "logs") as procs:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not (ckpt.exists() and 20 in checkpoint.all_steps(ckpt)):
            assert all(p.poll() is None for p in procs), read_logs(tmp_path / "logs", 2)
            assert time.monotonic() < deadline, "no checkpoint at step 20"
            time.sleep(0.05)
        os.kill(procs[1].pid, NOTICES[notice])  # "request": process 1 calls request()
        try:
            codes = wait_all(procs, JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{notice} to process 1: the job hung")
        logs = read_logs(tmp_path / "logs", 2)
    # The process that got Ctrl-C says so (130); the other was stopped with it (143).
    expected = [143, 130] if notice == "SIGINT" else [143, 143]
    assert codes == expected, [log.stderr[-3000:] for log in logs]
    results = [json.loads((result_dir / f"result-{i}.json").read_text()) for i in range(2)]
    stopped = {r["preempted_step"] for r in results}
    assert len(stopped) == 1, results  # the same step everywhere
    (step,) = stopped
    assert 20 < step < 100
    assert max(checkpoint.all_steps(ckpt)) == step  # one consistent checkpoint, of that step
    assert not (ckpt / "STOPPED").exists()
    assert not (ckpt.parent / f"{ckpt.name}.STOPPED").exists()
    if notice != "SIGTERM":
        return  # resuming is the same for every notice: checked once
    (result_dir / "result-0.json").unlink()
    commands, envs = job_commands(args, result_dir)
    with started(commands, envs, tmp_path / "logs2") as procs:
        codes = wait_all(procs, JOB_TIMEOUT)
    assert codes == [0, 0], [log.stderr[-3000:] for log in read_logs(tmp_path / "logs2", 2)]
    resumed = json.loads((result_dir / "result-0.json").read_text())
    assert resumed["step"] == 100
    assert resumed["fingerprint"] == uninterrupted.fingerprint


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_continuous_eval_on_two_processes_while_max_to_keep_deletes(tmp_path):
    """Issue 22.4: a 2-process continuous evaluator reads the checkpoints a 1-process
    trainer writes with max_to_keep=1 (each save deletes the one before, so checkpoints
    vanish between listing and reading). Process 0 lists and decides; both processes
    evaluate the same steps, end with the final one, and finish without a hang."""
    ckpt = tmp_path / "ckpt"
    evaluator = [sys.executable, str(JOB), "continuous_eval", str(tmp_path / "eval"), str(ckpt)]
    trainer = [sys.executable, str(JOB), "trainer", str(tmp_path / "train"), str(ckpt)]
    run_to_success("continuous eval", [evaluator, evaluator, trainer],
                   [*job_envs(2), process_env(1)], tmp_path / "logs")
    trained = json.loads((tmp_path / "train" / "result-0.json").read_text())
    assert trained["step"] == 40 and trained["checkpoints"] == [40]
    first, second = (json.loads((tmp_path / "eval" / f"result-{i}.json").read_text())
                     for i in range(2))
    assert first["steps"] == second["steps"] and first["losses"] == second["losses"]
    assert first["skipped"] == second["skipped"]
    steps = first["steps"]
    assert steps == sorted(set(steps)) and set(steps) <= set(range(1, 41)) and steps[-1] == 40
    print(f"evaluated {len(steps)} of 40 checkpoints: {steps}; skipped as deleted: "
          f"{first['skipped']}")


EXCHANGE_TIMEOUT = 10  # seconds, set through JAXLOOP_EXCHANGE_TIMEOUT
# From the moment they part to both exits: the exchange's wait, then process 0's wait for
# process 1 at shutdown, then process 1's for the gone coordinator (docs/multihost.md).
PARTED_BOUND = EXCHANGE_TIMEOUT + FAILURE_SHUTDOWN + FAILURE_HEARTBEAT + 60


@pytest.mark.timeout(JOB_TIMEOUT + PARTED_BOUND)
def test_processes_that_part_exit_with_an_error_naming_the_step_and_phase(tmp_path):
    """Issue 42.7: an action runs a collective on process 1 only, at step 4, before the
    CheckpointAction. Process 1 waits in it for a process 0 that never joins; process 0
    waits at the checkpoint's host exchange. Neither hangs: both exit non-zero within the
    bound, and process 0's DisagreementError names the step and the phase."""
    port = free_port()
    envs = [process_env(4, JAXLOOP_COORDINATOR=f"127.0.0.1:{port}", JAXLOOP_NUM_PROCESSES="2",
                        JAXLOOP_PROCESS_ID=str(i), JAXLOOP_HEARTBEAT_TIMEOUT=str(FAILURE_HEARTBEAT),
                        JAXLOOP_SHUTDOWN_TIMEOUT=str(FAILURE_SHUTDOWN),
                        JAXLOOP_EXCHANGE_TIMEOUT=str(EXCHANGE_TIMEOUT))
            for i in range(2)]
    command = [sys.executable, str(REPO / "tests" / "sched_job.py"), "parted", str(tmp_path)]
    with started([command] * 2, envs, tmp_path / "logs") as procs:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not (tmp_path / "parting").exists():
            assert all(p.poll() is None for p in procs), read_logs(tmp_path / "logs", 2)
            assert time.monotonic() < deadline, "the job did not reach step 4"
            time.sleep(0.1)
        parted = time.monotonic()
        try:
            codes = wait_all(procs, PARTED_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {PARTED_BOUND} s after parting (a hang)")
        elapsed = time.monotonic() - parted
    print(f"exit codes {codes} {elapsed:.1f} s after parting")
    assert all(code != 0 for code in codes), codes
    error = json.loads((tmp_path / "result-0.json").read_text())["error"]
    assert "'checkpoint data position at step 4'" in error and "process(es) [1]" in error, error
