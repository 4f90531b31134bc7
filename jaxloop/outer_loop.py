"""OuterLoop: orchestrates train loops and eval loops until training is done.

Modes:
- train only: ``outer(state, train_dataset=..., train_total_steps=..., train_loop_steps=...)``
- train + evals: add ``eval_specs=[EvalSpec(eval_ds), ...]`` with one EvalLoop per spec.
- eval only: no train loop. With a `CheckpointSpec` it evaluates every new checkpoint in the
  directory once (continuous eval) until the training job writes the ``STOPPED`` marker or
  ``iterate_stop_fn`` says stop; without one it evaluates the given state once.

Training ends at ``train_total_steps``, when the train iterator is exhausted (with a
warning), when a train or eval loop puts a truthy ``STOP_LOOP`` in its outputs, or when an
action raises `StopTrainingError` (early stopping).

Example::

    outer = OuterLoop(train_loop=train_loop, eval_loops=[eval_loop])
    state, outputs = outer(
        state,
        train_dataset=train_iter,
        train_total_steps=1000,
        train_loop_steps=100,
        eval_specs=[EvalSpec(dataset=eval_ds, num_steps=50)],
    )
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
from etils import epath

from jaxloop import actions as actions_lib
from jaxloop import checkpoint, preemption, stop_handler, types
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import train_loop as train_loop_lib

Output = types.Output
State = types.TrainState

STOP_LOOP = "jaxloop/stop_loop"
_STOP_FILE_NAME = "STOPPED"

log = logging.getLogger(__name__)


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
      dataset: an iterable (list, tf.data/grain/tfds dataset, ...) iterated afresh for
        every evaluation.
      dataset_iterator: alternatively, one iterator that successive evaluations continue.
      num_steps: steps per evaluation (None: until the dataset ends).
      eval_loop_interval: evaluate every this many train loops (default every loop).
      should_eval_fn: ``fn(EvalContext) -> bool``; overrides `eval_loop_interval`.
    """

    dataset: Iterable[Any] | None = None
    dataset_iterator: Iterator[Any] | None = None
    num_steps: int | None = None
    eval_loop_interval: int | None = None
    should_eval_fn: Callable[[EvalContext], bool] | None = None

    def __post_init__(self) -> None:
        if self.dataset is None and self.dataset_iterator is None:
            raise ValueError("EvalSpec needs a dataset (or a dataset_iterator)")
        if self.num_steps is not None and self.num_steps <= 0:
            raise ValueError(f"EvalSpec.num_steps must be positive, got {self.num_steps}")
        if self.eval_loop_interval is not None and self.eval_loop_interval <= 0:
            raise ValueError(
                f"EvalSpec.eval_loop_interval must be positive, got {self.eval_loop_interval}"
            )

    def iterator(self) -> Iterator[Any]:
        """The batches for one evaluation."""
        if self.dataset_iterator is not None:
            return self.dataset_iterator
        from jaxloop import data  # noqa: PLC0415 (grain is only needed with datasets)

        return data.as_iterator(self.dataset)

    def should_eval(self, context: EvalContext) -> bool:
        if self.should_eval_fn is not None:
            return bool(self.should_eval_fn(context))
        interval = self.eval_loop_interval or 1
        return context.is_continuous_eval or context.loop_count % interval == 0


@dataclasses.dataclass
class CheckpointSpec:
    """Where checkpoints live, for resuming training and for continuous evaluation.

    Args:
      checkpoint_dir: the orbax checkpoint directory.
      iterate_interval_secs: continuous eval polls for new checkpoints this often.
      iterate_stop_fn: ``fn(step) -> bool``; continuous eval stops once it returns True.
      transforms: optional ``fn(state) -> state`` applied to each restored state.
    """

    checkpoint_dir: Any
    iterate_interval_secs: float = 0
    iterate_stop_fn: Callable[[int], bool] | None = None
    transforms: Callable[[State], State] | None = None


