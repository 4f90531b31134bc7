"""Mixed precision: a dtype policy for a Step's model, for linen and nnx models alike.

A `Policy` names three dtypes (as in jmp): parameters are *stored* in `param_dtype` (so the
optimizer updates them and keeps its moments in that dtype), the model *computes* in
`compute_dtype` (its parameters and floating inputs are cast on the way in), and its
*outputs* come back in `output_dtype` (so the loss is computed from float32 logits).

A Step given ``dtype_policy=`` wraps its model's ``apply_fn`` with `Policy.wrap_apply`; the
model itself is not edited. Gradients reach the float32 parameters through the casts, so
``jax.grad`` of a loss still returns float32 gradients::

    step = MyStep(jax.random.key(0), CNN(), optimizer=optax.adam(1e-3), train=True,
                  dtype_policy='bfloat16')  # = Policy(compute_dtype=jnp.bfloat16)
    state = step.initialize_model([1, 28, 28, 1])  # params float32
    # in run: state.apply_fn({'params': params}, images) computes in bfloat16, returns float32

The policy travels with the state, in its ``apply_fn``: an eval loop given the training
state computes as the training step does. Give eval steps the same policy, so states they
create or restore themselves compute alike. Checkpoints hold the float32 parameters only.

What stays as it is: integer and boolean inputs (labels, token ids, masks), PRNG keys,
non-floating keyword arguments (``train=True``), and non-parameter collections such as
``batch_stats`` (normalisation statistics stay in their stored dtype; the mutated
collections a call returns are cast back to it, so the state's dtypes never change). A layer
that sets its own ``dtype=`` keeps it: an explicit choice in the model wins.

bfloat16 has float32's exponent range and needs no loss scaling; float16 does (its
gradients underflow) and this module does not scale losses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DTypeLike = Any

_NAMES = {"params": "param_dtype", "param": "param_dtype", "compute": "compute_dtype",
          "output": "output_dtype"}


def _floating_dtype(value: DTypeLike, field: str) -> np.dtype:
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise ValueError(f"Policy {field}={value!r} is not a dtype") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"Policy {field}={dtype.name} is not a floating dtype (expected e.g. float32, "
            "bfloat16 or float16)"
        )
    return dtype


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def cast_floating(tree: Any, dtype: DTypeLike) -> Any:
    """Casts the floating-point array leaves of `tree` to `dtype`; others pass unchanged.

    Leaves already of `dtype` are returned as they are (no conversion is traced).

    Example::

        cast_floating({'x': jnp.ones(3), 'label': jnp.arange(3)}, jnp.bfloat16)
        # {'x': bfloat16[3], 'label': int32[3]}
    """
    dtype = jnp.dtype(dtype)

    def cast(x: Any) -> Any:
        if not _is_float(x) or x.dtype == dtype:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return jnp.asarray(x).astype(dtype)

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtypes a model's parameters are stored in, computed in and output in.

    The default policy is full float32 (every cast is a no-op). `get_policy` builds one
    from a string such as ``'bfloat16'``.

    Example::

        policy = Policy(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16,
                        output_dtype=jnp.float32)
        step = MyStep(key, model, optimizer, train=True, dtype_policy=policy)

    Raises:
      ValueError: a field is not a floating dtype (the message names the field).
    """

    param_dtype: DTypeLike = jnp.float32
    compute_dtype: DTypeLike = jnp.float32
    output_dtype: DTypeLike = jnp.float32

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            # Normalised to np.dtype so equal policies compare (and hash) equal.
            object.__setattr__(self, field, _floating_dtype(getattr(self, field), field))

    def cast_to_param(self, tree: Any) -> Any:
        """Casts floating leaves to `param_dtype` (what a Step does to new parameters)."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts floating leaves to `compute_dtype` (parameters and inputs of a call)."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts floating leaves to `output_dtype` (what a call returns)."""
        return cast_floating(tree, self.output_dtype)

    def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
        """A linen-style ``apply_fn(variables, *args, rngs=..., mutable=..., **kwargs)``
        that runs `apply_fn` under this policy (see the module docstring).

        Wrapping the same function with equal policies gives equal wrappers, so states
        created by one Step keep one tree structure.

        Example::

            apply = Policy(compute_dtype=jnp.bfloat16).wrap_apply(module.apply)
            logits = apply(variables, images)  # float32, computed in bfloat16
        """
        return _PolicyApply(apply_fn, self)

    def __str__(self) -> str:
        return (f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
                f"output={self.output_dtype.name}")


def get_policy(spec: str | Policy | None) -> Policy | None:
    """A `Policy` from a short name or a jmp-style string; a Policy or None pass through.

    ``'float32'`` is full precision. A single other dtype, such as ``'bfloat16'``, is mixed
    precision: parameters and outputs in float32, computation in that dtype. The long form
    names each part: ``'params=float32,compute=bfloat16,output=float32'`` (parts left out
    stay float32).

    Example::

        get_policy('bfloat16') == Policy(compute_dtype=jnp.bfloat16)  # True

    Raises:
      ValueError: an unknown part or a dtype that is not floating.
    """
    if spec is None or isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"dtype policy must be a Policy, a string or None, got {spec!r}")
    if "=" not in spec:
        return Policy(compute_dtype=spec.strip())
    fields: dict[str, str] = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        field = _NAMES.get(name.strip())
        if field is None or not value.strip():
            raise ValueError(
                f"dtype policy {spec!r}: part {part!r} is not one of params=DTYPE, "
                "compute=DTYPE, output=DTYPE"
            )
        fields[field] = value.strip()
    return Policy(**fields)


def _like(new: Any, old: Any) -> Any:
    """`new` with each floating leaf cast back to the dtype of `old`'s leaf at the same
    place (where the trees match); otherwise `new` unchanged."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        return new
    return jax.tree.map(
        lambda n, o: n.astype(o.dtype) if _is_float(n) and _is_float(o) else n, new, old
    )


@dataclasses.dataclass(frozen=True)
class _PolicyApply:
    """``apply_fn`` under a policy (a dataclass so equal wrappers compare equal: the
    TrainState keeps ``apply_fn`` in its tree structure)."""

    apply_fn: Callable[..., Any]
    policy: Policy

    def __call__(self, variables: Mapping[str, Any], *args: Any, mutable: Any = False,
                 **kwargs: Any) -> Any:
        policy = self.policy
        # Only the parameters are cast: normalisation statistics stay in float32.
        given = variables
        variables = dict(variables)
        if "params" in variables:
            variables["params"] = policy.cast_to_compute(variables["params"])
        args = policy.cast_to_compute(args)
        rngs = kwargs.pop("rngs", None)
        kwargs = policy.cast_to_compute(kwargs)
        if rngs is not None:
            kwargs["rngs"] = rngs
        out = self.apply_fn(variables, *args, mutable=mutable, **kwargs)
        if not mutable:
            return policy.cast_to_output(out)
        out, mutated = out
        # Mutated collections go back to their stored dtypes: the new state must have the
        # old one's dtypes (donated buffers, one compiled program).
        mutated = type(mutated)({
            name: _like(value, given[name]) if name in given else value
            for name, value in mutated.items()
        })
        return policy.cast_to_output(out), mutated
