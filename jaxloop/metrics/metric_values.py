"""A loop's outputs brought to the host as floats, in few transfers: scalars are picked by
shape and dtype before anything is copied, and a per-step list of device scalars is copied
in one transfer per `STACK_GROUP` steps. Example::

    _, outputs = eval_loop(state, eval_batches)
    metric_values.scalar_metrics(outputs, loop=eval_loop)  # {'loss': 0.31, 'accuracy': 0.9}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxloop import types

MetricWithMetadata = types.MetricWithMetadata


def fetch(value: Any) -> Any:
    """Host copy of `value`; an array spanning other processes' devices is gathered first
    (a collective: every process calls this)."""
    if (isinstance(value, jax.Array) and not value.is_fully_addressable
            and not value.is_fully_replicated):
        return multihost_utils.process_allgather(value, tiled=True)
    return jax.device_get(value)


def is_number(x: Any) -> bool:
    """Whether `x` is one number (a Python or numpy number, or a one-element bool, int or
    float array), decided without a device copy."""
    if isinstance(x, bool | int | float | np.number):
        return True
    dtype = getattr(x, "dtype", None)
    if dtype is None or np.size(x) != 1:
        return False
    # bfloat16 and the float8 types are numpy 'V' (void) kinds: jnp knows them as floats.
    return np.dtype(dtype).kind in "biu" or jnp.issubdtype(dtype, jnp.floating)


def all_numbers(values: Sequence[Any]) -> bool:
    """Whether every value is a number, deciding once per distinct type, dtype and shape."""
    kinds = {(type(v), getattr(v, "dtype", None), getattr(v, "shape", None)): v for v in values}
    return all(is_number(v) for v in kinds.values())


STACK_GROUP = 128  # per-step scalars stacked on the devices per transfer


@jax.jit
def _stack(values: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.reshape(v, ()) for v in values])


def stack_groups(values: Sequence[Any]) -> tuple[jax.Array, ...] | None:
    """A per-step list of device scalars stacked on the devices in groups of `STACK_GROUP`
    (the last padded), without waiting (`read_groups` reads them); None for a short list, host
    values, mixed dtypes or devices, or several processes (a program would be a collective)."""
    if not (len(values) > 8 and jax.process_count() == 1
            and all(isinstance(v, jax.Array) for v in values)
            and len({v.dtype for v in values}) == 1):
        return None
    groups = [list(values[i:i + STACK_GROUP]) for i in range(0, len(values), STACK_GROUP)]
    try:
        return tuple(_stack(g + [g[-1]] * (STACK_GROUP - len(g))) for g in groups)
    except ValueError:  # scalars on different devices (a list from two placements)
        return None


def read_groups(groups: Sequence[jax.Array], count: int) -> list[float]:
    """The first `count` values of `stack_groups`'s groups as host floats, in one transfer."""
    return np.concatenate(jax.device_get(list(groups)))[:count].astype(np.float64).tolist()


def host_scalars(values: list[Any]) -> list[float]:
    """A per-step list of scalars as host floats (stacked first where `stack_groups` can)."""
    groups = stack_groups(values)
    if groups is not None:
        return read_groups(groups, len(values))
    return np.asarray(fetch(values), np.float64).reshape(-1).tolist()


def computed(value: Any) -> Any:
    """A clu metric's computed value (computed on the device), or `value` itself."""
    return value.compute() if callable(getattr(value, "compute", None)) else value


def scalar_values(value: Any) -> float | list[float] | dict[str, float] | None:
    """The scalar content of a loop output as host floats (a clu Collection's as a dict),
    or None when it has none. Example::

        scalar_values(outputs['loss'])     # [0.9, 0.7, 0.6]: one per step
        scalar_values(outputs['logits'])   # None: per-example, never copied
    """
    value = computed(value)
    if isinstance(value, Mapping):
        picked = {k: v for k, v in value.items() if is_number(v)}
        return {k: float(np.asarray(v, np.float64).reshape(()))
                for k, v in fetch(picked).items()}
    if isinstance(value, list | tuple):
        return host_scalars(list(value)) if value and all_numbers(value) else None
    if is_number(value):
        return float(np.asarray(fetch(value), np.float64).reshape(()))
    return None


def mean(numbers: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """The mean of `numbers`, weighted by `weights` if there is one per number (sum > 0)."""
    usable = weights is not None and len(weights) == len(numbers) and sum(weights) > 0
    return float(np.average(np.asarray(numbers, np.float64), weights=weights if usable else None))


def example_weights(loop: Any = None) -> list[float] | None:
    """`loop.example_counts` (its last run's, per step) as floats, or None if it keeps none."""
    weights = scalar_values(list(getattr(loop, "example_counts", None) or []))
    return weights if isinstance(weights, list) else None


def scalar_summary(value: Any, weights: Sequence[float] | None = None) -> float | None:
    """One number for an output (a per-step list's mean, weighted by `weights`), or None."""
    host = scalar_values(value)
    if isinstance(host, list):
        return mean(host, weights)
    return host if isinstance(host, float) else None


def scalar_metrics(outputs: types.Output | None, weights: Sequence[float] | None = None, *,
                   loop: Any = None) -> dict[str, float]:
    """A loop's scalar outputs as floats: a per-step list gives its mean (over an eval
    `loop`'s real examples, or weighted by `weights`), a clu Collection ``key/name`` entries."""
    if weights is None:
        weights = example_weights(loop)
    metrics = {}
    for key, value in (outputs or {}).items():
        last = value[-1] if isinstance(value, list | tuple) and value else value
        if isinstance(last, MetricWithMetadata) or key.startswith("jaxloop/stop"):
            continue
        host = scalar_values(value)
        if isinstance(host, dict):
            metrics.update({f"{key}/{k}": v for k, v in host.items()})
        elif host is not None:
            metrics[key] = mean(host, weights) if isinstance(host, list) else host
    return metrics
