"""Debugging switches: steps without jit, and the post-mortem debugger on an error.

``disable_jit`` runs every step op by op, so ``breakpoint()`` in `Step.run` sees concrete
arrays; ``post_mortem`` stops an error in `pdb.post_mortem` when interactive, then re-raises.
None reads ``JAXLOOP_DISABLE_JIT=1`` / ``JAXLOOP_POST_MORTEM=1``::

    with debugging.session(disable_jit=True, post_mortem=True):
        state, outputs = train_loop(state, batches, num_steps=3)
"""

from __future__ import annotations

import contextlib
import logging
import os
import pdb
import sys
from collections.abc import Iterator

import jax

__all__ = ["ENV_DISABLE_JIT", "ENV_POST_MORTEM", "interactive", "session"]

ENV_DISABLE_JIT = "JAXLOOP_DISABLE_JIT"
ENV_POST_MORTEM = "JAXLOOP_POST_MORTEM"

log = logging.getLogger(__name__)


def _from_env(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def interactive() -> bool:
    """Whether someone can answer a debugger: stdin is a terminal, or in a notebook."""
    return bool(sys.stdin is not None and sys.stdin.isatty()) or "ipykernel" in sys.modules


@contextlib.contextmanager
def session(disable_jit: bool | None = None, post_mortem: bool | None = None) -> Iterator[None]:
    """Runs its body with the debugging switches (None: from the environment)."""
    source = "disable_jit=True" if disable_jit else f"{ENV_DISABLE_JIT}=1 in the environment"
    disable_jit = _from_env(ENV_DISABLE_JIT) if disable_jit is None else disable_jit
    post_mortem = _from_env(ENV_POST_MORTEM) if post_mortem is None else post_mortem
    with jax.disable_jit() if disable_jit else contextlib.nullcontext():
        if disable_jit:
            log.warning("jit is disabled (%s): steps run op by op, slowly.", source)
        try:
            yield
        except Exception as error:
            if post_mortem and interactive():
                print(f"{type(error).__name__}: {error}\nEntering the post-mortem debugger "
                      "(c or q continues: the error is then raised).", file=sys.stderr)
                pdb.post_mortem(error.__traceback__)
            raise
