"""Evaluations: what to evaluate (`EvalSpec`), one round of them, and when in training.

`OuterLoop` runs a round at each train loop's end, before its checkpoint, so the checkpoint
holds that evaluation and a resumed run neither repeats nor loses it. Example::

    evals = Evaluations([eval_loop], ahead=lambda loop: 0)
    results, stop = evals.run(state, [EvalSpec(dataset=eval_ds, num_steps=50)],
                              EvalContext(False, step_num=100, loop_count=1))
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from jaxloop import types
from jaxloop.launch import preemption
from jaxloop.metrics import history as history_lib
from jaxloop.orchestration import log

Output = types.Output
State = types.TrainState

STOP_LOOP = "jaxloop/stop_loop"


@dataclasses.dataclass(frozen=True)
class EvalContext:
    """What `EvalSpec.should_eval_fn` is told when deciding whether to evaluate."""

    is_continuous_eval: bool
    step_num: int
    loop_count: int


@dataclasses.dataclass
class EvalSpec:
    """One evaluation: its data and when to run it.

    Args:
      dataset: an iterable iterated afresh for every evaluation.
      dataset_iterator: alternatively, one iterator that successive evaluations continue.
      eval_loop_interval: evaluate after every this many train loops (default: every one);
        continuous evaluation ignores it.
      should_eval_fn: evaluates only where it also says so (google/jaxloop's: both agree).
    """

    dataset: Iterable[Any] | None = None
    dataset_iterator: Iterator[Any] | None = None
    num_steps: int | None = None
    eval_loop_interval: int | None = None
    should_eval_fn: Callable[[EvalContext], bool] | None = None

    def __post_init__(self) -> None:
        if self.dataset is None and self.dataset_iterator is None:
            raise ValueError("EvalSpec needs a dataset (or a dataset_iterator)")
        for name in ("num_steps", "eval_loop_interval"):
            if (value := getattr(self, name)) is not None and value <= 0:
                raise ValueError(f"EvalSpec.{name} must be positive, got {value}")

    def iterator(self) -> Iterator[Any]:
        """The batches for one evaluation."""
        if self.dataset_iterator is not None:
            return self.dataset_iterator
        from jaxloop import data  # noqa: PLC0415 (grain is only needed with datasets)

        return data.as_iterator(self.dataset)

    def should_eval(self, context: EvalContext) -> bool:
        interval = self.eval_loop_interval or 1
        if not context.is_continuous_eval and context.loop_count % interval:
            return False  # the function is not asked where the interval says no
        return self.should_eval_fn is None or bool(self.should_eval_fn(context))


# Batches an evaluation without `EvalSpec.num_steps` reads at most (docs/notebooks.md).
EVAL_STEPS_BOUND = 10_000


def last(results: Sequence[Output | None]) -> Output | None:
    """The outputs of the last eval loop that ran."""
    ran = [r for r in results if r is not None]
    return ran[-1] if ran else None


class Evaluations:
    """Runs a round of evaluations: each eval loop on its `EvalSpec`'s data, when due;
    ``ahead(loop)`` says how many batches a loop reads ahead (`Loop.prefetching`)."""

    def __init__(self, loops: list[Any], ahead: Callable[[Any], int]):
        self.loops, self._ahead = loops, ahead
        # (label, spec, batches, step) -> a context of the batches, shown as read (OuterLoop's bar).
        self.display: Callable[..., Any] = lambda *args: contextlib.nullcontext(args[2])
        self._warned_empty: set[int] = set()  # the spec indices `_report_empty` reported

    def check_specs(self, eval_specs: Sequence[EvalSpec] | None) -> list[EvalSpec]:
        """The specs as a list, one per eval loop; a TypeError or ValueError otherwise."""
        specs = list(eval_specs or [])
        if len(specs) != len(self.loops):
            raise ValueError(f"OuterLoop has {len(self.loops)} eval loops but was given "
                             f"{len(specs)} eval specs; pass one EvalSpec per eval loop")
        for i, spec in enumerate(specs):
            if not isinstance(spec, EvalSpec):
                raise TypeError(f"eval_specs[{i}] must be an EvalSpec, got {type(spec)}")
        return specs

    def run(self, state: State, specs: Sequence[EvalSpec], context: EvalContext
            ) -> tuple[list[Output | None], bool]:
        """Each due evaluation's outputs (None where not due), and whether one asked to stop."""
        results: list[Output | None] = []
        stop = False
        for index, (loop, spec) in enumerate(zip(self.loops, specs, strict=True)):
            if not spec.should_eval(context):
                results.append(None)
                continue
            # Batches read ahead would be lost to the next evaluation of a shared iterator.
            ahead = self._ahead(loop) if spec.dataset_iterator is None else 0
            with (self.display(history_lib.eval_prefix(index), spec, spec.iterator(),
                               context.step_num) as batches,
                  loop.prefetching(batches, ahead)):
                _, outputs = loop(state, batches, num_steps=spec.num_steps or EVAL_STEPS_BOUND)
            if getattr(loop, "preempted", False):  # cut short: no result; the round ends
                results.extend([None] * (len(self.loops) - index))
                break
            if getattr(loop, "num_steps_run", None) == 0 and not preemption.requested():
                self._report_empty(index, spec, context.step_num)
            elif spec.num_steps is None and loop.num_steps_run == EVAL_STEPS_BOUND:
                log.warning("eval_specs[%d] (%r): stopped after %d batches, the bound for an "
                            "EvalSpec without num_steps (an endless dataset?). Pass "
                            "EvalSpec(num_steps=...) to evaluate more or fewer.", index,
                            spec.dataset if spec.dataset is not None else spec.dataset_iterator,
                            EVAL_STEPS_BOUND)
            results.append(outputs)
            stop = stop or bool((outputs or {}).get(STOP_LOOP, False))
        return results, stop

    def _report_empty(self, index: int, spec: EvalSpec, step: int) -> None:
        """Says, once per spec, that an evaluation read no batch, and why."""
        if index in self._warned_empty:
            return
        self._warned_empty.add(index)
        cause = ("its dataset_iterator is exhausted" if spec.dataset_iterator is not None else
                 f"its dataset is an iterator ({type(spec.dataset).__name__}), which an "
                 "earlier evaluation used up" if isinstance(spec.dataset, Iterator) else
                 "its dataset is empty")
        log.warning(
            "eval_specs[%d]: the evaluation at step %d read no batch: %s, so this and later "
            "evaluations have no results (the progress bar keeps the last ones). Pass an "
            "iterable that every evaluation reads afresh as EvalSpec(dataset=...): a list, "
            "a tf.data or grain dataset.", index, step, cause)
