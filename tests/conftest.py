"""Test set-up: 8 CPU devices before jax is imported, and an optional TensorFlow block."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# In the TF-free tier TensorFlow must look uninstalled: a None entry in sys.modules makes
# `import tensorflow` fail and `importlib.util.find_spec('tensorflow')` return None.
BLOCK_TF = os.environ.get("JAXLOOP_BLOCK_TF") == "1"
if BLOCK_TF:
    sys.modules["tensorflow"] = None


def pytest_sessionfinish(session, exitstatus):
    if BLOCK_TF and sys.modules.get("tensorflow") is not None:
        print("ERROR: TensorFlow was imported during the TF-free tier", file=sys.stderr)
        session.exitstatus = 1