class OuterLoop:
    """Runs train loops and eval loops (see the module docstring for the modes).

    Args:
      train_loop: the TrainLoop, or None for eval-only use.
      eval_loops: one EvalLoop per EvalSpec passed at call time.
      checkpoint_spec: restore from / evaluate the checkpoints in this directory.
      progress: show a progress bar (None: only when interactive).
      prefetch: batches to preprocess and put on the devices in the background while the
        current step runs (0: none). The train iterator is wrapped once for the whole
        run, so its saved position counts only the batches actually trained on.
    """

    def __init__(
        self,
        train_loop: train_loop_lib.TrainLoop | None = None,
        eval_loops: Sequence[eval_loop_lib.EvalLoop] | None = None,
        checkpoint_spec: CheckpointSpec | None = None,
        progress: bool | None = None,
        prefetch: int = 2,
    ):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self._train_loop = train_loop
        self._prefetch = prefetch
        self.preempted = False
        self._eval_loops = list(eval_loops or [])
        self._checkpoint_spec = checkpoint_spec
        self._progress = progress

    @property
    def train_loop(self) -> train_loop_lib.TrainLoop | None:
        return self._train_loop

    @property
    def eval_loops(self) -> list[eval_loop_lib.EvalLoop]:
        return self._eval_loops

    def _check_eval_specs(self, eval_specs: Sequence[EvalSpec] | None) -> list[EvalSpec]:
        specs = list(eval_specs or [])
        if len(specs) != len(self._eval_loops):
            raise ValueError(
                f"OuterLoop has {len(self._eval_loops)} eval loops but was given "
                f"{len(specs)} eval specs; pass one EvalSpec per eval loop"
            )
        for i, spec in enumerate(specs):
            if not isinstance(spec, EvalSpec):
                raise TypeError(f"eval_specs[{i}] must be an EvalSpec, got {type(spec)}")
        return specs

    def _run_evals(
        self, state: State, specs: Sequence[EvalSpec], context: EvalContext
    ) -> tuple[list[Output | None], bool]:
        results: list[Output | None] = []
        stop = False
        for loop, spec in zip(self._eval_loops, specs, strict=True):
            if not spec.should_eval(context):
                results.append(None)
                continue
            with self._prefetched(spec.iterator(), loop.step) as batches:
                _, outputs = loop(state, batches, num_steps=spec.num_steps)
            results.append(outputs)
            stop = stop or bool((outputs or {}).get(STOP_LOOP, False))
        return results, stop

    def __call__(
        self,
        state: State,
        train_dataset: Iterator[Any] | Iterable[Any] | None = None,
        train_total_steps: int | None = None,
        train_loop_steps: int | None = None,
        eval_specs: Sequence[EvalSpec] | None = None,
        log_train_total_steps: bool = True,
    ) -> tuple[State, Output | None]:
        """Runs training and evaluation; returns the final state and the last train outputs
        (None when no train loop ran)."""
        specs = self._check_eval_specs(eval_specs)
        if self._train_loop is None:
            return self._evaluate_only(state, specs), None
        if train_dataset is None:
            raise ValueError("OuterLoop has a train loop but no train_dataset was given")
        for name, value in (("train_total_steps", train_total_steps),
                            ("train_loop_steps", train_loop_steps)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        return self._train(
            state, train_dataset, train_total_steps, train_loop_steps, specs,
            log_train_total_steps,
        )

    def _prefetched(self, iterator: Iterator[Any], step: Any) -> Any:
        """The iterator with batches prepared ahead on a background thread (a context
        manager that stops the thread), or the iterator itself when prefetch is 0."""
        from jaxloop import data  # noqa: PLC0415

        if not self._prefetch:
            return contextlib.nullcontext(iterator)
        return data.prefetch_to_device(iterator, step.prepare_batch, self._prefetch)

    def _restore(self, state: State, iterator: Iterator[Any]) -> State:
        # An abstract state (`Step.abstract_state`) is restored straight into place, or
        # initialised by the step when there is nothing to restore.
        if self._checkpoint_spec is None:
            return self._train_loop.step.materialize(state)
        restored, meta = checkpoint.restore(
            state, self._checkpoint_spec.checkpoint_dir,
            partitioner=self._train_loop.step.partitioner,
        )
        if restored is state:
            return self._train_loop.step.materialize(state)
        from jaxloop import data  # noqa: PLC0415

        if restored.dataset_state is not None:
            data.restore_iterator_state(iterator, restored.dataset_state)
            # The iterator now holds the position; the state carries no host data into jit.
            restored = restored.replace(dataset_state=None)
        loop_count = meta.get("loop_count")
        if loop_count is not None:
            self._train_loop.loop_count = int(loop_count)
        return restored

    def _train(
        self,
        state: State,
        train_dataset: Any,
        total_steps: int | None,
        loop_steps: int | None,
        specs: list[EvalSpec],
        log_total_steps: bool,
    ) -> tuple[State, Output | None]:
        from jaxloop import data  # noqa: PLC0415

        train_loop = self._train_loop
        iterator = data.as_iterator(train_dataset)
        state = self._restore(state, iterator)
        step = int(state.step)
        if log_total_steps:
            log.info("Training from step %d to %s.", step, total_steps)
        progress = actions_lib.ProgressAction(total_steps=total_steps, enabled=self._progress)
        outputs: Output | None = None
        self.preempted = False
        with (
            preemption.handling_preemption(),
            self._prefetched(iterator, train_loop.step) as batches,
            contextlib.closing(progress),
        ):
            while total_steps is None or step < total_steps:
                num_steps = loop_steps
                if total_steps is not None:
                    num_steps = min(loop_steps or total_steps, total_steps - step)
                try:
                    state, outputs = train_loop(state, batches, num_steps=num_steps)
                except stop_handler.StopTrainingError as e:
                    log.info("Training stopped by an action: %s", e)
                    break
                step = int(state.step)
                progress(state, outputs, first_step=train_loop.first_step)
                if train_loop.preempted or preemption.requested():
                    self._save_on_preemption(state, outputs)
                    return state, outputs
                if train_loop.dataset_exhausted:
                    log.warning("The train dataset is exhausted at step %d; stopping.", step)
                    break
                if (outputs or {}).get(STOP_LOOP):
                    break
                context = EvalContext(False, step, train_loop.loop_count)
                try:
                    _, stop = self._run_evals(state, specs, context)
                except stop_handler.StopTrainingError as e:
                    log.info("Training stopped by an eval action: %s", e)
                    break
                if stop:
                    break
        self._finish()
        return state, outputs

    def _writers_and_managers(self) -> tuple[list[Any], list[Any]]:
        loops = [self._train_loop, *self._eval_loops]
        all_actions = [a for lp in loops if lp is not None for a in lp.end_actions]
        writers = [a.summary_writer for a in all_actions if hasattr(a, "summary_writer")]
        managers = [a for a in all_actions if isinstance(a, actions_lib.CheckpointAction)]
        return writers, managers

    def _save_on_preemption(self, state: State, outputs: Output | None) -> None:
        """Saves the state at this step boundary, waits for the write, flushes writers."""
        self.preempted = True
        writers, _ = self._writers_and_managers()
        ckpt_actions = [
            a for a in self._train_loop.end_actions
            if isinstance(a, actions_lib.CheckpointAction)
            and not isinstance(a, actions_lib.BestCheckpointAction)
        ]
        step = int(state.step)
        for action in ckpt_actions[:1]:
            if step not in action.ckpt_manager.all_steps():
                action(state, outputs, loop=self._train_loop, force=True)
            action.ckpt_manager.wait_until_finished()
        if not ckpt_actions:
            log.warning("Preempted at step %d, but no CheckpointAction saves the state.", step)
        for writer in writers:
            writer.flush()
        log.warning("Preempted: stopped at step %d after saving.", step)

    def _finish(self) -> None:
        """Waits for checkpoint writes, flushes writers, marks training as finished."""
        writers, ckpt_actions = self._writers_and_managers()
        for action in ckpt_actions:
            action.ckpt_manager.wait_until_finished()
        for writer in writers:
            writer.flush()
        if self._checkpoint_spec is not None and jax.process_index() == 0:
            marker = epath.Path(self._checkpoint_spec.checkpoint_dir) / _STOP_FILE_NAME
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("training finished\n")

    def _evaluate_only(self, state: State, specs: list[EvalSpec]) -> State:
        if not self._eval_loops:
            raise ValueError("OuterLoop has neither a train loop nor eval loops")
        spec = self._checkpoint_spec
        if spec is None:
            self._run_evals(state, specs, EvalContext(False, int(state.step), 1))
            return state
        directory = epath.Path(spec.checkpoint_dir)
        partitioner = self._eval_loops[0].step.partitioner
        seen: set[int] = set()
        loop_count = 0
        while True:
            # Read the marker before listing: a checkpoint finished before the marker was
            # written is then always seen by the listing that follows.
            stopped = (directory / _STOP_FILE_NAME).exists()
            steps = sorted(set(checkpoint.all_steps(directory)) - seen)
            for ckpt_step in steps:
                seen.add(ckpt_step)
                restored = checkpoint.restore_state(
                    state, directory, ckpt_step, partitioner, skip_optimizer=True
                )
                if spec.transforms is not None:
                    restored = spec.transforms(restored)
                loop_count += 1
                self._run_evals(restored, specs, EvalContext(True, ckpt_step, loop_count))
                state = restored
                if spec.iterate_stop_fn is not None and spec.iterate_stop_fn(ckpt_step):
                    return state
            if stopped:
                return state
            time.sleep(spec.iterate_interval_secs)
