"""The persistent compilation cache: a second process loads the step instead of compiling it.

Real processes (the cache is per process); whether a program came from the cache is read
from JAX's own monitoring events, never from timings.
"""

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, sys
import jax, optax
sys.path.insert(0, sys.argv[2])
from models import ClassifierStep, LinenMLP, toy_data
from jaxloop.launch import compilation_cache

events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
jax.jit(lambda x: x * 3)(1.0)  # compiled before enable: enable must still take effect
compilation_cache.enable(sys.argv[1])
step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
state = step.initialize_model([1, 16])
state, out = step(state, toy_data(32))
print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses"),
                  "loss": float(out["loss"])}))
"""


def run_child(cache_dir, tests_dir):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache_dir), str(tests_dir)],
        capture_output=True, text=True, timeout=240,
        # Without the suite's own cache (tests/conftest.py): this child counts on a new one.
        env={**{k: v for k, v in __import__("os").environ.items()
                if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))},
             "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_second_start_loads_compiled_programs(tmp_path):
    import pathlib

    tests_dir = pathlib.Path(__file__).parent
    first = run_child(tmp_path / "cache", tests_dir)
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert first["hits"] == 0 and first["misses"] >= 2 and entries
    second = run_child(tmp_path / "cache", tests_dir)
    assert second["misses"] == 0 and second["hits"] == first["misses"]
    assert second["loss"] == first["loss"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries


def test_enable_sets_jax_config(tmp_path):
    import jax

    from jaxloop.launch import compilation_cache

    old = {k: getattr(jax.config, k) for k in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")}
    try:
        path = compilation_cache.enable(tmp_path / "c", min_compile_time_secs=0.5)
        assert path == str(tmp_path / "c") and (tmp_path / "c").is_dir()
        assert jax.config.jax_compilation_cache_dir == path
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.5
    finally:
        for k, v in old.items():
            jax.config.update(k, v)
        from jax.experimental.compilation_cache import compilation_cache as jcc

        jcc.reset_cache()
