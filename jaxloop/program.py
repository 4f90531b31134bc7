"""The compiled program of a step: one `jax.jit` with the state's and batch's shardings.

A `Program` jits ``fn(state, batch, ...)`` once, with the shardings of the state it is first
given as its input shardings and the new state pinned to them (so donated buffers are reused
in place and an FSDP state stays split). The batch's input shardings are the partitioner's
(`Partitioner.batch_shardings`; a leaf already on the devices keeps its own), so a host
(numpy) batch is split across the mesh by jit's own argument handling, without Python per
leaf. Every later call is a plain call of that `jax.jit`: jax's own dispatch checks and
places the arguments. A state placed as the first one (by any partitioner instance of the
same policy) runs the same program; a state placed differently on the mesh is jax's error
naming both shardings, never a silent second program.

With ``steps=k`` the program runs an execution of up to k steps over k stacked batches whose
first ``count`` entries are real: a loop of ``count`` iterations (``count`` is an argument,
so one program serves every execution length from 1 to k). Each step's state is pinned as a single
step's is, so the steps compute exactly what single steps do.

Example::

    train = Program(step_fn, partitioner, donate_argnums=(0,))
    state, outputs = train(state, batch)  # a numpy batch: jit splits it along the data axis

    train_k = Program(step_fn, partitioner, steps=16, donate_argnums=(0,))
    state, stacked_outputs = train_k(state, stacked_batches, 5)  # the first 5 of 16
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _pinned(result: Any, state: PyTree, shardings: PyTree) -> Any:
    """`result` with its new state (a ``(state, outputs)`` pair's first item shaped like
    `state`) constrained to `shardings`; any other result as it is."""
    if (
        isinstance(result, tuple)
        and len(result) == 2
        and jax.tree.structure(result[0]) == jax.tree.structure(state)
    ):
        return jax.lax.with_sharding_constraint(result[0], shardings), result[1]
    return result


class Program:
    """`fn(state, batch, ...)` compiled once for the placement of the first state given.

    Args:
      fn: the step function; it may return anything, and a ``(state, outputs)`` pair has
        its state placed as the input state.
      partitioner: gives the state's shardings (`Partitioner.state_shardings`) and the
        context `fn` is traced in (`Partitioner.trace_context`).
      steps: None for one step; k for executions of up to k steps over batches stacked on
        a leading axis of size k, called as ``program(state, stacked, count, **kwargs)``.
        Outputs come back stacked (entries from `count` on are no real step's).
      carry_state: with `steps`, False runs every step on the given state (evaluation)
        and returns None in its place (the caller holds the state).
      unroll: with `steps`, True inlines all k steps as straight-line code, which XLA
        compiles exactly like single steps (XLA:CPU compiles convolutions inside a loop
        body to another kernel), and runs the steps past `count` too, dropping their
        state; otherwise the steps are a loop of `count` iterations (one compiled body).
      **jit_kwargs: passed to `jax.jit` (``donate_argnums=(0,)`` donates the state).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        partitioner: Any,
        *,
        steps: int | None = None,
        carry_state: bool = True,
        unroll: int | bool = 1,
        **jit_kwargs: Any,
    ):
        jax.jit(fn, **jit_kwargs)  # an unknown jit flag is a TypeError here, not at first use
        self._fn = fn
        self._partitioner = partitioner
        self._steps = steps
        self._carry_state = carry_state
        self._unroll = unroll
        donate = jit_kwargs.pop("donate_argnums", ())
        donate = (donate,) if isinstance(donate, int) else tuple(donate)
        # Called as jitted(state, args, kwargs): argument 0 stays the state, the others
        # travel in argument 1.
        self._donate = tuple(sorted({min(i, 1) for i in donate}))
        self._jit_kwargs = jit_kwargs
        self._jitted: Callable[..., Any] | None = None

    def _batch_shardings(self, batch: PyTree) -> PyTree:
        """The partitioner's shardings for `batch`, a leaf already placed keeping its own
        (prefetched or abstract batches). A ValueError names a leaf that does not split."""
        rule = self._partitioner.batch_shardings(batch, stacked=self._steps is not None)
        return jax.tree.map(
            lambda x, s: x.sharding if isinstance(getattr(x, "sharding", None),
                                                   jax.sharding.Sharding) else s,
            batch, rule,
        )

    def _build(self, state: PyTree, args: tuple) -> Callable[..., Any]:
        partitioner = self._partitioner
        shardings = partitioner.state_shardings(state)
        arg_shardings = (
            (self._batch_shardings(args[0]), *[None] * (len(args) - 1)) if args else ())
        fn = self._fn

        def one_step(state: PyTree, *args: Any, **kwargs: Any) -> Any:
            with partitioner.trace_context():
                return _pinned(fn(state, *args, **kwargs), state, shardings)

        def pin(state: PyTree) -> PyTree:
            return jax.lax.with_sharding_constraint(state, shardings)

        def execution(state: PyTree, stacked: PyTree, count: jax.Array, **kwargs: Any) -> Any:
            carry_state = self._carry_state

            def run_at(i: Any, current: PyTree) -> tuple[PyTree, Any]:
                # The carry is pinned on entry too: that fixes the loop's carried placement,
                # so every step partitions its arithmetic as a single step does.
                current = pin(current) if carry_state else state
                return one_step(current, jax.tree.map(lambda x: x[i], stacked), **kwargs)

            if self._unroll is True:
                # Straight-line code (no loop, no branch), compiled exactly like single
                # steps: the steps past `count` run too and their state is dropped.
                carry, per_step = state, []
                for i in range(self._steps):
                    new, outputs = run_at(i, carry)
                    if carry_state:
                        carry = jax.tree.map(lambda a, b, i=i: jnp.where(i < count, a, b),
                                             new, carry)
                    per_step.append(outputs)
                stacked_outputs = jax.tree.map(lambda *xs: jnp.stack(xs), *per_step)
                return (pin(carry) if carry_state else None), stacked_outputs

            # A loop of `count` iterations (an XLA while loop): its carry is updated in place,
            # and each step's outputs are written into buffers of k entries.
            shapes = jax.eval_shape(lambda s: run_at(0, s), state)[1]
            buffers = jax.tree.map(lambda x: jnp.zeros((self._steps, *x.shape), x.dtype), shapes)

            def body(i: jax.Array, carry: tuple[PyTree, Any]) -> tuple[PyTree, Any]:
                current, written = carry
                new, outputs = run_at(i, current)
                written = jax.tree.map(
                    lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0),
                    written, outputs)
                return (new if carry_state else None), written

            carry, outputs = jax.lax.fori_loop(
                0, count, body, (state if carry_state else None, buffers))
            return (pin(carry) if carry_state else None), outputs

        body = one_step if self._steps is None else execution

        def traced(state: PyTree, args: tuple, kwargs: dict[str, Any]) -> Any:
            return body(state, *args, **kwargs)

        # Named after the step function, as compile events and profiles show it.
        traced.__name__ = getattr(fn, "__name__", "step")
        return jax.jit(
            traced,
            in_shardings=(shardings, arg_shardings, None),
            donate_argnums=self._donate,
            **self._jit_kwargs,
        )

    def _args(self, args: tuple) -> tuple:
        if self._steps is not None and len(args) == 2:
            args = (args[0], np.int32(args[1]))
        return args

    def __call__(self, state: PyTree, *args: Any, **kwargs: Any) -> Any:
        args = self._args(args)
        if self._jitted is None:
            self._jitted = self._build(state, args)
        try:
            return self._jitted(state, args, kwargs)
        except ValueError:
            if args:
                self._batch_shardings(args[0])  # names a batch leaf that does not split
            raise

    def lower(self, state: PyTree, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Lowers the program for these arguments (abstract ones too), e.g. to compile it
        ahead of time for XLA's cost and memory analyses."""
        args = self._args(args)
        if self._jitted is None:
            self._jitted = self._build(state, args)
        return self._jitted.lower(state, args, kwargs)
