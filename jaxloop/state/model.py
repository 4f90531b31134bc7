"""Model adapters: flax linen and nnx models behind one linen-style ``apply_fn``.

nnx models are split into ``params``, ``batch_stats`` and RNG streams and merged back on
every call, so one `run` serves both APIs. Each call reseeds the streams named in ``rngs``
(a bare key seeds them all), so masks are a pure function of (base key, step); drawing from a
stream given no key is an error. In a `Step`, nnx models run in train or eval mode by the
step's ``train`` flag::

    logits = state.apply_fn({'params': params}, x, rngs=self.prng_key(state.step))
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jaxloop import types

Variables = dict[str, Any]
Model = nn.Module | type[nnx.Module] | nnx.Module
"""What a Step accepts as its model: a linen module, an nnx module class or instance."""

# The mode a Step traces its `run` in (True: train, False: eval, None: outside a Step).
_TRAIN_MODE: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "jaxloop_train_mode", default=None)


@contextlib.contextmanager
def training_mode(train: bool) -> Iterator[None]:
    """nnx models called through an adapter run in train mode (dropout on, BatchNorm on
    batch statistics) or eval mode while a function is traced in this context::

        with model.training_mode(False):
            logits = state.apply_fn({'params': state.params}, x)  # dropout off
    """
    token = _TRAIN_MODE.set(bool(train))
    try:
        yield
    finally:
        _TRAIN_MODE.reset(token)


# Folded into the step's key for the dropout stream at initialisation: far from any step
# number, so it is not the key `Step.prng_key` gives a training step.
_INIT_DROPOUT_STREAM = 0x64726F70


def init_rngs(base_prng: types.PRNGType) -> dict[str, jax.Array]:
    """The named keys a model is initialised with: a key is the ``params`` stream unsplit (as
    google/jaxloop passes it: the same parameters), with a ``dropout`` stream derived from it;
    a dict is used as given, with ``params`` (its first key) added when missing."""
    if isinstance(base_prng, Mapping):
        return {"params": next(iter(base_prng.values())), **base_prng}
    return {"params": base_prng,
            "dropout": jax.random.fold_in(base_prng, _INIT_DROPOUT_STREAM)}


class _LinenStreams(nn.Module):
    """The key of each named stream as a top-level linen module draws it (``make_rng``)."""

    names: tuple[str, ...]

    def __call__(self) -> dict[str, jax.Array]:
        return {name: self.make_rng(name) for name in self.names}


def nnx_init_rngs(base_prng: types.PRNGType) -> dict[str, jax.Array]:
    """The keys an nnx module class is built with: what linen's ``make_rng`` draws, as
    google/jaxloop's ``nnx.bridge.ToLinen`` seeds them, so the parameters agree."""
    rngs = init_rngs(base_prng)
    return _LinenStreams(tuple(rngs)).apply({}, rngs=rngs)


