"""Mixed precision: a dtype policy for a Step's model, for linen and nnx models alike.

A `Policy` (as in jmp) stores parameters in `param_dtype`, computes in `compute_dtype`
(parameters and floating inputs cast on the way in) and returns `output_dtype`; integer inputs,
PRNG keys and collections such as ``batch_stats`` keep their dtypes. A Step given
``dtype_policy=`` wraps its ``apply_fn`` (`Policy.wrap_apply`: the policy travels with the
state) or, for an NNX-native ``run``, sets the layers' dtypes (`Policy.set_layer_dtypes`).
float16 needs loss scaling, which this module does not do::

    step = MyStep(jax.random.key(0), CNN(), optimizer=optax.adam(1e-3), train=True,
                  dtype_policy='bfloat16')  # = Policy(compute_dtype=jnp.bfloat16)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

DTypeLike = Any

_NAMES = {"params": "param_dtype", "param": "param_dtype", "compute": "compute_dtype",
          "output": "output_dtype"}


def _is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def cast_floating(tree: Any, dtype: DTypeLike) -> Any:
    """Casts the floating-point array leaves of `tree` to `dtype`; others pass unchanged.

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
    """Which dtypes a model's parameters are stored in, computed in and output in (all
    float32 by default; `get_policy` reads one from a string). ValueError: a non-floating one."""

    param_dtype: DTypeLike = jnp.float32
    compute_dtype: DTypeLike = jnp.float32
    output_dtype: DTypeLike = jnp.float32

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            value = getattr(self, field)
            try:
                dtype = jnp.dtype(value)
            except TypeError as e:
                raise ValueError(f"Policy {field}={value!r} is not a dtype") from e
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(
                    f"Policy {field}={dtype.name} is not a floating dtype (expected e.g. "
                    "float32, bfloat16 or float16)")
            # Normalised to np.dtype so equal policies compare (and hash) equal.
            object.__setattr__(self, field, dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """Casts floating leaves to `param_dtype`."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts floating leaves to `compute_dtype`."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts floating leaves to `output_dtype`."""
        return cast_floating(tree, self.output_dtype)

    def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
        """A linen-style ``apply_fn(variables, *args, rngs=..., mutable=..., **kwargs)``
        that runs `apply_fn` under this policy; equal policies give equal wrappers.

        Example::

            apply = Policy(compute_dtype=jnp.bfloat16).wrap_apply(module.apply)
            logits = apply(variables, images)  # float32, computed in bfloat16
        """
        return _PolicyApply(apply_fn, self)

    def set_layer_dtypes(self, model: nnx.Module) -> None:
        """Makes `model`'s nnx layers compute in ``compute_dtype``: each module whose
        ``dtype`` is None (Flax's default, "infer from the inputs and parameters") gets
        it, as if built with ``dtype=compute_dtype``; a layer's own ``dtype=`` wins. The
        layers cast their float32 parameters as they read them, so gradients stay float32.
        jaxloop calls it on the model an NNX-native `run` receives, not on yours.
        """
        for _, module in nnx.iter_modules(model):
            if getattr(module, "dtype", ...) is None:
                module.dtype = self.compute_dtype

    def __str__(self) -> str:
        return (f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
                f"output={self.output_dtype.name}")


def get_policy(spec: str | Policy | None) -> Policy | None:
    """A `Policy` from one dtype, the compute dtype (``get_policy('bfloat16') ==
    Policy(compute_dtype=jnp.bfloat16)``), or a jmp-style string naming each part
    (``'params=float32,compute=bfloat16,output=float32'``); a Policy or None pass through."""
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
                "compute=DTYPE, output=DTYPE")
        fields[field] = value.strip()
    return Policy(**fields)


def _like(new: Any, old: Any) -> Any:
    """`new` with floating leaves cast to `old`'s dtypes where the trees match."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        return new
    return jax.tree.map(
        lambda n, o: n.astype(o.dtype) if _is_float(n) and _is_float(o) else n, new, old)


@dataclasses.dataclass(frozen=True)
class _PolicyApply:
    """``apply_fn`` under a policy; a dataclass so that equal wrappers compare equal (the
    TrainState keeps ``apply_fn`` in its tree structure)."""

    apply_fn: Callable[..., Any]
    policy: Policy

    def __call__(self, variables: Mapping[str, Any], *args: Any, mutable: Any = False,
                 **kwargs: Any) -> Any:
        policy = self.policy
        # Only the parameters are cast: normalisation statistics keep their dtype.
        cast = {name: policy.cast_to_compute(value) if name == "params" else value
                for name, value in variables.items()}
        # PRNG keys in rngs are not floating: they pass as they are.
        out = self.apply_fn(cast, *policy.cast_to_compute(args), mutable=mutable,
                            **policy.cast_to_compute(kwargs))
        if not mutable:
            return policy.cast_to_output(out)
        out, mutated = out
        # Mutated collections keep their stored dtypes (donated buffers, one program).
        mutated = type(mutated)({name: _like(value, variables[name]) if name in variables
                                 else value for name, value in mutated.items()})
        return policy.cast_to_output(out), mutated
