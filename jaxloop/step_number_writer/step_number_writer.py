"""The step-number writer interface.

A watcher outside the job (a scheduler, a goodput monitor) learns from it when the job
started (the writer is built then, visibly) and how far it got: ``write(step_number)``
records the step with the time of the call, and must not block training for long. Steps
may go backwards after a restart from an older checkpoint.
"""

from __future__ import annotations

import abc


class StepNumberWriter(abc.ABC):
    """Records step numbers with the time they were reached."""

    @abc.abstractmethod
    def write(self, step_number: int) -> None:
        """Records `step_number` and the current time."""
