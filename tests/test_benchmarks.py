"""benchmarks/overhead.py runs end to end in its several processes and reports every
variant (its figures belong to the README; none is asserted here: timings are noise)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RATIO = r"[0-9.]+ \([0-9.]+ \[[0-9.]+-[0-9.]+\] \([0-9.]+-[0-9.]+\)\)"


@pytest.mark.slow
def test_overhead_benchmark_pools_processes_and_reports_every_variant():
    proc = subprocess.run(
        [sys.executable, "benchmarks/overhead.py", "--only", "mlp", "--rounds", "2",
         "--processes", "2", "--loop-steps", "40"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "-- 1 device(s), 2 process(es) x 2 rounds" in out
    assert "-- 8 device(s), 1 process(es) x 2 rounds" in out
    for variant in ("defaults", "p=0", "p=2", "k=4", "k=8", "k=16", "k=32", "k=16 L=192"):
        assert re.search(rf"^    {re.escape(variant)} +{RATIO}$", out, re.M), variant
    assert len(re.findall(r"per process: [0-9.]+ [0-9.]+$", out, re.M)) == 8
    for case in ("MLP batch 256, DataParallel x8", "MLP batch 256, FSDP x8"):
        assert f"{case} [loops of 10 steps" in out


@pytest.mark.slow
def test_state_memory_benchmark_shows_the_copy_and_the_opt_in():
    proc = subprocess.run(
        [sys.executable, "benchmarks/state_memory.py", "--steps", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = dict(re.findall(r"^(\S+) +peak live device bytes = ([0-9.]+) x one state",
                             proc.stdout, re.M))
    # Live arrays only (no timing): the caller's state plus the loop's own, or one state.
    assert 1.9 <= float(ratios["default"]) <= 2.2, proc.stdout
    assert 0.9 <= float(ratios["opt-in"]) <= 1.2, proc.stdout
    assert 0.9 <= float(ratios["resume"]) <= 1.2, proc.stdout


@pytest.mark.slow
def test_async_device_benchmark_reports_every_variant_and_counts_waits():
    proc = subprocess.run(
        [sys.executable, "benchmarks/async_device.py", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # On CPU the device sleeps in an FFI custom call, which XLA runs beside the host.
    assert "ffi sleep on cpu" in out and "(the device runs beside the host)" in out, out
    for length in (5, 10):
        for kind, goal, reference in (("outputs", "0.98", "hand-written, outputs"),
                                      ("no outputs", "0.98", "hand-written, no outputs"),
                                      ("summary", "0.97", f"hand-written, reads every {length}")):
            row = rf"^    loops of {length}, {kind} +[0-9.]+ \[[0-9.]+-[0-9.]+\] >= {goal} "
            assert re.search(row + rf"(met|BELOW) +{re.escape(reference)}$", out, re.M), out
    # The counted waits of the hand-written loops are known: the one block at a window's
    # end, and the summary reference's one read per loop (20 steps, loops of 5 and 10).
    waits = {name: (int(blocks), int(reads)) for name, blocks, reads in re.findall(
        r"^    (hand-written, [a-z0-9 ,]+?) +(?:[0-9-]+ +){3}(\d+) +(\d+)$", out, re.M)}
    assert waits == {"hand-written, outputs": (1, 0), "hand-written, no outputs": (1, 0),
                     "hand-written, reads every 5": (1, 4),
                     "hand-written, reads every 10": (1, 2)}, out
    assert "command: python benchmarks/async_device.py --quick" in out