class ModelAdapter(abc.ABC):
    """Initialises a model (linen-style variables) and calls it the linen way (`apply` is a
    TrainState's ``apply_fn``)."""

    @abc.abstractmethod
    def init(self, base_prng: types.PRNGType, batch: Any) -> Variables:
        """The model's initial variables for an example batch."""

    @abc.abstractmethod
    def apply(self, variables: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Calls the model: ``apply(variables, *inputs, rngs=None, mutable=False, ...)``."""

    def held_variables(self) -> Variables | None:
        """The variables an nnx instance already holds (uncopied); None otherwise."""
        return None


class LinenAdapter(ModelAdapter):
    """A linen module: ``init`` and ``apply`` are the module's own."""

    def __init__(self, module: nn.Module):
        self._module = module

    def init(self, base_prng: types.PRNGType, batch: Any) -> Variables:
        return dict(self._module.init(init_rngs(base_prng), batch))

    @property
    def apply(self) -> Callable[..., Any]:  # type: ignore[override]
        return self._module.apply


class NnxAdapter(ModelAdapter):
    """An nnx module class (built with its arguments) or instance (cloned). Variables other
    than ``nnx.Param``, ``nnx.BatchStat`` and RNG streams are an error."""

    def __init__(self, model: type[nnx.Module] | nnx.Module, args: Sequence[Any] = (),
                 kwargs: Mapping[str, Any] | None = None):
        self._model = model
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self._graphdef: Any = None
        self._stats_layout: list[str] = []
        # The RNG state's shapes only: init may run abstractly.
        self._rng_layout: dict | None = None

    @property
    def model_name(self) -> str:
        return (self._model if isinstance(self._model, type) else type(self._model)).__name__

    def _build(self, base_prng: types.PRNGType) -> nnx.Module:
        if isinstance(self._model, nnx.Module):
            return nnx.clone(self._model)
        return self._model(*self._args, rngs=nnx.Rngs(**nnx_init_rngs(base_prng)), **self._kwargs)

    def describe(self, base_prng: types.PRNGType) -> None:
        """Learns the model's structure without creating arrays (for a state made elsewhere)."""
        if self._graphdef is None:
            self._variables(nnx.eval_shape(lambda: self._build(base_prng)))

    def init(self, base_prng: types.PRNGType, batch: Any) -> Variables:
        del batch  # an nnx module is built from its constructor arguments alone
        return self._variables(self._build(base_prng))

    def held_variables(self) -> Variables | None:
        return self._variables(self._model) if isinstance(self._model, nnx.Module) else None

    def _variables(self, model: nnx.Module) -> Variables:
        graphdef, params, stats, rngs, rest = nnx.split(
            model, nnx.Param, nnx.BatchStat, nnx.RngState, ...)
        others = list(nnx.to_flat_state(rest))
        if others:
            listed = ", ".join(
                f"{'/'.join(map(str, path))} ({type(var).__name__})" for path, var in others[:5])
            raise ValueError(
                f"{type(model).__name__} holds variables that are neither nnx.Param, nnx.BatchStat "
                f"nor RNG streams: {listed}. Make carried statistics nnx.BatchStat variables.")
        self._graphdef = graphdef
        self._stats_layout = ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(stats)]
        self._rng_layout = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rngs.to_pure_dict())
        variables: Variables = {"params": nnx.to_pure_dict(params, _param_leaf)}
        stats_dict = stats.to_pure_dict()
        if stats_dict:
            variables["batch_stats"] = stats_dict
        return variables

    def _placeholder_rngs(self) -> dict:
        def make(x: jax.ShapeDtypeStruct) -> jax.Array:
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                return jnp.broadcast_to(jax.random.key(0), x.shape)
            return jnp.zeros(x.shape, x.dtype)

        return jax.tree.map(make, self._rng_layout or {})

    def merge(self, variables: Mapping[str, Any]) -> nnx.Module:
        """A new model holding `variables` and placeholder RNG streams (reseeded before use)."""
        if self._graphdef is None:
            raise ValueError("The nnx model was not initialised: call Step.initialize_model")
        if "params" not in variables:
            raise ValueError(
                f"apply_fn needs variables with 'params'; got keys {sorted(variables)}")
        stats = variables.get("batch_stats") or {}
        if not stats and self._stats_layout:
            raise ValueError(
                f"{self.model_name} holds BatchNorm statistics (nnx.BatchStat: "
                f"{', '.join(self._stats_layout[:3])}), but apply_fn was given no 'batch_stats'. "
                "Pass them and keep the updated ones: y, updates = state.apply_fn({'params': "
                "params, 'batch_stats': state.batch_stats}, x, mutable=['batch_stats']); or "
                "write run the NNX way, run(self, model, optimizer, batch) (docs/features.md).")
        try:
            return nnx.merge(self._graphdef, variables["params"], stats,
                             self._placeholder_rngs())
        except ValueError as e:
            raise ValueError(f"The state's params / batch_stats do not fit {self.model_name}'s "
                             f"variables (was the state built from another model?): {e}") from e

    @staticmethod
    def split(model: nnx.Module) -> Variables:
        """`model`'s ``params`` and ``batch_stats`` as the state holds them (pure dicts)."""
        _, params, stats, _ = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
        return {"params": params.to_pure_dict(), "batch_stats": stats.to_pure_dict() or None}

    def apply(self, variables: Mapping[str, Any], *args: Any,
              rngs: Mapping[str, jax.Array] | jax.Array | None = None, mutable: Any = False,
              **kwargs: Any) -> Any:
        model = self.merge(variables)
        given = ({} if rngs is None else dict(rngs) if isinstance(rngs, Mapping)
                 else {"default": rngs, "dropout": rngs})
        streams = [s for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)]
        nnx.reseed(model, **given)  # reseeds only the streams the model holds
        counts = {id(s): s.count.get_value() for s in streams}
        train = _TRAIN_MODE.get()
        if train is not None:
            model.train() if train else model.eval()
        out = model(*args, **kwargs)
        unseeded = sorted({
            s.key.tag for s in streams
            if s.key.tag not in given and s.count.get_value() is not counts[id(s)]
        })
        if unseeded:
            raise ValueError(f"{type(model).__name__} drew random numbers from the RNG stream(s) "
                             f"{unseeded}, but apply_fn was given keys for {sorted(given)} only. "
                             f"Pass e.g. rngs={{'{unseeded[0]}': self.prng_key(state.step)}}.")
        if not mutable:
            return out
        mutated = {"batch_stats": nnx.state(model, nnx.BatchStat).to_pure_dict()}
        # What the model sowed (nnx.Intermediate), under linen's collection name.
        if mutable is True or "intermediates" in mutable:
            mutated["intermediates"] = nnx.state(model, nnx.Intermediate).to_pure_dict()
        return out, mutated


