"""Debugging switches: steps without jit, and the post-mortem debugger on an error.

- ``disable_jit``: every step (and everything else jitted) runs op by op in Python
  (`jax.disable_jit`), so ``breakpoint()``, ``print`` and a debugger's breakpoints inside
  `Step.run` see concrete arrays. Results equal the jitted ones to float tolerance (XLA
  fuses and reorders operations when it compiles); it is much slower.
- ``post_mortem``: an exception raised in a step or an action (anything under the
  session) stops in the post-mortem debugger (`pdb.post_mortem`) at the frame that raised,
  when the session is interactive (a terminal, or a notebook kernel); then it propagates
  as before. Batch jobs, whose standard input is no terminal, are never held up.

`OuterLoop(disable_jit=..., post_mortem=...)` enters a `session` around training and
evaluation; `None` (the default) reads the environment: ``JAXLOOP_DISABLE_JIT=1`` and
``JAXLOOP_POST_MORTEM=1``. Off, neither costs anything: the session is a ``try`` block.
Elsewhere (a loop called in a notebook cell), enter it yourself.

Example::

    with debugging.session(disable_jit=True, post_mortem=True):
        state, outputs = train_loop(state, batches, num_steps=3)

or, without changing the script::

    JAXLOOP_DISABLE_JIT=1 JAXLOOP_POST_MORTEM=1 python train.py
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
    """Whether someone can answer a debugger: standard input is a terminal, or a notebook
    kernel (IPython's) runs this process."""
    stdin = sys.stdin
    return bool(stdin is not None and stdin.isatty()) or "ipykernel" in sys.modules


@contextlib.contextmanager
def session(disable_jit: bool | None = None, post_mortem: bool | None = None
            ) -> Iterator[None]:
    """Runs its body with the debugging switches (None: from ``JAXLOOP_DISABLE_JIT`` /
    ``JAXLOOP_POST_MORTEM``).

    Raises:
      ValueError: an environment variable that is not a yes/no value.

    Example::

        with debugging.session(disable_jit=True):
            state, outputs = step(state, batch)  # a breakpoint() in run stops here
    """
    # Say where the switch came from: a user who passed disable_jit=True looks for it in
    # their code, not in the environment.
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
