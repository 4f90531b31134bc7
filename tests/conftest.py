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
def _programs_compile_once_per_worker(tmp_path_factory):
    """JAX's persistent compilation cache for this worker and the scripts and kernels it
    starts (through the environment), in a directory of its own: the tests build the same
    small steps again and again (each a new jit, so jit's in-memory cache misses) and XLA
    would compile the same programs anew (test_nothing_lost: 25 -> 11 s of CPU). A cached
    program is the one XLA compiled, so no result changes, and the tests that count
    compilations still see each: JAX's backend-compile event wraps a load from the cache too."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = str(tmp_path_factory.mktemp("compilation-cache"))
    os.environ.update(JAX_COMPILATION_CACHE_DIR=path,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()


@pytest.fixture(autouse=True, scope="session")
def _tensorflow_stays_unimported():
    """Fails the TF-free tier (in every xdist worker) if anything imported TensorFlow."""
    yield
    if BLOCK_TF and sys.modules.get("tensorflow") is not None:
        pytest.fail("TensorFlow was imported during the TF-free tier")