def adapt(model: Model, nnx_model_args: Sequence[Any] | None = None,
          nnx_model_kwargs: Mapping[str, Any] | None = None) -> ModelAdapter:
    """The adapter for a linen module instance, an nnx module class or an nnx instance::

        adapter = model.adapt(NnxMLP, nnx_model_args=(16, 32, 10))
        variables = adapter.init(jax.random.key(0), batch)
        logits = adapter.apply(variables, batch['x'])
    """
    nnx_model_kwargs = dict(nnx_model_kwargs or {})
    if isinstance(model, type) and issubclass(model, nnx.Module):
        if nnx_model_args is None:
            raise ValueError(
                f"{model.__name__} is an nnx module class: pass its constructor arguments "
                "as nnx_model_args=(...) (use () when it takes none besides rngs)")
        return NnxAdapter(model, nnx_model_args, nnx_model_kwargs)
    if isinstance(model, nn.Module | nnx.Module):
        if nnx_model_args is not None or nnx_model_kwargs:
            raise ValueError(
                f"nnx_model_args/kwargs ({nnx_model_args}, {sorted(nnx_model_kwargs)}) are only "
                f"for nnx module classes; {type(model).__name__} is already constructed")
        return LinenAdapter(model) if isinstance(model, nn.Module) else NnxAdapter(model)
    raise TypeError(
        f"model must be a flax linen module instance or an nnx module class, got {model!r}")


def _param_leaf(var: nnx.Variable) -> Any:
    """An nnx Param's value, boxed like linen's when annotated (partitioners read linen's)."""
    metadata = var.get_metadata()
    names = metadata.get("out_sharding")
    value = var.get_value()
    if not names:
        return value
    if isinstance(names, jax.sharding.NamedSharding):
        names = names.spec
    rules = metadata.get("sharding_rules")
    if rules:
        return nn.LogicallyPartitioned(value, names=tuple(names), rules=tuple(rules))
    return nn.Partitioned(value, names=tuple(names))
