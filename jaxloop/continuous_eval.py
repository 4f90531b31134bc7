"""Continuous evaluation: every checkpoint of a directory evaluated once, as training writes them.

An evaluation job beside a training job (`OuterLoop` with eval loops, no train loop and a
`CheckpointSpec`) evaluates each new checkpoint of the directory once, in step order, until
the training job writes its STOPPED marker (`stop_marker`) or ``iterate_stop_fn()`` says
stop. A checkpoint the trainer's ``max_to_keep`` deletes before it is read (its directory
is gone) is skipped with a warning; one that is there but does not restore (a corrupt file,
another model's shapes) is a ValueError naming its step and the cause.

With several processes every decision that gates a collective is process 0's, taken by all
(`agreement`): which checkpoints are read, whether the marker or ``iterate_stop_fn()`` ends
it, and whether a checkpoint that failed to restore on any process is gone (skipped) or an
error; so every process evaluates the same steps.

Example, an evaluation job (`OuterLoop` delegates to `ContinuousEval`)::

    outer = OuterLoop(eval_loops=[EvalLoop(eval_step)],
                      checkpoint_spec=CheckpointSpec('/run/checkpoints'))
    state, outputs = outer(state, eval_specs=[EvalSpec(dataset=eval_ds)])
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from etils import epath

from jaxloop import agreement, checkpoint, stop_marker, types
from jaxloop import evaluation as evaluation_lib

Output = types.Output
State = types.TrainState

DEFAULT_ITERATE_INTERVAL_SECS = 10.0
# How long continuous eval waits for the directory of a checkpoint that failed to restore to
# disappear (a deletion under way) before it takes the failure for an error.
_DELETION_SECS = 5.0

# OuterLoop's messages keep its logger's name, which users filter on.
log = logging.getLogger("jaxloop.outer_loop")


@dataclasses.dataclass
class CheckpointSpec:
    """Where checkpoints live, for resuming training and for continuous evaluation.

    Args:
      checkpoint_dir: the orbax checkpoint directory.
      iterate_interval_secs: continuous eval looks for new checkpoints every this many
        seconds (a pause between listings of a possibly remote directory).
      iterate_stop_fn: ``fn() -> bool``, asked by continuous eval whenever it has
        evaluated every checkpoint there is; True ends it (with several processes, process
        0 asks and every process follows). By default it ends when the training job has
        written its ``STOPPED`` marker (at `stop_marker_path` ``(checkpoint_dir)``, or
        inside the directory where earlier releases and google/jaxloop write it).
        ``lambda: True`` evaluates the checkpoints present once and returns.
      transforms: orbax restore transforms, passed to `Step.restore_model` (see
        `checkpoint.restore`), e.g. ``{r'params/head/.*': ocp.Transform(use_fallback=True)}``.
    """

    checkpoint_dir: Any
    iterate_interval_secs: float = DEFAULT_ITERATE_INTERVAL_SECS
    iterate_stop_fn: Callable[[], bool] | None = None
    transforms: Any = None

    def __post_init__(self) -> None:
        if not self.iterate_interval_secs >= 0:
            raise ValueError(
                f"iterate_interval_secs must be >= 0 seconds, got {self.iterate_interval_secs}"
            )


class ContinuousEval:
    """Evaluates every checkpoint of `spec`'s directory once, in step order.

    Args:
      spec: the directory, how often to look for new checkpoints, when to stop, and the
        restore transforms.
      evaluations: the eval loops (the first one's step restores the checkpoints).

    Example::

        evaluator = ContinuousEval(CheckpointSpec('/run/checkpoints'),
                                   evaluation.Evaluations([eval_loop], ahead=lambda lp: 0))
        state, outputs = evaluator(state, [EvalSpec(dataset=eval_ds)])
    """

    def __init__(self, spec: CheckpointSpec, evaluations: evaluation_lib.Evaluations):
        self._spec = spec
        self._evaluations = evaluations

    def __call__(self, state: State, specs: Sequence[evaluation_lib.EvalSpec]
                 ) -> tuple[State, Output | None]:
        """Evaluates each new checkpoint until training has finished (its STOPPED marker)
        or ``iterate_stop_fn()`` says stop; the last checkpoint's state and the last eval
        loop's outputs (the given state and None when no checkpoint was evaluated)."""
        spec = self._spec
        directory = epath.Path(spec.checkpoint_dir)
        seen: set[int] = set()
        loop_count = 0
        outputs: Output | None = None
        while True:
            # Process 0 lists (orbax's finalized steps) and every process evaluates what it
            # found. The marker is read before listing: a checkpoint finished before the
            # marker was written is then always in the listing that follows.
            marker, steps = agreement.agreed(
                lambda: (stop_marker.step(directory), checkpoint.all_steps(directory))
            )
            for ckpt_step in sorted(set(steps) - seen):
                seen.add(ckpt_step)
                restored = self._restore(state, directory, ckpt_step)
                if restored is None:
                    continue
                loop_count += 1
                results, _ = self._evaluations.run(
                    restored, specs, evaluation_lib.EvalContext(True, ckpt_step, loop_count)
                )
                outputs = evaluation_lib.last(results) or outputs
                state = restored
            if spec.iterate_stop_fn is not None:
                if agreement.agreed(lambda: bool(spec.iterate_stop_fn())):
                    return state, outputs
            elif marker is not None and (marker < 0 or marker >= max(seen, default=-1)):
                # (A marker older than a checkpoint was left by an earlier run.)
                return state, outputs
            time.sleep(spec.iterate_interval_secs)

    def _restore(self, state: State, directory: epath.Path, step: int) -> State | None:
        """The checkpoint at `step` restored into `state`, or None (on every process) when
        its directory is gone (the trainer's max_to_keep removed it meanwhile).

        Raises:
          ValueError: the checkpoint is there but does not restore (a corrupt file, another
            model's shapes), naming the step and the cause, on every process.
        """
        restored, error = None, None
        try:
            restored = self._evaluations.loops[0].step.restore_model(
                state, directory, step=step, transforms=self._spec.transforms
            )
        except Exception as e:  # every process must learn of it before deciding anything
            error = e
        failures = agreement.gathered(None if error is None else f"{type(error).__name__}: {error}")
        if not any(failures):
            return restored
        causes = "; ".join(f"process {i}: {text}" for i, text in enumerate(failures) if text)
        # Process 0 looks, and every process skips or raises alike.
        if agreement.agreed(lambda: _deleted(directory, step)):
            log.warning("Checkpoint step %d in %s was deleted before it could be evaluated "
                        "(max_to_keep?); skipping it. (%s)", step, directory, causes)
            return None
        raise ValueError(f"Checkpoint step {step} in {directory} failed to restore for "
                         f"evaluation: {causes}") from error


def _deleted(directory: epath.Path, step: int) -> bool:
    """Whether checkpoint `step` has left `directory`, or is leaving it: a deletion
    (max_to_keep's) removes the files first and the step's directory last, so a read that
    failed midway may still see it for a moment."""
    deadline = time.monotonic() + _DELETION_SECS
    while step in checkpoint.all_steps(directory):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
