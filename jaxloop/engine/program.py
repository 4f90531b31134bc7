"""The compiled program of a step (`Program`), made once per state and batch structure, then
called directly every step (jit places a host batch). Jit flags use the positions and names
of `fn`'s own signature.

Example::

    state, outputs = Program(step_fn, partitioner, donate_argnums=(0,))(state, batch)
    train_k = Program(step_fn, partitioner, steps=16, donate_argnums=(0,))
    state, stacked_outputs = train_k(state, stacked_batches, 5)  # the first 5 of 16
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop.sharding import annotations

PyTree = Any
MAX_PROGRAMS = 16  # kept per Program: one per state and batch structure (mask or none)


def check_state_structure(new: PyTree, state: PyTree) -> None:
    """Raises a ValueError naming the leaves added or missing unless `new` (a step's new
    state) has the tree structure of `state`."""
    if jax.tree.structure(new) == jax.tree.structure(state):
        return
    old, now = ({annotations.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]}
                for t in (state, new))
    added, missing = sorted(now - old), sorted(old - now)
    detail = (f"leaves added: {added or 'none'}; leaves missing: {missing or 'none'}"
              if added or missing else
              f"same leaves, other containers: {jax.tree.structure(state)} became "
              f"{jax.tree.structure(new)}")
    raise ValueError(
        "The step returned a state whose tree structure differs from the state it was "
        f"given ({detail}). The compiled program pins the new state to the given state's "
        "shardings, so run(state, batch) must return a state of the same structure; "
        "create new fields when the state is built (initialize_model).")


class _Compiled(NamedTuple):  # what `partition` returned, with what it was given (`lower`)
    call: Callable[..., Any]
    fn: Callable[..., Any]
    flags: dict[str, Any]


def _as_tuple(value: Any, kind: type) -> tuple:
    return () if value is None else (value,) if isinstance(value, kind) else tuple(value)


class Program:
    """`fn(state, batch, ...)` compiled as one `jax.jit` with the state's shardings in and out
    (made by ``partitioner.partition(fn, in_shardings=..., ...)``, which a partitioner may
    override to wrap, log or change it); `last_token` is a scalar of the last execution.

    Args:
      fn: returns ``(new_state, outputs)``, the new state of the given one's structure.
      partitioner: gives the state's and batch's shardings, the trace context and the jit.
      steps: k for executions called as ``program(state, stacked, count, ...)``, outputs
        stacked (entries from `count` on are padding); None for one step.
      carry_state: False runs every step on the given state and returns None for it.
      unroll: inline the k steps (those past `count` run, their state dropped), not a loop.
      separate: the k batches come as a sequence, not stacked on a leading axis.
      returns_state: None accepts any result (a pair's first item is pinned as a state).
      **jit_kwargs: flags of `jax.jit` but `in_shardings`; `out_shardings` places `fn`'s
        outputs (or a pair, the outputs' second): the state keeps the partitioner's."""

    def __init__(self, fn: Callable[..., Any], partitioner: Any, *, steps: int | None = None,
                 carry_state: bool = True, unroll: bool = False, separate: bool = False,
                 returns_state: bool | None = True, **jit_kwargs: Any):
        if "in_shardings" in jit_kwargs:
            raise TypeError("Program sets in_shardings from the partitioner's shardings; place "
                            "the state with the partitioner instead of passing them")
        if not isinstance(unroll, bool):
            raise TypeError(f"unroll must be True or False, got {unroll!r}")
        jax.jit(fn, **jit_kwargs)  # an unknown jit flag is a TypeError here, not at first use
        self._out_shardings = jit_kwargs.pop("out_shardings", None)
        self._static_nums = _as_tuple(jit_kwargs.pop("static_argnums", None), int)
        self._donate_nums = _as_tuple(jit_kwargs.pop("donate_argnums", None), int)
        if {0, 1} & set(self._static_nums):
            raise ValueError(f"static_argnums={self._static_nums}: the state (0) and the batch "
                             "(1) are arrays and cannot be static")
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        # A flag naming an argument applies where it arrives by position too.
        self._positional_names = [p.name for p in params if p.kind in (
            p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._static_names = set(_as_tuple(jit_kwargs.pop("static_argnames", None), str))
        self._donate_names = set(_as_tuple(jit_kwargs.pop("donate_argnames", None), str))
        self._fn, self._partitioner, self._steps, self._flags = fn, partitioner, steps, jit_kwargs
        self._carry_state, self._unroll, self._separate = carry_state, unroll, separate
        self._returns_state = returns_state
        # (positional count, keyword names, batch and state structures) -> program, by use.
        self._jitted: collections.OrderedDict[tuple, _Compiled] = collections.OrderedDict()
        # The last call's (key without the state's structure, program, key): a call with the
        # same batch structure checks nothing else.
        self._current: tuple[tuple, Callable[..., Any], tuple] | None = None
        self.last_token: jax.Array | None = None

    def _positions(self, nums: tuple[int, ...], names: set[str], num_args: int,
                   kw_names: tuple[str, ...]) -> tuple[int, ...]:
        """Positions in the jitted call ``(state, *args, *kwarg values)`` of `fn`'s arguments
        given by number or name (a fused execution's count sits at 2)."""
        shift = 1 if self._steps is not None else 0
        positional = self._positional_names
        nums = {*nums, *(i for i, name in enumerate(positional) if name in names)}
        names = names | {positional[n] for n in nums if n < len(positional)}
        # Up to `fn`'s own positional arguments after the state.
        found = {n + shift if n >= 2 else n for n in nums if n <= num_args - shift}
        found |= {1 + num_args + i for i, name in enumerate(kw_names) if name in names}
        return tuple(sorted(found))

    def _batch_shardings(self, batch: PyTree, stacked: bool | None = None) -> PyTree:
        """The partitioner's shardings for `batch`, a placed leaf keeping its own (an
        uncommitted array, a plain `jax.device_put`, goes where the rule says)."""
        if stacked is None:
            if self._separate:
                return tuple(self._batch_shardings(b, False) for b in batch)
            stacked = self._steps is not None
        return jax.tree.map(
            lambda x, s: x.sharding if isinstance(x, jax.Array | jax.ShapeDtypeStruct)
            and getattr(x, "committed", True)
            and isinstance(getattr(x, "sharding", None), jax.sharding.Sharding) else s,
            batch, self._partitioner.batch_shardings(batch, stacked=stacked))

    def _build(self, state: PyTree, args: tuple, kwargs: dict[str, Any]) -> _Compiled:
        kw_names, num_args, partitioner = tuple(kwargs), len(args), self._partitioner
        shardings = partitioner.state_shardings(state)
        body, returns_state = self._body(shardings), self._returns_state

        def step(state: PyTree, *flat: Any) -> tuple[Any, jax.Array]:
            named = dict(zip(kw_names, flat[num_args:], strict=True))
            with partitioner.trace_context():
                result = body(state, *flat[:num_args], **named)
            return result, jnp.zeros((), jnp.int32)  # `last_token`

        # Named after the step function, as compile events and profiles show it.
        step.__name__ = getattr(self._fn, "__name__", "step")
        static = self._positions(self._static_nums, self._static_names, num_args, kw_names)
        donate = self._positions(self._donate_nums, self._donate_names, num_args, kw_names)
        batch = (self._batch_shardings(args[0]),) if args else ()
        count = (jax.sharding.NamedSharding(partitioner.mesh, jax.sharding.PartitionSpec()),
                 ) if self._steps is not None else ()
        rest = [None] * (num_args - len(batch) - len(count) + len(kw_names))
        in_shardings = tuple(s for i, s in enumerate((shardings, *batch, *count, *rest))
                             if i not in static)
        flags = dict(in_shardings=in_shardings, static_argnums=static, donate_argnums=donate,
                     **self._flags)
        if returns_state is None:
            # Whether the result is a (state, outputs) pair is known once traced.
            traced = jax.jit(step, **flags).trace(state, *args, *kwargs.values()).out_info[0]
            returns_state = isinstance(traced, tuple) and len(traced) == 2
        if returns_state:
            state_out = shardings if self._steps is None or self._carry_state else None
            flags["out_shardings"] = ((state_out, None), None)
        return _Compiled(partitioner.partition(step, **flags), step, flags)

    def _body(self, shardings: PyTree) -> Callable[..., Any]:
        """The function jit traces: one step, or an execution of up to `steps` steps."""
        fn, check, placed = self._fn, self._returns_state is not False, self._out_shardings

        def one_step(state: PyTree, *args: Any, **kwargs: Any) -> Any:
            result = fn(state, *args, **kwargs)
            pair = check and isinstance(result, tuple) and len(result) == 2
            if pair:
                check_state_structure(result[0], state)
            if placed is not None:
                # The state keeps the partitioner's shardings; the outputs go where asked.
                if not pair:
                    return jax.lax.with_sharding_constraint(result, placed)
                outputs = placed[1] if isinstance(placed, tuple | list) else placed
                return result[0], jax.lax.with_sharding_constraint(result[1], outputs)
            return result

        if self._steps is None:
            return one_step

        def pin(state: PyTree) -> PyTree:
            return jax.lax.with_sharding_constraint(state, shardings)

        carry_state, separate, unroll = self._carry_state, self._separate, self._unroll

        def execution(state: PyTree, batches: PyTree, count: jax.Array, *args: Any,
                      **kwargs: Any) -> Any:
            if separate and not unroll:  # stacked here for the loop body
                batches = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)

            def batch_at(i: Any) -> PyTree:
                return batches[i] if separate and unroll else jax.tree.map(lambda x: x[i],
                                                                           batches)

            def run_at(i: Any, current: PyTree) -> tuple[PyTree, Any]:
                # Pinned on entry too, so each step partitions as a single step does.
                current = pin(current) if carry_state else state
                new, outputs = one_step(current, batch_at(i), *args, **kwargs)
                return (pin(new) if carry_state else new), outputs

            if unroll:
                carry, per_step = state, []
                for i in range(self._steps):
                    new, outputs = run_at(i, carry)
                    if carry_state:
                        carry = jax.tree.map(lambda a, b, i=i: jnp.where(i < count, a, b),
                                             new, carry)
                    per_step.append(outputs)
                return (carry if carry_state else None), jax.tree.map(
                    lambda *xs: jnp.stack(xs), *per_step)

            shapes = jax.eval_shape(lambda s: run_at(0, s), state)[1]
            buffers = jax.tree.map(lambda x: jnp.zeros((self._steps, *x.shape), x.dtype), shapes)

            def body(i: jax.Array, carry: tuple[PyTree, Any]) -> tuple[PyTree, Any]:
                current, written = carry
                new, outputs = run_at(i, current)
                written = jax.tree.map(
                    lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0),
                    written, outputs)
                return (new if carry_state else None), written

            return jax.lax.fori_loop(0, count, body, (state if carry_state else None, buffers))

        return execution

    def _jit_for(self, state: PyTree, args: tuple, kwargs: dict[str, Any]) -> Callable:
        """The program for these arguments' structures, made on their first call."""
        shape = (len(args), tuple(kwargs), jax.tree.structure(args[0]) if args else None)
        if self._current is not None and self._current[0] == shape:
            return self._current[1]
        key = (*shape, jax.tree.structure(state))
        if key not in self._jitted:
            self._jitted[key] = self._build(state, args, kwargs)
            if len(self._jitted) > MAX_PROGRAMS:
                self._jitted.popitem(last=False)
        self._jitted.move_to_end(key)
        self._current = (shape, self._jitted[key].call, key)
        return self._current[1]

    def _arguments(self, args: tuple) -> tuple:
        if self._steps is not None and len(args) < 2:
            raise TypeError("An execution is called as program(state, stacked, count, ...)")
        return args if self._steps is None else (args[0], np.int32(args[1]), *args[2:])

    def __call__(self, state: PyTree, *args: Any, **kwargs: Any) -> Any:
        args = self._arguments(args)
        if jax.config.jax_disable_jit:
            # `fn` runs op by op (prints and breakpoints work); nothing is cached.
            shardings = self._partitioner.state_shardings(state)
            with self._partitioner.trace_context():
                return self._body(shardings)(state, *args, **kwargs)
        try:
            result, self.last_token = self._jit_for(state, args, kwargs)(
                state, *args, *kwargs.values())
        except (ValueError, TypeError):
            current = self._current  # the state's structure changed: its own program
            if current is None or jax.tree.structure(state) == current[2][-1]:
                if args:
                    self._batch_shardings(args[0])  # names a batch leaf that does not split
                raise
            self._current = None
            result, self.last_token = self._jit_for(state, args, kwargs)(
                state, *args, *kwargs.values())
        return result

    def lower(self, state: PyTree, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Lowers the program for these (maybe abstract) arguments, e.g. for XLA's analyses."""
        args = self._arguments(args)
        self._jit_for(state, args, kwargs)
        entry = self._jitted[self._current[2]]
        # A partitioner's `partition` may return a plain wrapper, without `lower`.
        jitted = entry.call if hasattr(entry.call, "lower") else jax.jit(entry.fn, **entry.flags)
        return jitted.lower(state, *args, *kwargs.values())

    def flops(self, state: PyTree, *args: Any, **kwargs: Any) -> float | None:
        """Flops of one call on ONE device (XLA's cost analysis of the partitioned program,
        compiled ahead of time: nothing runs); None where XLA gives none or a negative one."""
        cost = self.lower(state, *args, **kwargs).compile().cost_analysis()
        if isinstance(cost, list | tuple):
            cost = cost[0] if cost else None
        value = (cost or {}).get("flops")
        return None if value is None or value < 0 else float(value)
