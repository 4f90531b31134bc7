"""Gradient accumulation: `value_and_grad` is `jax.value_and_grad` for a batch too large to
run at once: k microbatches in a `jax.lax.scan` (one's activations alive at a time), the
average loss and gradients returned, so one step stays one optimizer update::

    grad_fn = accumulate.value_and_grad(loss_fn, num_microbatches=4)
    loss, grads = grad_fn(state.params, batch, rngs=self.prng_key(state.step))

`nnx_value_and_grad` is the same for an NNX-native ``run(self, model, optimizer, batch)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["nnx_value_and_grad", "split_microbatches", "value_and_grad"]


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Reshapes every leaf ``[B, ...]`` into ``[k, B // k, ...]``; microbatch ``i`` holds
    examples ``i, i + k, ...``: strided, so a batch sharded on its first axis moves no data."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")

    def split(path: tuple, x: Any) -> Any:
        shape = jnp.shape(x)
        if not shape or shape[0] % num_microbatches:
            raise ValueError(f"Cannot split {jax.tree_util.keystr(path) or 'batch'} of shape "
                             f"{tuple(shape)} into {num_microbatches} microbatches: its leading "
                             f"(batch) size must be a multiple of {num_microbatches}")
        x = jnp.reshape(x, (shape[0] // num_microbatches, num_microbatches, *shape[1:]))
        return jnp.swapaxes(x, 0, 1)

    return jax.tree_util.tree_map_with_path(split, batch)


def _mean_or_last(stacked: Any, how: str) -> Any:
    if how == "stack":
        return stacked
    return jax.tree.map(
        lambda x: jnp.mean(x, axis=0) if jnp.issubdtype(x.dtype, jnp.inexact) else x[-1], stacked)


def _is_key(_path: tuple, x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def value_and_grad(loss_fn: Callable[..., Any], num_microbatches: int, has_aux: bool = False,
                   aux: Literal["mean", "stack"] = "mean",
                   sharding: Any = None) -> Callable[..., Any]:
    """`jax.value_and_grad` of ``loss_fn(params, microbatch, *args)`` over k microbatches.

    Args:
      loss_fn: ``(params, microbatch, *args) -> loss`` (or ``(loss, aux)``), a mean over
        the microbatch's examples; also given ``rngs=`` when the caller passes keys.
      num_microbatches: k, a divisor of the batch size; 1 is plain `jax.value_and_grad`.
      aux: ``'mean'`` averages the floating aux leaves (others keep the last
        microbatch's); ``'stack'`` returns all k along a leading axis.
      sharding: the parameters' shardings (``self.partitioner.sharding.params``): the running
        sum is constrained to it, so under FSDP each device holds only its part.

    Returns:
      ``grad_fn(params, batch, *args, rngs=None) -> (loss, grads)`` (``((loss, aux),
      grads)`` with `has_aux`), averaged, summed in float32. `rngs` is split one per
      microbatch; a typed key among `args` is a TypeError (every microbatch would reuse it).
    """
    if aux not in ("mean", "stack"):
        raise ValueError(f"aux must be 'mean' or 'stack', got {aux!r}")
    single = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def constrain(grads: Any) -> Any:
        return grads if sharding is None else jax.lax.with_sharding_constraint(grads, sharding)

    def grad_fn(params: Any, batch: Any, *args: Any, rngs: Any = None) -> Any:
        for path, leaf in jax.tree_util.tree_leaves_with_path(args):
            if _is_key(path, leaf):
                raise TypeError(
                    f"A PRNG key was passed positionally (argument "
                    f"{jax.tree_util.keystr(path)}): every microbatch would reuse it, drawing "
                    "the same dropout masks. Pass keys as rngs=..., which gives each "
                    "microbatch its own.")
        keyword = {} if rngs is None else {"rngs": rngs}
        if num_microbatches == 1:
            return single(params, batch, *args, **keyword)
        micro = split_microbatches(batch, num_microbatches)
        keys = jax.tree.map(lambda k: jax.random.split(k, num_microbatches), keyword)
        zeros = constrain(jax.tree.map(lambda p: jnp.zeros(
            jnp.shape(p), jnp.promote_types(jnp.result_type(p), "float32")), params))

        def body(carry: tuple, xs: tuple) -> tuple:
            loss_sum, grad_sum = carry
            value, grads = single(params, xs[0], *args, **xs[1])
            loss, extra = value if has_aux else (value, None)
            grad_sum = constrain(
                jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads))
            return (loss_sum + loss.astype(jnp.float32), grad_sum), extra

        (loss_sum, grad_sum), extras = jax.lax.scan(body, (jnp.float32(0.0), zeros), (micro, keys))
        loss = loss_sum / num_microbatches
        grads = jax.tree.map(
            lambda s, p: (s / num_microbatches).astype(jnp.result_type(p)), grad_sum, params)
        if has_aux:
            return (loss, _mean_or_last(extras, aux)), grads
        return loss, grads

    return grad_fn


def nnx_value_and_grad(loss_fn: Callable[..., Any], num_microbatches: int,
                       has_aux: bool = False, aux: Literal["mean", "stack"] = "mean",
                       sharding: Any = None) -> Callable[..., Any]:
    """`nnx.value_and_grad` of ``loss_fn(model, microbatch, *args)`` over k microbatches, as
    `value_and_grad` does for parameters. The model's RNG streams and `rngs` are split k ways
    (each microbatch its own dropout masks); what `loss_fn` changes in the model (BatchNorm
    statistics) is averaged over the microbatches (integers take the last one's)::

        def run(self, model, optimizer, batch):
            grad_fn = accumulate.nnx_value_and_grad(loss_fn, num_microbatches=4)
            loss, grads = grad_fn(model, batch)
            optimizer.update(model, grads)
            return {'loss': loss}
    """

    changeable = nnx.All(nnx.Not(nnx.Param), nnx.Not(_is_key))

    def grad_fn(model: nnx.Module, batch: Any, *args: Any, rngs: Any = None) -> Any:
        graphdef, params, keys, rest = nnx.split((model, rngs), nnx.Param, _is_key, ...)

        def pure(params: Any, microbatch: Any, *args: Any, rngs: Any) -> Any:
            model, given = nnx.merge(graphdef, params, rngs, rest, copy=True)
            value = loss_fn(model, microbatch, *args,
                            **({} if given is None else {"rngs": given}))
            loss, extra = value if has_aux else (value, None)
            return loss, (extra, nnx.state((model, given), changeable))

        placed = sharding
        if isinstance(sharding, Mapping):
            # The state's tree of shardings, in the nnx.State structure of the parameters.
            placed = jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(sharding))
        (loss, (extra, changed)), grads = value_and_grad(
            pure, num_microbatches, has_aux=True, aux="stack", sharding=placed)(
                params, batch, *args, rngs=keys)
        if num_microbatches > 1:  # else value_and_grad ran once, unstacked
            extra, changed = _mean_or_last(extra, aux), _mean_or_last(changed, "mean")
        nnx.update((model, rngs), changed)
        return ((loss, extra) if has_aux else loss), grads[0]  # the model's, not (model, rngs)'s

    return grad_fn
