"""The progress bar: `ProgressAction`, a tqdm bar updated at each loop's end (`OuterLoop`
shows one when the output is interactive; tqdm is imported only then)::

    TrainLoop(step, end_actions=[actions.ProgressAction(total_steps=1000)])
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import jax

from jaxloop import types
from jaxloop.engine import host_count
from jaxloop.hooks.action import Action
from jaxloop.metrics import history, metric_values

Output = types.Output
State = types.TrainState


class ProgressAction(Action):
    """A progress bar (tqdm's widget in notebooks with ipywidgets, else a text bar): step/total,
    steps/s, the latest train `metric` and, given a `history`, the latest evaluation's results
    (``eval at step 400: accuracy=0.98``). Updated at each loop end with the values the device
    has computed by then (it never waits). `enabled=None`: only when the output is interactive.
    """

    # tqdm's own rate and estimate would count the compilation and dispatch: left out.
    _BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    _COUNTER_FORMAT = "{desc}: {n_fmt} steps [{elapsed}{postfix}]"  # no total_steps

    def __init__(self, total_steps: int | None = None, metric: str = "loss", interval: int = 1,
                 enabled: bool | None = None, desc: str = "train", history: Any = None):
        super().__init__(interval)
        self._total = total_steps
        self._metric = metric
        self._enabled = enabled
        self._desc = desc
        self._history = history
        self._bar: Any = None
        self._last: tuple[int, float] | None = None  # (step, time) of the last update
        self._postfix: dict[str, str] = {}
        self._unread: Any = None  # without a history: the last step's value, not shown yet
        self._closed = False
        self._redirect = contextlib.ExitStack()  # the root logger's console lines, via tqdm
        self._status: str | None = None  # the running evaluation's, e.g. 'evaluating eval: 3/8'
        self._evaluated: str | None = None  # the latest evaluation's results, as shown

    @staticmethod
    def _in_kernel() -> bool:
        """Whether this runs in a Jupyter kernel (not merely beside an imported ipykernel)."""
        shell_class = getattr(sys.modules.get("ipykernel.zmqshell"), "ZMQInteractiveShell", None)
        ipython = sys.modules.get("IPython")
        return shell_class is not None and isinstance(ipython.get_ipython(), shell_class)

    def _on(self) -> bool:
        """Whether the bar is shown (`enabled=None`: where the output is interactive)."""
        if self._enabled is None:
            self._enabled = self._in_kernel() or sys.stderr.isatty()
        return self._enabled

    def _latest_eval(self, series: Mapping[str, Any]) -> str | None:
        """The latest evaluation's results as the bar shows them: ``eval at step 400: ...``."""
        evals = {n.removeprefix("eval/"): s for n, s in series.items()
                 if n.startswith("eval/") and s.steps}
        if not evals:
            return None
        step = max(s.steps[-1] for s in evals.values())
        values = ", ".join(f"{k}={s.values[-1]:.4g}" for k, s in sorted(evals.items())
                           if s.steps[-1] == step)
        return f"eval at step {step}: {values}"

    def _series(self, wait: bool) -> Mapping[str, Any]:
        """The history's series: as far as the device has computed them, unless `wait`."""
        if self._history is None:
            return {}
        return {n: self._history[n] for n in self._history.names} if wait else (
            self._history.ready())

    def _latest(self, outputs: Output | None, wait: bool) -> dict[str, str]:
        """The latest train metric the device has computed (with `wait`: the last one)."""
        if self._history is not None:
            train = self._series(wait).get(f"train/{self._metric}")
            return {self._metric: f"{train.values[-1]:.4g}"} if train and train.values else {}
        values = (outputs or {}).get(self._metric)
        if isinstance(values, list) and values:
            self._unread = values[-1]
        if self._unread is None or not (wait or history.is_ready(self._unread)):
            return {}
        value, self._unread = self._unread, None
        return {self._metric: f"{float(jax.device_get(metric_values.computed(value))):.4g}"}

    def _show(self, refresh: bool = True, wait: bool = False) -> None:
        self._postfix.update(self._latest(None, wait) if wait else {})
        self._evaluated = self._latest_eval(self._series(wait))
        self._draw(refresh)

    def _draw(self, refresh: bool = True) -> None:
        """Draws what `_show` read last and the evaluation's count (threads call it: no reads)."""
        parts = [f"{k}={v}" for k, v in self._postfix.items()]
        parts += [part for part in (self._evaluated, self._status) if part is not None]
        self._bar.set_postfix_str(", ".join(parts), refresh=refresh)

    def __call__(self, state: State, outputs: Output | None, **kwargs: Any) -> None:
        if not self._on():
            return
        step = host_count.host_step(state)
        bar = self._ensure_bar(kwargs.get("first_step") or 0)
        now = time.perf_counter()
        if self._last is not None and step > self._last[0] and now > self._last[1]:
            self._postfix["steps/s"] = f"{(step - self._last[0]) / (now - self._last[1]):.1f}"
        self._last = (step, now)
        self._postfix.update(self._latest(outputs, wait=False))
        self._show(refresh=False)
        bar.update(max(step - bar.n, 0))
        bar.refresh()

    def _ensure_bar(self, initial: int) -> Any:
        if self._bar is None:
            # Without ipywidgets, `tqdm.auto` would warn in every cell.
            if self._in_kernel() and importlib.util.find_spec("ipywidgets") is not None:
                from tqdm.auto import tqdm  # noqa: PLC0415 (only when a bar is shown)
            else:
                from tqdm.std import tqdm  # noqa: PLC0415
            self._bar = tqdm(
                total=self._total, initial=initial, desc=self._desc, unit="step",
                dynamic_ncols=True,
                bar_format=self._COUNTER_FORMAT if self._total is None else self._BAR_FORMAT)
            root = logging.getLogger()
            if any(isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
                   for h in root.handlers):
                # A log line gets a line of its own, not the end of the bar's, while it is up.
                with warnings.catch_warnings():  # tqdm.contrib imports tqdm.auto, which would
                    warnings.simplefilter("ignore")  # warn in a kernel without ipywidgets
                    from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: PLC0415

                self._redirect.enter_context(logging_redirect_tqdm([root], tqdm))
        return self._bar

    @contextlib.contextmanager
    def evaluating(self, label: str, spec: Any, batches: Iterator[Any], step: int
                   ) -> Iterator[Iterator[Any]]:
        """Inside: `batches`, with the bar showing ``evaluating <label>: n/total`` as the
        evaluation at `step` reads them (unchanged when no bar is shown)."""
        if not self._on() or self._closed:
            yield batches
            return
        totals = [n for n in (getattr(spec, "num_steps", None),
                              _length(getattr(spec, "dataset", None))) if n is not None]
        total, label = min(totals, default=None), f"evaluating {label}"
        bar = self._ensure_bar(step)
        self._evaluating(label, 0, total)
        try:
            yield self._counted(batches, label, total)
        finally:
            # Training reached `step`: the bar shows it beside that evaluation's results.
            self._status = None
            bar.update(max(step - bar.n, 0))
            self._show()

    def _evaluating(self, label: str, count: int, total: int | None) -> None:
        self._status = f"{label}: {count}" + ("" if total is None else f"/{total}")
        self._draw()

    def _counted(self, batches: Iterator[Any], label: str, total: int | None) -> Iterator[Any]:
        """An evaluation's batches, counted on the bar as read (at most ten redraws a second)."""
        drawn = 0.0
        for count, batch in enumerate(batches, 1):
            if time.monotonic() - drawn >= 0.1 or count == total:
                drawn = time.monotonic()
                self._evaluating(label, count, total)
            yield batch

    def close(self) -> None:
        """Closes the bar, showing the last evaluation's results first."""
        self._closed = True  # an evaluation after the run shows no bar of its own
        if self._bar is not None:
            self._show(wait=True)  # the last loop's values, before the call returns
            self._bar.close()
            self._bar = None
        self._redirect.close()


def _length(dataset: Any) -> int | None:
    """The number of batches of a finite dataset that says it (a list, a grain dataset)."""
    if isinstance(dataset, Sized) and not isinstance(dataset, Iterator):
        with contextlib.suppress(TypeError):  # an infinite grain dataset
            return len(dataset)
    return None

