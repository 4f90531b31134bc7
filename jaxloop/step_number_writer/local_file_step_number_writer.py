"""A step-number writer that appends to a local file."""

from __future__ import annotations

import operator
import os
import pathlib
import time

from jaxloop.step_number_writer import step_number_writer


class LocalFileStepNumberWriter(step_number_writer.StepNumberWriter):
    """Appends ``timestamp_ms:<ms>,step_number:<n>`` lines to a local file, created empty (a
    restarted job shows as initialising again); one whole line per `write`::

        LocalFileStepNumberWriter('/tmp/run/steps.txt').write(100)
    """

    def __init__(self, file_path: str | os.PathLike[str]):
        self.file_path = os.fspath(file_path)
        pathlib.Path(self.file_path).parent.mkdir(parents=True, exist_ok=True)
        open(self.file_path, "w").close()

    def write(self, step_number: int) -> None:
        try:
            step_number = operator.index(step_number)  # ints, numpy and jax integer scalars
        except TypeError:
            raise TypeError(f"step_number must be an integer, got {step_number!r}") from None
        timestamp_ms = time.time_ns() // 1_000_000
        with open(self.file_path, "a") as f:
            f.write(f"timestamp_ms:{timestamp_ms},step_number:{step_number}\n")
