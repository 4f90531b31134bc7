"""Test set-up: 8 CPU devices before jax is imported, and an optional TensorFlow block."""

import os
import sys

import pytest

# LLVM's optimisation passes take most of XLA:CPU's compile time, and the tests compile far
# more than they run: without them the suite needs about half the CPU time (test_performance:
# 172 -> 87 s). Results are compared only between programs compiled alike.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# In the TF-free tier TensorFlow must look uninstalled: a None entry in sys.modules makes
# `import tensorflow` fail and `importlib.util.find_spec('tensorflow')` return None.
BLOCK_TF = os.environ.get("JAXLOOP_BLOCK_TF") == "1"
if BLOCK_TF:
    sys.modules["tensorflow"] = None


def pytest_collection_modifyitems(config, items):
    # Multi-process jobs join on a free local port and each loads both cores: under
    # pytest-xdist (``--dist loadgroup``) one worker runs all of them in turn while the other
    # runs everything else, so no two jobs race for a port.
    for item in items:
        if item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.xdist_group("multiprocess"))


@pytest.fixture(autouse=True, scope="session")
def _jobs_share_a_compilation_cache(tmp_path_factory):
    """A persistent compilation cache for the jobs started by `test_multiprocess.process_env`
    (read there): those jobs compile the same few dozen programs each time, up to a fifth of
    a short job's time. This worker's own jax was configured at import and does not use it."""
    os.environ["JAXLOOP_TEST_JOB_CACHE"] = str(tmp_path_factory.mktemp("job-compilation-cache"))


@pytest.fixture(autouse=True, scope="session")
def _tensorflow_stays_unimported():
    """Fails the TF-free tier (in every xdist worker) if anything imported TensorFlow."""
    yield
    if BLOCK_TF and sys.modules.get("tensorflow") is not None:
        pytest.fail("TensorFlow was imported during the TF-free tier")
