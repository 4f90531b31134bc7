"""The scalars a run reported, per step, kept on the host for plots and tables.

`OuterLoop.history` records the train loop's scalar outputs at their steps and each eval
loop's results at the step evaluated (``train/<key>``, ``eval/<key>``, ``eval_<i>/<key>``).
With checkpoints it is kept on disk beside them (`file_path`), appended as it grows
(`save_file`), and a resume reads it back up to the restored step (`load_file`)::

    outer.history['eval/accuracy'].values[-1]
    outer.history.plot()             # a matplotlib figure: one panel per metric
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from etils import epath

from jaxloop import types
from jaxloop.engine import outputs as outputs_lib
from jaxloop.metrics import metric_values

TRAIN = "train"
EVAL = "eval"
_STATS_PREFIX = "jaxloop/"
_WEIGHTS = _STATS_PREFIX + "example_weights"  # an eval loop's, pending beside its outputs
FILE_SUFFIX = ".history.jsonl"

log = logging.getLogger(__name__)


class Series(NamedTuple):
    """One metric's recorded values and their steps."""

    steps: list[int]
    values: list[float]


class Stacked(NamedTuple):
    """A per-step list of device scalars stacked on the devices, read in one transfer."""

    groups: tuple[jax.Array, ...]
    count: int

    def read(self) -> list[float]:
        return metric_values.read_groups(self.groups, self.count)


def stacked(values: list[Any]) -> list[Any] | Stacked:
    """`values` (device scalars) stacked now, behind the steps that compute them, so a later
    read waits for nothing queued after them (`metric_values.stack_groups`); else `values`."""
    groups = metric_values.stack_groups(values) if metric_values.all_numbers(values) else None
    return values if groups is None else Stacked(groups, len(values))


