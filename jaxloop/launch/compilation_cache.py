"""Faster start-ups: JAX's persistent compilation cache, so a restarted job loads its compiled
programs. The cache is trusted code: never point it at a directory others can write to::

    compilation_cache.enable('/tmp/jax_cache')   # before or after the first jit
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

__all__ = ["enable"]


def enable(cache_dir: str | os.PathLike[str], min_compile_time_secs: float = 0.0,
           max_size_bytes: int = -1) -> str:
    """Enables JAX's persistent compilation cache in `cache_dir` (local or ``gs://``) and
    returns it. Only programs compiled in at least `min_compile_time_secs` are written (0: all);
    beyond `max_size_bytes` (-1: no limit) the least recently used go."""
    path = os.fspath(cache_dir)
    if "://" not in path:
        path = os.path.abspath(path)
        os.makedirs(path, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", int(max_size_bytes))
    _jax_cache.reset_cache()
    return path
