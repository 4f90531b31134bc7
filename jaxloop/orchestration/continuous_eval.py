"""Continuous evaluation: every checkpoint of a directory evaluated once, as training writes them.

Runs until the training job's STOPPED marker (`stop_marker`) or ``iterate_stop_fn()``
ends it; every decision is process 0's, so every process evaluates the same steps. An
evaluation job (`OuterLoop` delegates to `ContinuousEval`)::

    outer = OuterLoop(eval_loops=[EvalLoop(eval_step)],
                      checkpoint_spec=CheckpointSpec('/run/checkpoints'))
    state, outputs = outer(state, eval_specs=[EvalSpec(dataset=eval_ds)])
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from etils import epath

from jaxloop import types
from jaxloop.checkpointing import checkpoint
from jaxloop.launch import agreement
from jaxloop.orchestration import evaluation as evaluation_lib
from jaxloop.orchestration import log, stop_marker

Output = types.Output
State = types.TrainState

DEFAULT_ITERATE_INTERVAL_SECS = 10.0
# Seconds a checkpoint that failed to restore has to vanish (a deletion), else an error.
_DELETION_SECS = 5.0


@dataclasses.dataclass
class CheckpointSpec:
    """Where checkpoints live, for resuming training and for continuous evaluation.

    Args:
      iterate_stop_fn: asked (on process 0) once every checkpoint there is was evaluated;
        True ends it. None: the training job's ``STOPPED`` marker ends it.
      transforms: orbax restore transforms for `Step.restore_model`.
    """

    checkpoint_dir: Any
    iterate_interval_secs: float = DEFAULT_ITERATE_INTERVAL_SECS
    iterate_stop_fn: Callable[[], bool] | None = None
    transforms: Any = None

    def __post_init__(self) -> None:
        if not self.iterate_interval_secs >= 0:
            raise ValueError(
                f"iterate_interval_secs must be >= 0 seconds, got {self.iterate_interval_secs}")


class ContinuousEval:
    """Evaluates every checkpoint of `spec`'s directory once, in step order, restored by the
    first eval loop's step: one deleted before it is read (``max_to_keep``) is skipped with a
    warning, one that does not restore is a ValueError."""

    def __init__(self, spec: CheckpointSpec, evaluations: evaluation_lib.Evaluations):
        self._spec, self._evaluations = spec, evaluations

    def __call__(self, state: State, specs: Sequence[evaluation_lib.EvalSpec]
                 ) -> tuple[State, Output | None]:
        """The last checkpoint's state and the last eval loop's outputs (the given state
        and None when no checkpoint was evaluated)."""
        spec, directory = self._spec, epath.Path(self._spec.checkpoint_dir)
        seen: set[int] = set()
        loop_count, outputs = 0, None
        while True:
            # The marker first: a checkpoint finished before it was written is then listed.
            marker, steps = agreement.agreed(
                lambda: (stop_marker.step(directory), checkpoint.all_steps(directory)),
                phase="continuous evaluation's listing", step=max(seen, default=None))
            for ckpt_step in sorted(set(steps) - seen):
                seen.add(ckpt_step)
                restored = self._restore(state, directory, ckpt_step)
                if restored is None:
                    continue
                loop_count += 1
                results, _ = self._evaluations.run(
                    restored, specs, evaluation_lib.EvalContext(True, ckpt_step, loop_count))
                outputs = evaluation_lib.last(results) or outputs
                state = restored
            if spec.iterate_stop_fn is not None:
                if agreement.agreed(lambda: bool(spec.iterate_stop_fn()),
                                    phase="continuous evaluation's iterate_stop_fn",
                                    step=max(seen, default=None)):
                    return state, outputs
            elif marker is not None and (marker < 0 or marker >= max(seen, default=-1)):
                # (A marker older than a checkpoint was left by an earlier run.)
                return state, outputs
            time.sleep(spec.iterate_interval_secs)

    def _restore(self, state: State, directory: epath.Path, step: int) -> State | None:
        """The checkpoint at `step` restored into `state`, or None (on every process) when
        it is gone; a ValueError, on every process, when it is there but does not restore."""
        restored, error = None, None
        try:
            restored = self._evaluations.loops[0].step.restore_model(
                state, directory, step=step, transforms=self._spec.transforms)
        except Exception as e:  # every process must learn of it before deciding anything
            error = e
        failures = agreement.gathered(None if error is None else f"{type(error).__name__}: {error}",
                                      phase="continuous evaluation's restore", step=step)
        if not any(failures):
            return restored
        causes = "; ".join(f"process {i}: {text}" for i, text in enumerate(failures) if text)
        if agreement.agreed(lambda: _deleted(directory, step),
                            phase="continuous evaluation's deletion check", step=step):
            log.warning("Checkpoint step %d in %s was deleted before it could be evaluated "
                        "(max_to_keep?); skipping it. (%s)", step, directory, causes)
            return None
        raise ValueError(f"Checkpoint step {step} in {directory} failed to restore for "
                         f"evaluation: {causes}") from error


def _deleted(directory: epath.Path, step: int) -> bool:
    """Whether checkpoint `step` has left `directory`, or is leaving it (a deletion removes
    the step's directory last)."""
    deadline = time.monotonic() + _DELETION_SECS
    while step in checkpoint.all_steps(directory):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
