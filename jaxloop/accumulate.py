"""Gradient accumulation: the loss and gradients of a global batch, as k microbatches.

`value_and_grad` is `jax.value_and_grad` for a batch too large to run at once: it splits the
batch into ``num_microbatches`` microbatches, runs them one after another in a
`jax.lax.scan` (so only one microbatch's activations are alive at a time), and returns the
average loss and gradients. One step stays one optimizer update, so ``state.step`` counts
updates, not microbatches (unlike `optax.MultiSteps`, which makes k steps of one update).

For a loss that is a mean over the examples of a microbatch, the result equals the loss and
gradients of the whole batch (up to float rounding). Keys passed as ``rngs=`` are split so
that each microbatch draws its own dropout masks, and ``sharding=`` keeps the running sum
placed as the parameters are (under FSDP, split across the devices).

Example::

    class Step(step_lib.Step):
        def run(self, state, batch):
            def loss_fn(params, micro):
                logits = state.apply_fn({'params': params}, micro['x'])
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, micro['y']).mean()
            grad_fn = accumulate.value_and_grad(loss_fn, num_microbatches=4)
            loss, grads = grad_fn(state.params, batch)
            return state.apply_gradients(grads=grads), {'loss': loss}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

__all__ = ["split_microbatches", "value_and_grad"]


def _path(path: tuple) -> str:
    return jax.tree_util.keystr(path) or "batch"


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
    """Reshapes every leaf ``[B, ...]`` into ``[k, B // k, ...]`` (k = `num_microbatches`).

    Microbatch ``i`` holds examples ``i, i + k, i + 2k, ...``: strided rather than
    contiguous, so a batch split over devices along its first axis stays split the same way
    and each device cuts its own examples into k parts with no data movement.

    Raises:
      ValueError: naming the first leaf whose leading size `num_microbatches` does not
        divide.

    Example::

        split_microbatches({'x': np.arange(8)}, 4)['x'][1]  # [1, 5]
    """
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")

    def split(path: tuple, x: Any) -> Any:
        shape = jnp.shape(x)
        if not shape or shape[0] % num_microbatches:
            raise ValueError(
                f"Cannot split {_path(path)} of shape {tuple(shape)} into {num_microbatches} "
                f"microbatches: its leading (batch) size must be a multiple of "
                f"{num_microbatches}"
            )
        x = jnp.reshape(x, (shape[0] // num_microbatches, num_microbatches, *shape[1:]))
        return jnp.swapaxes(x, 0, 1)

    return jax.tree_util.tree_map_with_path(split, batch)


def _mean_or_last(stacked: Any, how: str) -> Any:
    if how == "stack":
        return stacked

    def reduce(x: jax.Array) -> jax.Array:
        # Averages make sense for floating metrics; counters and labels keep the last value.
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.mean(x, axis=0)
        return x[-1]

    return jax.tree.map(reduce, stacked)


def _reject_positional_keys(args: tuple) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(args):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"A PRNG key was passed positionally (argument {jax.tree_util.keystr(path)}): "
                "every microbatch would reuse it, drawing the same dropout masks. Pass "
                "keys as rngs=..., which gives each microbatch its own."
            )


def value_and_grad(
    loss_fn: Callable[..., Any],
    num_microbatches: int,
    has_aux: bool = False,
    aux: Literal["mean", "stack"] = "mean",
    sharding: Any = None,
) -> Callable[..., Any]:
    """`jax.value_and_grad` of ``loss_fn(params, microbatch, *args)`` over k microbatches.

    Args:
      loss_fn: ``(params, microbatch, *args) -> loss`` (or ``(loss, aux)`` with `has_aux`);
        the loss should be a mean over the microbatch's examples. Called with
        ``rngs=`` as well when the returned function is given keys.
      num_microbatches: k; the batch's leading size must be a multiple of it. 1 is plain
        `jax.value_and_grad` with no scan.
      has_aux: whether `loss_fn` returns ``(loss, aux)``.
      aux: how aux outputs of the k microbatches combine: ``'mean'`` averages floating
        leaves and keeps the last microbatch's other leaves; ``'stack'`` returns them all
        with a leading axis k.
      sharding: where the summed gradients live: the parameters' shardings, as a tree
        shaped like `params` or one `jax.sharding.Sharding` (or `PartitionSpec`) for
        all. The sum is constrained to it (`jax.lax.with_sharding_constraint`) on entry
        and after every microbatch, so under FSDP each device only ever holds its part.
        A jaxloop Step's are ``self.partitioner.sharding.params`` (FSDP, SPMD) or
        ``self.partitioner.sharding`` (data parallel). Needed because inside jit the
        parameters carry no sharding to read; None leaves the placement to XLA.

    Returns:
      ``grad_fn(params, batch, *args, rngs=None) -> (loss, grads)`` (``((loss, aux),
      grads)`` with `has_aux`), the loss and gradients being averages over the
      microbatches, accumulated in float32 (or the gradients' own wider dtype). `rngs`, a
      PRNG key or a tree of keys (``{'dropout': key}``), is split into one per microbatch
      (as one big batch draws a different dropout mask for every example) and passed to
      `loss_fn` as ``rngs=``; with k = 1 it is passed on unchanged. A typed key
      (`jax.random.key`) among `args` is a TypeError: every microbatch would reuse it.

    Example::

        def loss_fn(params, micro, rngs):
            logits = state.apply_fn({'params': params}, micro['x'], train=True,
                                    rngs={'dropout': rngs})
            return optax.softmax_cross_entropy_with_integer_labels(logits, micro['y']).mean()

        grad_fn = accumulate.value_and_grad(loss_fn, num_microbatches=4)
        loss, grads = grad_fn(state.params, batch, rngs=self.prng_key(state.step))
    """
    if aux not in ("mean", "stack"):
        raise ValueError(f"aux must be 'mean' or 'stack', got {aux!r}")
    single = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def constrain(grads: Any) -> Any:
        return grads if sharding is None else jax.lax.with_sharding_constraint(grads, sharding)

    def grad_fn(params: Any, batch: Any, *args: Any, rngs: Any = None) -> Any:
        _reject_positional_keys(args)
        keyword = {} if rngs is None else {"rngs": rngs}
        if num_microbatches == 1:
            return single(params, batch, *args, **keyword)
        micro = split_microbatches(batch, num_microbatches)
        keys = jax.tree.map(lambda k: jax.random.split(k, num_microbatches), keyword)
        zeros = constrain(jax.tree.map(
            lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(jnp.result_type(p), "float32")),
            params,
        ))

        def body(carry: tuple, xs: tuple) -> tuple:
            loss_sum, grad_sum = carry
            value, grads = single(params, xs[0], *args, **xs[1])
            loss, extra = value if has_aux else (value, None)
            grad_sum = constrain(
                jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads))
            return (loss_sum + loss.astype(jnp.float32), grad_sum), extra

        (loss_sum, grad_sum), extras = jax.lax.scan(
            body, (jnp.float32(0.0), zeros), (micro, keys))
        loss = loss_sum / num_microbatches
        grads = jax.tree.map(
            lambda s, p: (s / num_microbatches).astype(jnp.result_type(p)), grad_sum, params
        )
        if has_aux:
            return (loss, _mean_or_last(extras, aux)), grads
        return loss, grads

    return grad_fn
