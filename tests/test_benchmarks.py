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
    for variant in ("defaults", "p=2", "k=4", "k=8", "k=16", "k=32", "k=16 L=192"):
        assert re.search(rf"^    {re.escape(variant)} +{RATIO}$", out, re.M), variant
    assert len(re.findall(r"per process: [0-9.]+ [0-9.]+$", out, re.M)) == 7
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
