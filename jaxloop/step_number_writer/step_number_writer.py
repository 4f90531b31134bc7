"""The step-number writer interface.

A watcher outside the training job (a scheduler, a goodput monitor) learns from a
step-number writer when the job started and how far it has got. Contract for
implementations:

- Construct the writer when the job starts, before initialisation, and make that visible
  (a file writer creates an empty file: "started, no step done yet").
- ``write(step_number)`` records the step together with the time of the call (Unix
  milliseconds). Steps may go backwards after a restart from an older checkpoint.
- ``write`` must not block training for long: local files are fine in the foreground,
  anything remote belongs on a background thread.
"""

from __future__ import annotations

import abc


class StepNumberWriter(abc.ABC):
    """Records step numbers with the time they were reached.

    Example::

        class PrintStepNumberWriter(StepNumberWriter):
            def write(self, step_number: int) -> None:
                print('reached step', step_number)
    """

    @abc.abstractmethod
    def write(self, step_number: int) -> None:
        """Records `step_number` and the current time."""
