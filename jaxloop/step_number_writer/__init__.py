"""Step-number writers: tell an external watcher how far training has got::

    TrainLoop(step, end_actions=[actions.StepNumberAction(
        step_number_writer.LocalFileStepNumberWriter(workdir / 'steps.txt'))])
"""

from jaxloop.step_number_writer import local_file_step_number_writer, step_number_writer
from jaxloop.step_number_writer.local_file_step_number_writer import LocalFileStepNumberWriter
from jaxloop.step_number_writer.step_number_writer import StepNumberWriter

__all__ = ["LocalFileStepNumberWriter", "StepNumberWriter", "local_file_step_number_writer",
           "step_number_writer"]
