"""Configuration objects for `SimpleTrainer`: checkpointing, summaries, batch specs.

Example::

    trainer = SimpleTrainer(
        model, epochs=10, steps_per_epoch=100, batch_spec=spec,
        checkpointing_config=CheckpointingConfig(workdir, max_checkpoints=2),
        summary_config=SummaryConfig(workdir / 'tb', interval=1),
    )
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from etils import epath

from jaxloop import outer_loop, types

TrainerBatchSpec = dict[str, dict[str, types.Shape | tuple[types.Shape, Any]] | Any]
"""A batch spec for a trainer: ``{'input_features': spec, 'output_features': spec}``.

Each spec is a shape, a ``(shape, dtype)`` pair, or a dict of these, as for
`Step.initialize_model`, e.g. ``{'input_features': [8, 3], 'output_features': [8, 1]}``.
"""

CHECKPOINTS_SUBDIR = "checkpoints"
"""Checkpoints go to ``<checkpoint_dir>/checkpoints``, where google/jaxloop's trainer puts them."""


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class CheckpointingConfig:
    """Where and how often a trainer saves its state, and where it resumes from.

    Checkpoints are written to ``<checkpoint_dir>/checkpoints`` (google/jaxloop's layout),
    and `checkpoint_spec` points there, so a trainer constructed on the same directory
    resumes from the latest checkpoint (google/jaxloop's trainer wrote to the subdirectory
    but looked for checkpoints in ``checkpoint_dir`` itself, so it never resumed).

    Args:
      checkpoint_dir: the trainer's checkpoint directory (a str or path).
      max_checkpoints: how many of the latest checkpoints to keep.
      checkpoint_interval: save every this many epochs (train loops).

    Example::

        config = CheckpointingConfig('/tmp/run', max_checkpoints=2)
        config.checkpoint_spec.checkpoint_dir  # PosixPath('/tmp/run/checkpoints')
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        max_checkpoints: int = 3,
        checkpoint_interval: int = 1,
    ):
        if checkpoint_dir is None:
            raise ValueError("checkpoint_dir must be a directory path, got None")
        self.checkpoint_dir = epath.Path(checkpoint_dir)
        self.max_checkpoints = _positive_int("max_checkpoints", max_checkpoints)
        self.checkpoint_interval = _positive_int("checkpoint_interval", checkpoint_interval)
        self.checkpoint_spec = outer_loop.CheckpointSpec(
            checkpoint_dir=self.checkpoint_dir / CHECKPOINTS_SUBDIR
        )

    def __repr__(self) -> str:
        return (
            f"CheckpointingConfig(checkpoint_dir={os.fspath(self.checkpoint_dir)!r}, "
            f"max_checkpoints={self.max_checkpoints}, "
            f"checkpoint_interval={self.checkpoint_interval})"
        )


@dataclasses.dataclass(frozen=True)
class SummaryConfig:
    """Where and how often a trainer writes TensorBoard summaries.

    Training summaries go to ``<path>/train`` and evaluation summaries to ``<path>/eval``
    (two runs in TensorBoard), written with `jaxloop.metrics.writers.create_default_writer`.

    Args:
      path: the summary directory.
      interval: write every this many epochs (train loops).
      flush_each_call: flush after every write (the files are readable at once).
      asynchronous: write on a background thread; its errors surface at the next loop
        boundary.
    """

    path: str | os.PathLike[str]
    interval: int = 1
    flush_each_call: bool = False
    asynchronous: bool = True

    def __post_init__(self) -> None:
        if self.path is None:
            raise ValueError("SummaryConfig.path must be a directory path, got None")
        _positive_int("SummaryConfig.interval", self.interval)
