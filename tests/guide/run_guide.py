"""Runs the guide's example unmodified under tfds mock data (used by tests/test_guide.py).

Usage: python run_guide.py NUM_DEVICES [--interval1]

With --interval1 the guide's `interval=100` actions become `interval=1` (the only textual
change), so the summaries fire on every loop. Prints `RESULT step=... workdir=...`.
"""

import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[1]}"
os.environ["JAX_PLATFORMS"] = "cpu"

import tensorflow_datasets as tfds  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
source = open(os.path.join(here, "guide_example.py")).read()
if "--interval1" in sys.argv:
    source = source.replace("interval=100", "interval=1")

scope: dict = {"__name__": "guide"}
with tfds.testing.mock_data(num_examples=320):
    exec(compile(source, "guide_example.py", "exec"), scope)

import jax  # noqa: E402

scope["metrics_writer"].flush()
print(
    f"RESULT step={int(scope['state'].step)} devices={jax.device_count()} "
    f"workdir={scope['work_dir']} tmp={tempfile.gettempdir()}"
)
