"""Early stopping: watch one metric and decide when training has stopped improving (its state
is a small JSON dict, saved beside a checkpoint to resume exactly)."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

__all__ = ["MAXIMIZED_METRIC_TOKENS", "MetricMonitoringStopHandler", "StopTrainingError",
           "infer_mode"]

MAXIMIZED_METRIC_TOKENS: frozenset[str] = frozenset(
    {"acc", "accuracy", "auc", "precision", "recall", "f1", "score", "iou", "map"}
)
"""Name tokens that make ``mode='auto'`` maximise a metric (see `infer_mode`)."""

_REFERENCE_MAXIMIZED_SUFFIXES = ("acc", "accuracy", "auc")
_VALID_MODES = ("min", "max", "auto")
_TOKEN_SEPARATORS = re.compile(r"[/_.\-]+")


class StopTrainingError(Exception):
    """Raised to end training early, carrying the best value seen so far. Its `state` is
    the live state the stopping action was given (set by the loop that ran it)."""

    state: Any = None

    def __init__(self, message: str, best_step: int | None = None,
                 best_metric: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.best_step = best_step
        self.best_metric = best_metric

    def __str__(self) -> str:
        # The reference's wording, without its failure on a missing `best_metric`.
        if self.best_step is None and self.best_metric is None:
            return self.message
        best = "None" if self.best_metric is None else f"{self.best_metric:.4f}"
        return (f"{self.message} Training stopped early. Best Step: {self.best_step}, "
                f"Best Metric: {best}")

    def __reduce__(self) -> tuple[Any, ...]:
        # The default pickling replays only `self.args`, dropping the best info.
        return (type(self), (self.message, self.best_step, self.best_metric))


def infer_mode(metric_name: str) -> str:
    """``'max'`` or ``'min'`` for a metric name, as ``mode='auto'`` decides: ``'max'`` when a
    token (split on ``/_.-``) is in `MAXIMIZED_METRIC_TOKENS` or, as in google/jaxloop, the
    name ends with ``acc``, ``accuracy`` or ``auc`` (``'heatmap_loss'``: ``'min'``)."""
    name = metric_name.lower()
    maximized = not MAXIMIZED_METRIC_TOKENS.isdisjoint(_TOKEN_SEPARATORS.split(name))
    return "max" if maximized or name.endswith(_REFERENCE_MAXIMIZED_SUFFIXES) else "min"


def _as(convert: Any, value: Any, what: str, kind: str,
        error: type[Exception] = ValueError) -> Any:
    # operator.index accepts numpy/jax integers but refuses floats and strings; bools refused.
    try:
        if not isinstance(value, bool):
            return convert(value)
    except (TypeError, ValueError):
        pass
    raise error(f"{what} must be {kind}, got {value!r}")


class MetricMonitoringStopHandler:
    """Tracks one metric and signals when it has stopped improving (google/jaxloop's
    attributes). A value improves when it beats ``best`` (and the ``baseline``, if any) by
    more than ``min_delta``; NaN never does. `should_stop` is True after ``patience``
    consecutive non-improving updates (at least one)::

      handler = MetricMonitoringStopHandler('eval/loss', min_delta=1e-3, patience=2)
      handler.update_state(eval_loss, step)
      if handler.should_stop():
        best_loss, best_step = handler.get_best_info()
        raise StopTrainingError('eval/loss stopped improving', best_step, best_loss)
    """

    def __init__(self, monitored_metric: str, min_delta: float = 1e-8, patience: int = 10,
                 mode: str = "auto", baseline: float | None = None) -> None:
        if mode not in _VALID_MODES:
            raise ValueError(f"Invalid mode {mode!r} for monitored metric {monitored_metric!r}; "
                             f"expected one of {', '.join(repr(m) for m in _VALID_MODES)}.")
        patience = _as(operator.index, patience, "patience", "an int", TypeError)
        if patience < 0:
            raise ValueError(f"patience must be non-negative, got patience={patience}")
        min_delta = float(min_delta)
        if math.isnan(min_delta):
            raise ValueError(f"min_delta must be a number, got min_delta={min_delta}")
        if baseline is not None:
            baseline = float(baseline)
            if math.isnan(baseline):
                raise ValueError("baseline must not be NaN: no value could ever beat it")

        self.monitored_metric = monitored_metric
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.baseline = baseline
        resolved = infer_mode(monitored_metric) if mode == "auto" else mode
        self.monitored_op = jnp.less if resolved == "min" else jnp.greater
        self.reset()

    @property
    def mode(self) -> str:
        """``'min'`` or ``'max'``."""
        return "min" if self.monitored_op is jnp.less else "max"

    @property
    def wait(self) -> int:
        """Consecutive non-improving updates since the last improvement."""
        return self.patience - self._patience_left

    @property
    def patience_left(self) -> int:
        """The reference's countdown, ``patience - wait`` (stops at 0 or below)."""
        return self._patience_left

    def _initial_best(self) -> float:
        if self.baseline is not None:
            return self.baseline
        return math.inf if self.mode == "min" else -math.inf

    def reset(self) -> None:
        """Forgets every value seen: ``best`` back to its initial value, ``wait`` to 0."""
        self.best: float = self._initial_best()
        self.best_step: int = 0
        self._patience_left = self.patience
        self._initialized = self.baseline is not None

    def update_state(self, metric: float, step: int) -> bool:
        """Records one value of the metric at `step`; whether it improved on the best."""
        metric = float(metric)
        beats = (metric < self.best - self.min_delta if self.mode == "min"
                 else metric > self.best + self.min_delta)
        if beats or not (self._initialized or math.isnan(metric)):
            self.best = metric
            self.best_step = int(step)
            self._patience_left = self.patience
            self._initialized = True
            return True
        self._patience_left -= 1
        return False

    def should_stop(self) -> bool:
        """True once ``patience`` consecutive updates (at least one) failed to improve."""
        return self.wait >= max(self.patience, 1)

    def get_best_info(self) -> tuple[float, int]:
        """Returns ``(best, best_step)`` (the initial best and 0 before any improvement)."""
        return self.best, self.best_step

    def state_dict(self) -> dict[str, Any]:
        """The progress (not the configuration) as a JSON-serialisable dict, to checkpoint."""
        return {"monitored_metric": self.monitored_metric, "mode": self.mode,
                # JSON has no NaN/Infinity: stored as the strings float() reads back.
                "best": self.best if math.isfinite(self.best) else repr(self.best),
                "best_step": self.best_step,
                "wait": self.wait, "initialized": self._initialized}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores `state_dict`'s progress (ValueError: another metric or mode)."""
        missing = [k for k in ("best", "best_step", "wait") if k not in state]
        if missing:
            raise KeyError(f"state_dict is missing keys {missing}; got keys {sorted(state)}")
        for key, own in (("monitored_metric", self.monitored_metric), ("mode", self.mode)):
            if key in state and state[key] != own:
                raise ValueError(f"state_dict was saved with {key}={state[key]!r}, but this "
                                 f"handler has {key}={own!r}")
        best = state["best"] if state["best"] is None else _as(
            float, state["best"], "state_dict['best']", "a number, string or None")
        best_step = state["best_step"] if state["best_step"] is None else _as(
            operator.index, state["best_step"], "state_dict['best_step']", "an int")
        wait = _as(operator.index, state["wait"], "state_dict['wait']", "an int")
        if wait < 0:
            raise ValueError(f"state_dict['wait'] must be non-negative, got {wait!r}")
        initialized = state.get("initialized", best is not None or self.baseline is not None)
        if not isinstance(initialized, bool):
            raise ValueError(f"state_dict['initialized'] must be a bool, got {initialized!r}")
        self.best = self._initial_best() if best is None else best
        self.best_step = 0 if best_step is None else best_step
        self._patience_left = self.patience - wait
        self._initialized = initialized

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(monitored_metric={self.monitored_metric!r}, "
                f"mode={self.mode!r}, min_delta={self.min_delta}, patience={self.patience}, "
                f"baseline={self.baseline}, best={self.best}, best_step={self.best_step}, "
                f"wait={self.wait})")
