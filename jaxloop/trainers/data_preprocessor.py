"""A batch preprocessing pipeline: stages applied in order.

Example::

    preprocess = (DataPreprocessorBuilder()
                  .add_stage(lambda b: {**b, 'input_features': b['input_features'] / 255.0})
                  .add_stage(lambda b: {**b, 'output_features': b['output_features'][:, None]})
                  .build())

    class MyStep(SimpleStep):
        def preprocess_batch(self, batch):
            return preprocess(batch)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxloop import types

Batch = types.Batch
Stage = Callable[[Any], Any]


def _check_stage(stage: Any, where: str) -> Stage:
    if not callable(stage):
        raise TypeError(f"{where} must be callable (batch -> batch), got {stage!r}")
    return stage


class DataPreprocessor:
    """Calls its stages in order: ``preprocessor(batch) == stage_n(...stage_1(batch))``.

    Args:
      stages: the transformations, each ``batch -> batch``. The list is copied.
    """

    def __init__(self, stages: Sequence[Stage]):
        self._stages = [_check_stage(s, f"stages[{i}]") for i, s in enumerate(stages)]

    @property
    def stages(self) -> list[Stage]:
        """A copy of the stages, in the order they run."""
        return list(self._stages)

    def __call__(self, batch: Batch) -> Batch:
        for stage in self._stages:
            batch = stage(batch)
        return batch


class DataPreprocessorBuilder:
    """Collects stages with `add_stage` and makes a `DataPreprocessor` with `build`.

    Each `build` returns a pipeline of the stages added so far; stages added afterwards
    do not change pipelines already built.
    """

    def __init__(self) -> None:
        self._stages: list[Stage] = []

    def add_stage(self, stage: Stage) -> DataPreprocessorBuilder:
        """Appends `stage` (``batch -> batch``); returns the builder for chaining."""
        self._stages.append(_check_stage(stage, f"stage {len(self._stages)}"))
        return self

    def build(self) -> DataPreprocessor:
        """A `DataPreprocessor` running the stages added so far."""
        return DataPreprocessor(list(self._stages))
