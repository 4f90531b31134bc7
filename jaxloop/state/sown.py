"""Sown intermediates (docs/triggers_and_debugging.md): a `Step` given ``sown=`` records the
collections a model sows (linen or nnx ``self.sow``) in every ``state.apply_fn`` call while
`run` is traced (the last call wins) and outputs them, without gradient, as
``'<collection>/<module path>/<name>'`` (scalars only unless ``sown_scalars_only=False``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

__all__ = ["Recorder", "record"]


@dataclasses.dataclass(eq=False)
class _RecordingApply:
    """An ``apply_fn`` that also asks for the recorded collections and keeps them."""

    apply_fn: Callable[..., Any]
    recorder: Recorder

    def __call__(self, variables: Any, *args: Any, mutable: Any = False, **kwargs: Any) -> Any:
        given = [] if isinstance(mutable, bool) else (
            [mutable] if isinstance(mutable, str) else list(mutable))
        recorded = [n for n in self.recorder.collections if n not in given]
        # mutable=True asks for every collection already.
        out, mutated = self.apply_fn(variables, *args, mutable=mutable is True or given + recorded,
                                     **kwargs)
        self.recorder.keep(mutated)
        if mutable is True:
            return out, mutated
        return (out, {k: v for k, v in mutated.items() if k in given}) if given else out


class Recorder:
    """The sown values of one traced `run` (see `record`)."""

    def __init__(self, collections: Sequence[str], scalars_only: bool):
        self.collections = tuple(collections)
        self._scalars_only = scalars_only
        self._values: dict[str, Any] = {}

    def keep(self, mutated: Mapping[str, Any]) -> None:
        for name in self.collections:
            for path, leaf in jax.tree_util.tree_leaves_with_path(mutated.get(name) or {}):
                # A linen sow keeps a tuple of values: one value is named by its module path.
                if path and isinstance(path[-1], jax.tree_util.SequenceKey) and path[-1].idx == 0:
                    path = path[:-1]
                key = f"{name}/{jax.tree_util.keystr(path, simple=True, separator='/')}"
                self._values[key] = jax.lax.stop_gradient(leaf)

    def outputs(self, outputs: Any) -> dict[str, Any]:
        """`outputs` with the recorded values added (ValueError: a clash, or inside a vmap/scan)."""
        merged = dict(outputs or {})
        for key, value in self._values.items():
            if key in merged:
                raise ValueError(f"Step output {key!r} exists; a sown value has that name")
            try:
                if self._scalars_only and value.size != 1:
                    continue
                merged[key] = value.reshape(()) if value.size == 1 else value + 0
            except jax.errors.UnexpectedTracerError as e:
                raise ValueError(
                    f"The sown value {key!r} was recorded inside a transformation that traces "
                    "the model on its own (jax.vmap, jax.lax.scan, jax.checkpoint) and cannot "
                    "leave it: return it from that function yourself") from e
        return merged


def record(state: Any, collections: Sequence[str], scalars_only: bool = True
           ) -> tuple[Any, Recorder]:
    """`state` with an ``apply_fn`` that records `collections`, and the `Recorder`."""
    if not hasattr(state, "apply_fn") or not hasattr(state, "replace"):
        raise TypeError("Step(sown=...) records the collections of state.apply_fn, but the state "
                        f"({type(state).__name__}) has none")
    recorder = Recorder(collections, scalars_only)
    return state.replace(apply_fn=_RecordingApply(state.apply_fn, recorder)), recorder


def restored(new_state: Any, original: Any) -> Any:
    """`new_state` with the ``apply_fn`` of `original` (the one `record` wrapped)."""
    if isinstance(getattr(new_state, "apply_fn", None), _RecordingApply):
        return new_state.replace(apply_fn=original.apply_fn)
    return new_state
