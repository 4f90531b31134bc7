"""The STOPPED marker: how a training job tells its continuous evaluators it is done.

A training run that finishes writes a small text file beside its checkpoint directory
(``<dir>.STOPPED``), naming the step it finished at; a continuous evaluator reading that
directory stops once it has evaluated every checkpoint up to that step. A starting training
run removes a marker an earlier run left, so its evaluators do not stop early. Earlier
jaxloop releases and google/jaxloop put the marker inside the directory, as ``STOPPED``:
both places are read and cleared.

Only process 0 writes or removes the marker; readers agree on what process 0 read
(`agreement`), so this module does no collective of its own.

Example::

    stop_marker.write('/run/checkpoints', 1000)        # /run/checkpoints.STOPPED
    stop_marker.step('/run/checkpoints')               # 1000
    stop_marker.remove_stale('/run/checkpoints')       # a new run starts
"""

from __future__ import annotations

import logging
import re
from typing import Any

from etils import epath

FILE_NAME = "STOPPED"

# OuterLoop's messages keep its logger's name, which users filter on.
log = logging.getLogger("jaxloop.outer_loop")


def path(checkpoint_dir: Any) -> epath.Path:
    """Where a finished training run marks its checkpoint directory as complete.

    The marker is a sibling of the directory (``<dir>.STOPPED``: ``/run/checkpoints`` gives
    ``/run/checkpoints.STOPPED``), so the directory itself holds only what orbax writes
    (its step folders) and code that lists it counts checkpoints only. A directory with no
    parent to put it in (a file-system or bucket root) keeps it inside, as ``STOPPED``.

    Example::

        stop_marker.path('/run/checkpoints')  # epath.Path('/run/checkpoints.STOPPED')
    """
    directory = epath.Path(checkpoint_dir)
    parent = directory.parent
    if (not directory.name or parent == directory
            or (not parent.name and "://" in str(directory))):
        return directory / FILE_NAME
    return parent / f"{directory.name}.{FILE_NAME}"


def _places(checkpoint_dir: Any) -> list[epath.Path]:
    """The marker's place, then its place inside the directory (earlier jaxloop releases
    and google/jaxloop write it there)."""
    return list(dict.fromkeys([path(checkpoint_dir), epath.Path(checkpoint_dir) / FILE_NAME]))


def step(checkpoint_dir: Any) -> int | None:
    """The step recorded in the directory's marker, -1 for a marker without one (google's),
    None when there is no marker."""
    for marker in _places(checkpoint_dir):
        try:
            text = marker.read_text()
        except FileNotFoundError:
            continue
        match = re.search(r"step (\d+)", text)
        return int(match.group(1)) if match else -1
    return None


def write(checkpoint_dir: Any, finished_step: int) -> None:
    """Marks `checkpoint_dir` as complete at `finished_step` (call on process 0 only).

    The step lets an evaluator tell this marker from a stale one: a checkpoint newer than
    the marker's step belongs to a later run.
    """
    marker = path(checkpoint_dir)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"training finished at step {finished_step}\n")


def remove_stale(checkpoint_dir: Any) -> None:
    """Removes a marker an earlier run left (beside or inside the directory): it would end
    a continuous evaluator of the run that is starting (call on process 0 only)."""
    for marker in _places(checkpoint_dir):
        if marker.exists():
            log.info("Removing the STOPPED marker of an earlier run: %s", marker)
            marker.unlink(missing_ok=True)
