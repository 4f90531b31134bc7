"""Every benchmark behind the README's performance table, one after another in one run.

Each runs in its own process, as documented in its file, and its output is printed as it
comes, under a header with the command, the machine's load average when it started and
its duration. The peak memory of a resume comes from tests/test_resume_memory.py, which
prints it. The figures of one run belong together: read each ratio within its benchmark.

    python benchmarks/run_all.py | tee benchmark_results.txt
    python benchmarks/run_all.py --only overhead,startup
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, command) in the order of the README's table.
BENCHMARKS = [
    ("overhead", ["benchmarks/overhead.py"]),
    ("input_pipeline", ["benchmarks/input_pipeline.py"]),
    ("checkpoint_overhead", ["benchmarks/checkpoint_overhead.py"]),
    ("checkpoint_outputs", ["benchmarks/checkpoint_outputs.py"]),
    ("accumulation_memory", ["benchmarks/accumulation_memory.py", "--batch-size", "4096"]),
    ("goodput", ["benchmarks/goodput.py"]),
    ("startup", ["benchmarks/startup.py", "--train-steps", "20"]),
    ("state_memory", ["benchmarks/state_memory.py"]),
    ("replica_check", ["benchmarks/replica_check.py"]),
    ("resume_memory", ["-m", "pytest", "tests/test_resume_memory.py", "-q", "-s",
                       "-p", "no:cacheprovider"]),
]


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="",
                        help="comma-separated names to run (default: all): "
                        + ", ".join(name for name, _ in BENCHMARKS))
    args = parser.parse_args()
    wanted = {n for n in args.only.split(",") if n}
    unknown = wanted - {name for name, _ in BENCHMARKS}
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}")
    import jax  # noqa: PLC0415 (only its version; each benchmark starts its own jax)

    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}, commit {_commit()}, Python "
          f"{platform.python_version()}, jax {jax.__version__}, {os.cpu_count()} cores")
    failed = []
    for name, command in BENCHMARKS:
        if wanted and name not in wanted:
            continue
        print(f"\n## {name}: python {' '.join(command)} (load average "
              f"{os.getloadavg()[0]:.1f})", flush=True)
        start = time.perf_counter()
        result = subprocess.run([sys.executable, *command], cwd=ROOT)
        print(f"## {name}: {time.perf_counter() - start:.0f} s, exit {result.returncode}",
              flush=True)
        if result.returncode:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