def is_ready(tree: Any) -> bool:
    """Whether the device has computed every array of `tree` (asked without waiting)."""
    return all(x.is_ready() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def eval_prefix(index: int) -> str:
    """``eval``, then ``eval_1``, ``eval_2``, ..."""
    return EVAL if index == 0 else f"{EVAL}_{index}"


class History:
    """The scalars of a run by name (``train/loss``, ``eval/accuracy``), each a `Series`."""

    def __init__(self) -> None:
        self._series: dict[str, Series] = {}
        self._warned_nonfinite = False
        # Loop outputs not read yet: (prefix, step, scalar outputs, first_step).
        self._pending: list[tuple[str, int, dict[str, Any], int | None]] = []
        # Per file written: per series, the first index the file does not hold yet.
        self._unwritten: dict[str, dict[str, int]] = {}

    def _settled(self, ready_only: bool = False) -> dict[str, Series]:
        """The series, pending loop outputs read in order (`ready_only`: those computed)."""
        while self._pending and (not ready_only or is_ready(self._pending[0][2])):
            self._read(*self._pending.pop(0))
        return self._series

    def ready(self) -> Mapping[str, Series]:
        """The series as far as the device has computed them, never waiting (what a progress
        display shows): pending loop outputs are read only where ready. Do not modify."""
        return self._settled(ready_only=True)

    def __contains__(self, name: object) -> bool:
        return name in self._settled()

    def __getitem__(self, name: str) -> Series:
        if name not in self._settled():
            raise KeyError(f"No metric {name!r} in the history; it has {self.names}")
        # A copy: what a notebook took stays as it was when the next cell trains on.
        return Series(*map(list, self._series[name]))

    def __len__(self) -> int:
        return len(self._settled())

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}: {len(s.steps)}" for name, s in self._settled().items())
        return f"History({sizes})"

    @property
    def names(self) -> list[str]:
        """The recorded metrics' names, sorted."""
        return sorted(self._settled())

    def record(self, name: str, steps: Sequence[int], values: Sequence[float]) -> None:
        """Appends values at ascending `steps` to `name`, replacing those from ``steps[0]`` on."""
        if len(steps) != len(values):
            raise ValueError(f"{name}: {len(steps)} steps but {len(values)} values")
        if steps:
            self._settled()
            self._append(name, steps, values)

    def _append(self, name: str, steps: Sequence[int], values: Sequence[float]) -> None:
        # Not `record`: reading one pending loop must not read (and wait for) the next first.
        if not self._warned_nonfinite and name.startswith(f"{TRAIN}/") and "loss" in name:
            bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
            if bad is not None:  # once per history: the values are on the host already
                self._warned_nonfinite = True
                log.warning("%s is %s at step %d, the first non-finite value. "
                            "jaxloop.recipes.guard.NonFiniteGuard skips (or stops at) such "
                            "updates.", name, values[bad], steps[bad])
        series = self._series.setdefault(name, Series([], []))
        keep = bisect.bisect_left(series.steps, steps[0])
        for unwritten in self._unwritten.values():
            unwritten[name] = min(unwritten.get(name, keep), keep)
        series.steps[keep:] = map(int, steps)
        series.values[keep:] = map(float, values)

    def record_outputs(self, prefix: str, step: int, outputs: types.Output | None,
                       first_step: int | None = None, weights: Sequence[Any] | None = None) -> None:
        """Records a loop's scalar outputs under ``prefix/<key>`` without waiting for the
        device: a per-step list of ``step - first_step`` values gives one value per step,
        any other scalar output (weighted per step by `weights`) one value at `step`."""
        scalars = {k: stacked(list(v)) if type(v) in (list, outputs_lib.StepList) else v
                   for k, v in (outputs or {}).items()
                   if not k.startswith(_STATS_PREFIX) and _scalar_like(v)}
        if weights:  # under a name no recorded output has (stats are left out)
            scalars[_WEIGHTS] = list(weights)
        self._settled(ready_only=True)  # what earlier loops recorded, where computed
        self._pending.append((prefix, step, scalars, first_step))

    def _read(self, prefix: str, step: int, outputs: dict[str, Any],
              first_step: int | None) -> None:
        outputs = {k: v.read() if isinstance(v, Stacked) else v for k, v in outputs.items()}
        weights = metric_values.scalar_values(outputs.pop(_WEIGHTS, None))
        if first_step is not None:
            for key in list(outputs):
                host = metric_values.scalar_values(outputs[key])
                if isinstance(host, list) and len(host) == step - first_step:
                    self._append(f"{prefix}/{key}", range(first_step + 1, step + 1), host)
                    del outputs[key]
        for key, value in metric_values.scalar_metrics(outputs, weights).items():
            self._append(f"{prefix}/{key}", [step], [value])

    def steps_after(self, step: int) -> tuple[int, int, list[str]] | None:
        """(first step, last step, metric names) of what is recorded after `step`, or None:
        what a run restarted from `step` replaces, e.g. ``(201, 500, ['train/loss'])``."""
        later = {name: [s for s in series.steps if s > step]
                 for name, series in self._series.items()}
        for prefix, last, outputs, first in self._pending:  # their steps, read on the host
            for key, value in outputs.items():
                if key != _WEIGHTS:
                    count = value.count if isinstance(value, Stacked) else (
                        len(value) if type(value) is list else None)
                    per_step = first is not None and count == last - first
                    later.setdefault(f"{prefix}/{key}", []).extend(
                        s for s in (range(first + 1, last + 1) if per_step else [last])
                        if s > step)
        names = sorted(name for name, steps in later.items() if steps)
        steps = [s for name in names for s in later[name]]
        return (min(steps), max(steps), names) if names else None

    def latest(self, prefix: str) -> dict[str, float]:
        """The last value of each metric under `prefix` (``train``, ``eval``), by key."""
        start = f"{prefix}/"
        return {name[len(start):]: s.values[-1] for name, s in self._settled().items()
                if name.startswith(start) and s.values}

    def as_dict(self) -> dict[str, list[Any]]:
        """A table, one row per value: ``{'name': [...], 'step': [...], 'value': [...]}``."""
        table: dict[str, list[Any]] = {"name": [], "step": [], "value": []}
        for name, series in sorted(self._settled().items()):
            table["name"] += [name] * len(series.steps)
            table["step"] += series.steps
            table["value"] += series.values
        return table

    def plot(self, names: Sequence[str] | None = None, **subplots_kwargs: Any) -> Any:
        """A pyplot figure, one panel per metric (``loss``) with its train and eval curves by
        step, each series in one colour (a script saves it: ``.savefig('history.png')``)."""
        import matplotlib.pyplot as plt  # noqa: PLC0415 (only when plotting)
        panels: dict[str, list[str]] = {}
        for name in self.names if names is None else list(names):
            self[name]  # a KeyError naming the metrics there are
            prefix, _, metric = name.partition("/")
            panels.setdefault(metric or prefix, []).append(name)
        if not panels:
            raise ValueError("The history is empty: nothing to plot (train first)")
        prefixes = sorted({n.partition("/")[0] for n in self.names},
                          key=lambda p: (p != TRAIN, p != EVAL, p))
        colours = {p: f"C{i % 10}" for i, p in enumerate(prefixes)}
        columns = min(len(panels), 3)
        rows = math.ceil(len(panels) / columns)
        subplots_kwargs.setdefault("figsize", (4.5 * columns, 3.5 * rows))
        fig, axes = plt.subplots(rows, columns, squeeze=False, **subplots_kwargs)
        for ax, (metric, members) in zip(axes.flat, panels.items(), strict=False):
            for name in members:
                series, prefix = self._series[name], name.partition("/")[0]
                ax.plot(series.steps, series.values, "-" if prefix == TRAIN else "o-",
                        label=prefix, color=colours.get(prefix))
            ax.set(title=metric, xlabel="step", ylabel=metric)
            ax.grid(alpha=0.3)
            ax.legend()
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        fig.tight_layout()
        return fig

    def state_dict(self) -> dict[str, list[list[float]]]:
        """The history as JSON (saved with each checkpoint's metadata)."""
        return {name: [s.steps, s.values] for name, s in self._settled().items()}

    def load_state_dict(self, saved: Mapping[str, Sequence[Sequence[float]]] | None) -> None:
        """Replaces the history with one saved by `state_dict` (None: keeps it)."""
        if saved is None:
            return
        self._pending, self._unwritten = [], {}
        self._series = {name: Series([int(s) for s in steps], [float(v) for v in values])
                        for name, (steps, values) in saved.items()}

    def save_file(self, path: Any) -> None:
        """Brings the JSON-lines file at `path` up to date: appends what was recorded since
        the last call (the whole history the first time, and after a load), synced to disk.
        Each line is one `record` call: replayed in order, they give this history back."""
        path = epath.Path(path)
        series = self._settled()
        unwritten = self._unwritten.get(str(path))
        lines = [json.dumps({"name": name, "steps": s.steps[start:], "values": s.values[start:]})
                 for name, s in series.items()
                 if (start := 0 if unwritten is None else unwritten.get(name, 0)) < len(s.steps)]
        new = unwritten is None  # a new file: written whole, then renamed into place
        if new or lines:
            target = path.parent / f"{path.name}.tmp" if new else path
            with target.open("w" if new else "a") as f:
                f.write("".join(line + "\n" for line in lines))
                # A checkpoint saved after this is never found without the history to its step.
                f.flush()
                with contextlib.suppress(AttributeError, OSError, ValueError):
                    os.fsync(f.fileno())
            if new:
                target.replace(path)
        self._unwritten[str(path)] = {name: len(s.steps) for name, s in series.items()}

    def load_file(self, path: Any, step: int) -> bool:
        """Replaces the history with the one `save_file` wrote to `path`, up to `step` (a
        run killed after its last checkpoint wrote values past it); whether there was one."""
        path = epath.Path(path)
        if not path.exists():
            return False
        self.load_state_dict({})
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    break  # the process was killed while writing it
                raise ValueError(f"{path}, line {i + 1}, is not a history record") from None
            keep = bisect.bisect_right(entry["steps"], step)
            self.record(entry["name"], entry["steps"][:keep], entry["values"][:keep])
        return True

    def recorder(self, prefix: str, per_step: bool) -> Callable[[Any, Any, Any], None]:
        """A loop-end phase (`ActionLoop.phases`) that records the loop's outputs under
        `prefix`: per step from the loop's first step (a train loop's), or at its step."""

        def record(state: Any, outputs: types.Output | None, context: Any) -> None:
            if state is not None and outputs:
                self.record_outputs(prefix, context.step, outputs,
                                    context.first_step if per_step else None,
                                    getattr(context.loop, "example_counts", None))

        return record


def file_path(checkpoint_dir: Any) -> epath.Path:
    """Where the history of checkpoints in `checkpoint_dir` lives: beside that directory
    (which holds step folders only), e.g. ``runs/a/checkpoints.history.jsonl``."""
    directory = epath.Path(checkpoint_dir)
    return directory.parent / f"{directory.name}{FILE_SUFFIX}"


def _scalar_like(value: Any) -> bool:
    """Whether `value` may hold a scalar, decided from shapes alone."""
    if callable(getattr(value, "compute", None)):
        return True  # a clu metric, or a loop's per-step list of them
    if isinstance(value, list | tuple):
        return bool(value) and metric_values.all_numbers(value)
    if isinstance(value, Mapping):
        return all(metric_values.is_number(v) for v in value.values())
    return metric_values.is_number(value)
