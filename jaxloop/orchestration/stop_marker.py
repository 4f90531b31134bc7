"""The STOPPED marker: how a training job tells its continuous evaluators it is done.

A finished run writes ``<dir>.STOPPED`` naming its last step (google/jaxloop's
``<dir>/STOPPED`` is read too); a starting run removes a stale one. Only process 0 writes::

    stop_marker.write('/run/checkpoints', 1000)        # /run/checkpoints.STOPPED
    stop_marker.step('/run/checkpoints')               # 1000
"""

from __future__ import annotations

import re
from typing import Any

from etils import epath

from jaxloop.orchestration import log

FILE_NAME = "STOPPED"


def path(checkpoint_dir: Any) -> epath.Path:
    """Where a finished training run marks its checkpoint directory as complete: beside
    it, so the directory holds only checkpoints (inside it for a root, as ``STOPPED``)."""
    directory = epath.Path(checkpoint_dir)
    parent = directory.parent
    if not directory.name or (not parent.name and "://" in str(directory)):
        return directory / FILE_NAME
    return parent / f"{directory.name}.{FILE_NAME}"


def _places(checkpoint_dir: Any) -> list[epath.Path]:
    # Its place, then google/jaxloop's, inside the directory.
    return list(dict.fromkeys([path(checkpoint_dir), epath.Path(checkpoint_dir) / FILE_NAME]))


def step(checkpoint_dir: Any) -> int | None:
    """The step in the directory's marker: -1 for google's (without one), None: no marker."""
    for marker in _places(checkpoint_dir):
        try:
            text = marker.read_text()
        except FileNotFoundError:
            continue
        match = re.search(r"step (\d+)", text)
        return int(match.group(1)) if match else -1
    return None


def write(checkpoint_dir: Any, finished_step: int) -> None:
    """Marks `checkpoint_dir` as complete at `finished_step` (call on process 0 only);
    the step tells an evaluator this marker from a stale one."""
    marker = path(checkpoint_dir)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"training finished at step {finished_step}\n")


def remove_stale(checkpoint_dir: Any) -> None:
    """Removes an earlier run's marker, which would end this run's evaluators (process 0 only)."""
    for marker in _places(checkpoint_dir):
        if marker.exists():
            log.debug("Removing the STOPPED marker of an earlier run: %s", marker)
            marker.unlink(missing_ok=True)
