"""The compiled program of a step: one `jax.jit` with explicit input and output shardings.

A `Program` jits ``fn(state, batch, ...)`` as MaxText does its train step: ``jax.jit(...,
in_shardings=..., out_shardings=..., donate_argnums=...)`` with the state's shardings from
the partitioner (`Partitioner.state_shardings`) as the state's input shardings and as the
new state's output shardings, so donated buffers are reused in place and an FSDP state
stays split. The batch's input shardings are the partitioner's (`Partitioner.batch_shardings`;
a leaf already placed keeps its own): batches reach the program placed (a prefetcher places
them ahead, `Step.prepare_batch`), and jit copies nothing; a host batch is copied to those
shardings in jit's own dispatch. A state placed differently on the
mesh is jax's error naming both shardings, never a silent second program.

The jit flags given (`static_argnums`, `static_argnames`, `donate_argnums`,
`compiler_options`, ...) reach that jit: positions and names are those of `fn`.

`fn` returns ``(new_state, outputs)``; the new state must have the state's tree structure
(a `ValueError` names the leaves added or missing otherwise). A result that is not a pair
is returned as it is, with XLA's shardings (`Partitioner.partition` jits any function);
``returns_state=False`` treats every result so.

With ``steps=k`` the program runs an execution of up to k steps over k stacked batches whose
first ``count`` entries are real: a loop of ``count`` iterations (``count`` is an argument,
so one program serves every execution length from 1 to k). Each step's state is pinned as a
single step's is, so the steps compute exactly what single steps do.

Example::

    train = Program(step_fn, partitioner, donate_argnums=(0,))
    state, outputs = train(state, placed_batch)

    train_k = Program(step_fn, partitioner, steps=16, donate_argnums=(0,))
    state, stacked_outputs = train_k(state, stacked_batches, 5)  # the first 5 of 16

    sample = Program(sample_fn, partitioner, static_argnames=('length',))
    tokens = sample(state, prompt, length=32)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop import annotations

PyTree = Any

# Flags a Program sets itself from the partitioner.
_OWN_FLAGS = ("in_shardings", "out_shardings")


def check_state_structure(new: PyTree, state: PyTree) -> None:
    """Raises a ValueError naming the leaves added or missing when `new` (a step's new
    state) does not have the tree structure of `state` (the state it was given).

    Example::

        check_state_structure(new_state, state)  # None when they match
    """
    if jax.tree.structure(new) == jax.tree.structure(state):
        return

    def paths(tree: PyTree) -> set[str]:
        return {annotations.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}

    old, now = paths(state), paths(new)
    added, missing = sorted(now - old), sorted(old - now)
    detail = (f"leaves added: {added or 'none'}; leaves missing: {missing or 'none'}"
              if added or missing else
              f"same leaves, other containers: {jax.tree.structure(state)} became "
              f"{jax.tree.structure(new)}")
    raise ValueError(
        "The step returned a state whose tree structure differs from the state it was "
        f"given ({detail}). The compiled program pins the new state to the given state's "
        "shardings, so run(state, batch) must return a state of the same structure; "
        "create new fields when the state is built (initialize_model)."
    )


def _argnums(value: int | Iterable[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _argnames(value: str | Iterable[str] | None) -> frozenset[str]:
    if value is None:
        return frozenset()
    return frozenset((value,) if isinstance(value, str) else value)


class Program:
    """`fn(state, batch, ...)` compiled as one `jax.jit` with the state's shardings in and out.

    Args:
      fn: the step function, returning ``(new_state, outputs)`` (or, without a state,
        anything else: see the module docstring).
      partitioner: gives the state's shardings (`Partitioner.state_shardings`), the batch's
        (`Partitioner.batch_shardings`) and the context `fn` is traced in
        (`Partitioner.trace_context`).
      steps: None for one step; k for executions of up to k steps over batches stacked on
        a leading axis of size k, called as ``program(state, stacked, count, *args,
        **kwargs)``. Outputs come back stacked (entries from `count` on are no real step's).
      carry_state: with `steps`, False runs every step on the given state (evaluation)
        and returns None in its place (the caller holds the state).
      unroll: with `steps`, True inlines all k steps as straight-line code, which XLA
        compiles exactly like single steps (XLA:CPU compiles convolutions inside a loop
        body to another kernel), and runs the steps past `count` too, dropping their
        state; otherwise the steps are a loop of `count` iterations (one compiled body).
      returns_state: False when `fn`'s result holds no new state (a 2-tuple too).
      **jit_kwargs: flags of `jax.jit`, with `fn`'s argument positions and names:
        ``donate_argnums=(0,)`` donates the state, ``static_argnames=('n',)`` makes the
        keyword argument ``n`` static, ``compiler_options`` go to XLA. `in_shardings` and
        `out_shardings` come from the partitioner and cannot be given.

    Raises:
      TypeError: an unknown jit flag, or `in_shardings`/`out_shardings`.
      ValueError: a static state or batch (`static_argnums` 0 or 1).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        partitioner: Any,
        *,
        steps: int | None = None,
        carry_state: bool = True,
        unroll: int | bool = 1,
        returns_state: bool = True,
        **jit_kwargs: Any,
    ):
        given = [flag for flag in _OWN_FLAGS if flag in jit_kwargs]
        if given:
            raise TypeError(
                f"Program sets {' and '.join(given)} from the partitioner's shardings; "
                "place the state with the partitioner instead of passing them"
            )
        jax.jit(fn, **jit_kwargs)  # an unknown jit flag is a TypeError here, not at first use
        self._fn = fn
        self._partitioner = partitioner
        self._steps = steps
        self._carry_state = carry_state
        self._unroll = unroll
        self._returns_state = returns_state
        flags = dict(jit_kwargs)
        static_nums = _argnums(flags.pop("static_argnums", None))
        if {0, 1} & set(static_nums):
            raise ValueError(
                f"static_argnums={static_nums}: the state (0) and the batch (1) are arrays "
                "and cannot be static"
            )
        # The jitted function is called as (state, positional, kwargs, static): `fn`'s
        # argument i (i >= 1) is positional[i - 1], and in an execution of fused steps,
        # whose count comes after the stacked batch, positional[i] from i = 2 on.
        self._static_positions = frozenset(n if steps is not None else n - 1
                                           for n in static_nums)
        self._static_names = _argnames(flags.pop("static_argnames", None))
        donated = {min(n, 1) for n in _argnums(flags.pop("donate_argnums", None))}
        if _argnames(flags.pop("donate_argnames", None)):
            donated.add(2)
        self._donate = tuple(sorted(donated))
        self._flags = flags
        self._jitted: dict[int, Callable[..., Any]] = {}
        self._counts: dict[int, jax.Array] = {}

    def _batch_shardings(self, batch: PyTree) -> PyTree:
        """The partitioner's shardings for `batch`, a leaf already placed keeping its own
        (prefetched or abstract batches). A ValueError names a leaf that does not split."""
        rule = self._partitioner.batch_shardings(batch, stacked=self._steps is not None)
        return jax.tree.map(
            lambda x, s: x.sharding if isinstance(getattr(x, "sharding", None),
                                                   jax.sharding.Sharding) else s,
            batch, rule,
        )

    def _body(self, shardings: PyTree) -> Callable[..., Any]:
        """The function jit traces: one step, or an execution of up to `steps` steps."""
        partitioner, fn = self._partitioner, self._fn

        def one_step(state: PyTree, *args: Any, **kwargs: Any) -> Any:
            with partitioner.trace_context():
                result = fn(state, *args, **kwargs)
            if self._returns_state and isinstance(result, tuple) and len(result) == 2:
                check_state_structure(result[0], state)
            return result

        def pin(state: PyTree) -> PyTree:
            return jax.lax.with_sharding_constraint(state, shardings)

        def execution(state: PyTree, stacked: PyTree, count: jax.Array, *args: Any,
                      **kwargs: Any) -> Any:
            carry_state = self._carry_state

            def run_at(i: Any, current: PyTree) -> tuple[PyTree, Any]:
                # The carry is pinned on entry too: that fixes the loop's carried placement,
                # so every step partitions its arithmetic as a single step does.
                current = pin(current) if carry_state else state
                new, outputs = one_step(current, jax.tree.map(lambda x: x[i], stacked),
                                        *args, **kwargs)
                return (pin(new) if carry_state else new), outputs

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
                return (carry if carry_state else None), stacked_outputs

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
            return (carry if carry_state else None), outputs

        return one_step if self._steps is None else execution

    def _traced(self, shardings: PyTree) -> Callable[..., Any]:
        """The function jit takes: ``(state, positional, kwargs, static)`` -> `_body`'s."""
        body = self._body(shardings)

        def traced(state: PyTree, positional: tuple, kwargs: dict[str, Any],
                   static: tuple) -> Any:
            args, named = list(positional), dict(kwargs)
            for key, value in static:
                if isinstance(key, int):
                    args[key] = value
                else:
                    named[key] = value
            return body(state, *args, **named)

        # Named after the step function, as compile events and profiles show it.
        traced.__name__ = getattr(self._fn, "__name__", "step")
        return traced

    def _build(self, state: PyTree, call: tuple) -> Callable[..., Any]:
        _, positional, kwargs, static = call
        shardings = self._partitioner.state_shardings(state)
        traced = self._traced(shardings)
        batch = (self._batch_shardings(positional[0]),) if positional else ()
        in_shardings = (shardings, (*batch, *[None] * (len(positional) - len(batch))), None)
        flags = dict(in_shardings=in_shardings, static_argnums=(3,),
                     donate_argnums=self._donate, **self._flags)
        if self._steps is not None:
            out = (shardings if self._carry_state else None, None)
        else:
            # Whether the result is a (state, outputs) pair is known once traced; the
            # trace is cached, so the jit below does not trace `fn` again.
            result = jax.jit(traced, **flags).trace(state, positional, kwargs, static).out_info
            is_pair = isinstance(result, tuple) and len(result) == 2
            if not (self._returns_state and is_pair):
                return jax.jit(traced, **flags)
            out = (shardings, None)
        return jax.jit(traced, out_shardings=out, **flags)

    def _count(self, count: Any) -> jax.Array:
        """An execution's count as a placed scalar, made once per value: the training
        thread hands the program only arrays already on the devices."""
        if isinstance(count, jax.Array):
            return count
        count = int(count)
        if count not in self._counts:
            replicated = jax.sharding.NamedSharding(self._partitioner.mesh,
                                                    jax.sharding.PartitionSpec())
            self._counts[count] = jax.make_array_from_callback(
                (), replicated, lambda _: np.int32(count))
        return self._counts[count]

    def _call(self, state: PyTree, args: tuple, kwargs: dict[str, Any]) -> tuple:
        """The arguments of the jitted function: (state, positional, kwargs, static)."""
        if self._steps is not None:
            if len(args) < 2:
                raise TypeError("An execution is called as program(state, stacked, count, ...)")
            args = (args[0], self._count(args[1]), *args[2:])
        if not (self._static_positions or self._static_names):
            return state, args, kwargs, ()
        static = tuple((i, args[i]) for i in sorted(self._static_positions) if i < len(args))
        static += tuple(sorted(((k, v) for k, v in kwargs.items() if k in self._static_names),
                               key=lambda item: item[0]))
        args = tuple(None if i in self._static_positions else a for i, a in enumerate(args))
        kwargs = {k: v for k, v in kwargs.items() if k not in self._static_names}
        return state, args, kwargs, static

    def _jit_for(self, call: tuple) -> Callable[..., Any]:
        jitted = self._jitted.get(len(call[1]))
        if jitted is None:
            jitted = self._jitted[len(call[1])] = self._build(call[0], call)
        return jitted

    def __call__(self, state: PyTree, *args: Any, **kwargs: Any) -> Any:
        call = self._call(state, args, kwargs)
        if jax.config.jax_disable_jit:
            # Debugging (`jax.disable_jit`): `fn` runs op by op, so prints and breakpoints
            # in it work; nothing is traced, nor cached for when jit is back.
            return self._traced(self._partitioner.state_shardings(state))(*call)
        jitted = self._jit_for(call)
        try:
            return jitted(*call)
        except ValueError:
            if args:
                self._batch_shardings(args[0])  # names a batch leaf that does not split
            raise

    def lower(self, state: PyTree, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Lowers the program for these arguments (abstract ones too), e.g. to compile it
        ahead of time for XLA's cost and memory analyses."""
        call = self._call(state, args, kwargs)
        return self._jit_for(call).lower(*call)
