"""Faster start-ups: JAX's persistent compilation cache, enabled with one call.

A training job compiles its step (and eval step, init, ...) every time it starts. With the
cache enabled, compiled programs are written to a directory and a later start with the same
programs, jax version and devices loads them instead of compiling again; a restarted or
preempted job, or the next run of a sweep, starts faster.

Example::

    from jaxloop import compilation_cache

    compilation_cache.enable('/tmp/jax_cache')   # before or after the first jit

The examples take ``--compilation-cache DIR``. The cache is trusted code: never point it at a
directory others can write to.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

__all__ = ["enable"]


def enable(
    cache_dir: str | os.PathLike[str],
    min_compile_time_secs: float = 0.0,
    max_size_bytes: int = -1,
) -> str:
    """Enables JAX's persistent compilation cache in `cache_dir`; returns the directory.

    Args:
      cache_dir: a local or remote (``gs://``) directory; created when missing.
      min_compile_time_secs: only programs that took at least this long to compile are
        written (JAX's own default is 1 s, which leaves out the many small programs of a
        CPU job; 0 caches everything).
      max_size_bytes: evict least recently used entries beyond this size (-1: no limit).

    Works after programs were already compiled in this process too (JAX decides whether it
    uses a cache once, so that decision is reset here).
    """
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
