"""The step-number writer interface: a watcher outside the job learns when it started and how
far it got (steps may go backwards after a restart from an older checkpoint)."""

from __future__ import annotations

import abc


class StepNumberWriter(abc.ABC):
    """Records step numbers with the time they were reached."""

    @abc.abstractmethod
    def write(self, step_number: int) -> None:
        """Records `step_number` and the current time."""
