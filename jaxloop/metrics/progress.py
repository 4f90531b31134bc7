"""The progress bar: `ProgressAction`, a tqdm bar updated at each loop's end.

`OuterLoop` shows one when the output is interactive; tqdm is imported only then.

Example::

    TrainLoop(step, end_actions=[actions.ProgressAction(total_steps=1000)])
"""

from __future__ import annotations

import sys
import time
from typing import Any

import jax

from jaxloop import types
from jaxloop.engine import host_count, metric_values
from jaxloop.engine.action import Action

Output = types.Output
State = types.TrainState


class ProgressAction(Action):
    """A progress bar: tqdm's widget in notebooks with ipywidgets, else a text bar.

    Shows step/total, steps/s between two updates (none after the first loop, which
    compiles), the latest train `metric` and, given a `history`, the latest evaluation's
    results with their step (``eval at step 400: accuracy=0.98, loss=0.07``). Updated at
    each loop end, never per step. `enabled=None`: only when the output is interactive.
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

    @staticmethod
    def _interactive() -> bool:
        return "ipykernel" in sys.modules or sys.stderr.isatty()

    @staticmethod
    def _bar_class() -> Any:
        """tqdm's widget bar where a notebook has ipywidgets, else its text bar (`tqdm.auto`
        would warn in every cell that ipywidgets is missing)."""
        import importlib.util  # noqa: PLC0415

        if "ipykernel" in sys.modules and importlib.util.find_spec("ipywidgets") is not None:
            from tqdm.auto import tqdm  # noqa: PLC0415 (only when a bar is shown)
        else:
            from tqdm.std import tqdm  # noqa: PLC0415
        return tqdm

    def _latest_eval(self) -> dict[str, str]:
        """The latest evaluation's results, keyed by the text the bar shows them under."""
        names = [n for n in self._history.names if n.startswith("eval/")]
        if not names:
            return {}
        series = {n.removeprefix("eval/"): self._history[n] for n in names}
        step = max(s.steps[-1] for s in series.values() if s.steps)
        values = ", ".join(f"{k}={s.values[-1]:.4g}" for k, s in series.items()
                           if s.steps and s.steps[-1] == step)
        return {f"eval at step {step}": values}

    def _latest(self, outputs: Output | None) -> dict[str, str]:
        """The latest train metric, as the bar shows it."""
        shown = {}
        if self._history is not None:
            train = self._history.latest("train")
            if self._metric in train:
                shown[self._metric] = f"{train[self._metric]:.4g}"
            return shown
        values = (outputs or {}).get(self._metric)
        if isinstance(values, list) and values:
            # The last step's value; a clu metric is computed first.
            shown[self._metric] = f"{float(jax.device_get(metric_values.computed(values[-1]))):.4g}"
        return shown

    def _show(self, refresh: bool = True) -> None:
        evaluated = self._latest_eval() if self._history is not None else {}
        parts = [f"{k}={v}" for k, v in self._postfix.items()]
        parts += [f"{k}: {v}" for k, v in evaluated.items()]
        self._bar.set_postfix_str(", ".join(parts), refresh=refresh)

    def __call__(self, state: State, outputs: Output | None, **kwargs: Any) -> None:
        if self._enabled is None:
            self._enabled = self._interactive()
        if not self._enabled:
            return
        step = host_count.host_step(state)
        if self._bar is None:
            self._bar = self._bar_class()(
                total=self._total, initial=kwargs.get("first_step") or 0, desc=self._desc,
                unit="step", dynamic_ncols=True,
                bar_format=self._COUNTER_FORMAT if self._total is None else self._BAR_FORMAT)
        bar = self._bar
        postfix = self._latest(outputs)  # read from the device: the loop's steps are done
        now = time.perf_counter()
        if self._last is not None and step > self._last[0] and now > self._last[1]:
            self._postfix["steps/s"] = f"{(step - self._last[0]) / (now - self._last[1]):.1f}"
        self._last = (step, now)
        self._postfix.update(postfix)
        self._show(refresh=False)
        bar.update(max(step - bar.n, 0))
        bar.refresh()

    def close(self) -> None:
        """Closes the bar, showing the last evaluation's results first."""
        if self._bar is not None:
            self._show()
            self._bar.close()
            self._bar = None
