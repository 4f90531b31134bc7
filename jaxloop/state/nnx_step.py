"""`run` written the NNX way (docs/features.md, "nnx models"): a Step whose `run` takes
``model`` first gets it as an `nnx.Module`, with the objects it names (`ARGUMENTS`), merged
from the loop's state and split back while `jax.jit` traces, so the state stays a `TrainState`
of arrays. RNG streams are reseeded from ``self.prng_key(step)`` every step::

    def run(self, model, optimizer, metrics, rngs, batch):
        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, rngs)
        metrics.update(loss=loss)
        optimizer.update(model, grads)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from clu import metrics as clu_metrics
from flax import nnx

from jaxloop import types
from jaxloop.recipes import ema as ema_lib
from jaxloop.state import model as model_lib

ARGUMENTS = ("model", "optimizer", "metrics", "ema", "rngs", "batch")
"""What an NNX-native `run` may name (``model`` first)."""


def takes_model(run: Callable[..., Any]) -> bool:
    """Whether `run` (a bound ``Step.run``) is NNX-native: its first parameter is ``model``."""
    try:
        return list(inspect.signature(run).parameters)[:1] == ["model"]
    except (TypeError, ValueError):
        return False


def _arguments(step: Any) -> list[str]:
    """The objects `step.run` takes, in its order (those with defaults are left to kwargs)."""
    names = []
    for p in inspect.signature(step.run).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.name not in ARGUMENTS:
            raise TypeError(
                f"{type(step).__name__}.run takes `model` first (the NNX way: it may name "
                f"{', '.join(ARGUMENTS)}) and names {p.name!r}. " + (
                    "A linen-style run is run(self, state, batch)." if p.name == "state"
                    else "Give it a default or take it from `batch`."))
        names.append(p.name)
    return names


class _CountingOptimizer(nnx.Optimizer):
    """Counts its updates, so the state's step advances by a trace-time number (same dtype)."""

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        self.updates_made += 1
        return super().update(model, grads, **kwargs)


def _slots(optimizer: nnx.Optimizer) -> list[nnx.Variable]:
    return jax.tree.leaves(optimizer.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _optimizer(model: nnx.Module, tx: Any, state: types.TrainState) -> _CountingOptimizer:
    """An `nnx.Optimizer` holding the state's optimizer state (its `tx.init` XLA drops)."""
    optimizer = _CountingOptimizer(model, tx, wrt=nnx.Param)
    optimizer.updates_made = 0
    slots, leaves = _slots(optimizer), jax.tree.leaves(state.opt_state)
    if [jnp.shape(s.get_value()) for s in slots] != [jnp.shape(x) for x in leaves]:
        raise ValueError(
            f"The state's optimizer state ({len(leaves)} leaves) does not match "
            f"nnx.Optimizer(model, tx, wrt=nnx.Param) ({len(slots)} leaves): was the state "
            "built with another optimizer? An eval step's run takes no optimizer.")
    for slot, leaf in zip(slots, leaves, strict=True):
        slot.set_value(leaf)
    optimizer.step.set_value(jnp.asarray(state.step, jnp.uint32))
    return optimizer


def _reseed(model: nnx.Module, keys: types.PRNGType) -> None:
    """Reseeds each RNG stream the model holds from this step's key(s)."""
    tags = {s.key.tag for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)}
    given = keys if isinstance(keys, Mapping) else dict.fromkeys(tags, keys)
    missing = sorted(tags - set(given))
    if missing:
        raise ValueError(
            f"The model draws from the RNG stream(s) {missing}, but the step's base key "
            f"names only {sorted(given)}: add e.g. {{'{missing[0]}': key}}, or pass one key.")
    nnx.reseed(model, **{t: given[t] for t in tags})


def metric_outputs(metrics: nnx.Metric) -> dict[str, clu_metrics.Average]:
    """An `nnx.MultiMetric`'s entries (or one metric, as ``'metrics'``) as `clu.metrics.Average`
    of the same total and count, which a loop merges (TypeError for other metrics)."""
    entries = ({k: v for k, v in vars(metrics).items() if isinstance(v, nnx.Metric)}
               if isinstance(metrics, nnx.MultiMetric) else {"metrics": metrics})
    outputs = {}
    for name, metric in entries.items():
        if not isinstance(metric, nnx.metrics.Average):
            raise TypeError(
                f"metrics entry {name!r} is a {type(metric).__name__}, not nnx.metrics.Average "
                "or Accuracy (which a loop merges): return it from run as an output instead.")
        outputs[name] = clu_metrics.Average(total=metric.total.get_value(),
                                            count=metric.count.get_value())
    return outputs


def run(step: Any, adapter: model_lib.ModelAdapter, state: types.TrainState, batch: Any,
        *args: Any, **kwargs: Any) -> tuple[types.TrainState, dict[str, Any]]:
    """Runs ``step.run`` the NNX way on `state` (while traced): returns the state holding what
    `run` left in the objects it names, and its outputs."""
    if not isinstance(adapter, model_lib.NnxAdapter):
        raise TypeError(
            f"{type(step).__name__}.run takes `model` first (an nnx.Module), but the step's "
            f"model is a {type(step.model).__name__}, a linen module: write "
            "run(self, state, batch) and call state.apply_fn, or give the step an nnx.Module.")
    names = _arguments(step)
    adapter.describe(step.prng_key(0))  # an eval step may run a state it did not build
    model = adapter.merge({"params": state.params, "batch_stats": state.batch_stats})
    if step.dtype_policy is not None:
        step.dtype_policy.set_layer_dtypes(model)
    model.train() if step.train else model.eval()
    keys = step.prng_key(state.step)
    _reseed(model, keys)
    given: dict[str, Any] = {"model": model, "batch": batch}
    optimizer = metrics = None
    if "optimizer" in names:
        optimizer = given["optimizer"] = _optimizer(model, step.optimizer, state)
    if "metrics" in names:
        make = getattr(step, "metrics", None)
        if not callable(make):
            raise TypeError(f"{type(step).__name__}.run takes `metrics`: define "
                            "def metrics(self): return nnx.MultiMetric(...) on the step.")
        metrics = given["metrics"] = make()
    if "ema" in names:
        given["ema"] = ema_lib.NnxEma(state, lambda: state.step + (
            optimizer.updates_made if optimizer is not None else 0))
    if "rngs" in names:
        given["rngs"] = nnx.Rngs(**keys) if isinstance(keys, Mapping) else nnx.Rngs(keys)
    result = step.run(*(given[n] for n in names), *args, **kwargs)
    if result is not None and not isinstance(result, Mapping):
        raise TypeError(
            f"{type(step).__name__}.run (NNX-native) returns None or a dict of outputs, got "
            f"{type(result).__name__}: the model and optimizer are updated in place.")
    outputs = dict(result or {})
    if metrics is not None:
        for name, value in metric_outputs(metrics).items():
            if name in outputs:
                raise ValueError(f"run returned {name!r}, which its metrics also name")
            outputs[name] = value
    new_state = state.replace(**adapter.split(model))
    if "ema" in names:
        new_state = new_state.replace(ema_params=given["ema"].params)
    if optimizer is not None:
        opt_state = jax.tree.unflatten(jax.tree.structure(state.opt_state),
                                       [s.get_value() for s in _slots(optimizer)])
        new_state = new_state.replace(opt_state=opt_state,
                                      step=state.step + optimizer.updates_made)
    return new_state, outputs
