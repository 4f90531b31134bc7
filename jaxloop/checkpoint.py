"""Saving and restoring the whole training state with orbax.

A checkpoint step directory holds two items: ``state`` (the TrainState's arrays: step, params,
optimizer state, batch stats, written by orbax's PyTree handler, sharded and multi-process
aware) and ``meta`` (JSON: the data iterator's position and loop counters). No pickle.

Managers built the way the Jaxloop guide builds them (one unnamed `Checkpointer`) hold a
single item; jaxloop saves the state arrays there and restores either layout.

Example::

    manager = checkpoint.make_manager(workdir / 'checkpoints', max_to_keep=3)
    checkpoint.save(manager, int(state.step), state)
    state = checkpoint.restore_state(state, workdir / 'checkpoints', partitioner=partitioner)
"""

from __future__ import annotations

import logging
from typing import Any

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxloop import types

State = types.TrainState
log = logging.getLogger(__name__)

STATE_ITEM = "state"
META_ITEM = "meta"


def make_manager(
    directory: Any, *, max_to_keep: int | None = 3, async_save: bool = True, **options: Any
) -> ocp.CheckpointManager:
    """A CheckpointManager for jaxloop's two-item layout (state arrays + JSON metadata).

    Extra keyword arguments go to `ocp.CheckpointManagerOptions` (for example
    ``best_fn=...``, ``keep_period=...``).
    """
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True, **options
    )
    return ocp.CheckpointManager(
        epath.Path(directory), options=opts, item_names=(STATE_ITEM, META_ITEM)
    )


def make_best_manager(
    directory: Any, metric: str, *, mode: str = "min", k: int = 3, async_save: bool = True
) -> ocp.CheckpointManager:
    """A manager that keeps the `k` best checkpoints by `metric` (``'min'`` or ``'max'``).

    Use it in a directory of its own, beside the manager that keeps the latest checkpoints,
    with `actions.BestCheckpointAction` on an eval loop.
    """
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")

    def best_fn(metrics: dict[str, float]) -> float:
        if metric not in metrics:
            raise ValueError(f"Best-checkpoint metric {metric!r} not in {sorted(metrics)}")
        return metrics[metric]

    return make_manager(
        directory, max_to_keep=k, async_save=async_save, best_fn=best_fn, best_mode=mode,
        keep_checkpoints_without_metrics=False,
    )


def restore_best(
    state: State, directory: Any, metric: str, mode: str = "min", partitioner: Any = None,
    skip_optimizer: bool = False,
) -> State:
    """Restores the best checkpoint (by `metric`, as saved by BestCheckpointAction)."""
    manager = make_best_manager(directory, metric, mode=mode)
    try:
        best = manager.best_step()
    finally:
        manager.close()
    if best is None:
        raise ValueError(f"No checkpoint with metric {metric!r} in {directory}")
    return restore_state(state, directory, best, partitioner, skip_optimizer)


def _is_single_item(manager: ocp.CheckpointManager) -> bool:
    flag = getattr(manager, "_default_item", None)
    return bool(flag.get()) if flag is not None else False


def state_arrays(state: State) -> dict[str, Any]:
    """The array part of a TrainState as a plain nested dict (what goes into ``state``)."""
    tree = flax.serialization.to_state_dict(state)
    tree.pop("dataset_state", None)
    return tree


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: State,
    meta: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    force: bool = False,
) -> bool:
    """Saves `state` (and its data position) at `step`; asynchronous if the manager is.

    Returns whether a checkpoint was started (the manager may skip steps by its policy).
    """
    meta = {"dataset_state": state.dataset_state, **(meta or {})}
    arrays = state_arrays(state)
    if _is_single_item(manager):
        args = ocp.args.PyTreeSave(arrays)
    else:
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.PyTreeSave(arrays), META_ITEM: ocp.args.JsonSave(meta)}
        )
    return manager.save(step, args=args, metrics=metrics, force=force)


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = getattr(leaf, "shape", None)
        if shape is not None:
            out["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = tuple(
                shape
            )
    return out


def check_compatible(saved: Any, target: Any, where: str) -> None:
    """Raises ValueError naming the first leaf whose structure or shape differs."""
    saved_shapes, target_shapes = _flat_shapes(saved), _flat_shapes(target)
    missing = sorted(set(target_shapes) - set(saved_shapes))
    extra = sorted(set(saved_shapes) - set(target_shapes))
    if missing or extra:
        raise ValueError(
            f"Checkpoint {where} does not match the state's structure: leaves missing from "
            f"the checkpoint: {missing[:5]}; leaves only in the checkpoint: {extra[:5]}"
        )
    for key, shape in target_shapes.items():
        if saved_shapes[key] != shape:
            raise ValueError(
                f"Checkpoint {where}: leaf {key} has shape {saved_shapes[key]}, but the state "
                f"expects {shape}"
            )


def _abstract_target(state: State, partitioner: Any, skip: tuple[str, ...]) -> Any:
    """The state's arrays as ShapeDtypeStructs carrying the shardings to restore into."""
    plain = state.replace(dataset_state=None)
    arrays = {k: v for k, v in state_arrays(plain).items() if k not in skip}
    if partitioner is not None:
        shardings = state_arrays(partitioner.state_shardings(plain))
        shardings = {k: v for k, v in shardings.items() if k not in skip}
    else:
        default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda x: getattr(x, "sharding", None) or default, arrays)
    # The target may itself be abstract (`Step.abstract_state`): only shapes, dtypes and
    # shardings are read, so the restore needs no initialised state.
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.dtype(x.dtype), sharding=s),
        arrays,
        shardings,
    )


def _reader(directory: epath.Path, single: bool) -> ocp.CheckpointManager:
    if single:
        return ocp.CheckpointManager(directory, ocp.Checkpointer(ocp.PyTreeCheckpointHandler()))
    return ocp.CheckpointManager(
        directory,
        item_handlers={
            STATE_ITEM: ocp.PyTreeCheckpointHandler(),
            META_ITEM: ocp.JsonCheckpointHandler(),
        },
    )


def all_steps(directory: Any) -> list[int]:
    """The steps of the complete checkpoints in `directory` (half-written ones excluded)."""
    directory = epath.Path(directory)
    return sorted(ocp.utils.checkpoint_steps(directory)) if directory.exists() else []


def restore_state(
    state: State,
    directory: Any,
    step: int | None = None,
    partitioner: Any = None,
    skip_optimizer: bool = False,
) -> State:
    """Restores the checkpoint at `step` (latest if None) from `directory` into `state`.

    See `restore`, which also returns the checkpoint's metadata (loop counters).
    """
    return restore(state, directory, step, partitioner, skip_optimizer)[0]


def restore(
    state: State,
    directory: Any,
    step: int | None = None,
    partitioner: Any = None,
    skip_optimizer: bool = False,
) -> tuple[State, dict[str, Any]]:
    """Restores the checkpoint at `step` (latest if None); returns (state, metadata).

    With `skip_optimizer` the optimizer state is not read and the given one is kept (an
    evaluation state has no optimizer to restore into).

    Arrays are placed where `partitioner` places `state` (or where the given state's arrays
    are); the data iterator's position comes back in `state.dataset_state`. With no
    checkpoint in `directory`, logs and returns `state` unchanged. A checkpoint whose
    structure or shapes differ from `state` is a ValueError naming the leaf; an unreadable
    one raises, never a silent fresh start.
    """
    directory = epath.Path(directory)
    steps = all_steps(directory)
    if not steps:
        log.info("No checkpoint in %s: starting from the given state.", directory)
        return state, {}
    step = max(steps) if step is None else step
    if step not in steps:
        raise ValueError(f"No checkpoint for step {step} in {directory}; have {sorted(steps)}")
    single = (directory / str(step) / ocp.checkpoint_manager.DEFAULT_ITEM_NAME).exists()
    manager = _reader(directory, single)
    try:
        skip = ("opt_state",) if skip_optimizer else ()
        target = _abstract_target(state, partitioner, skip)
        saved = manager.item_metadata(step)
        saved = saved if single else saved[STATE_ITEM]
        saved = {k: v for k, v in getattr(saved, "tree", saved).items() if k not in skip}
        check_compatible(saved, target, str(directory / str(step)))
        restore = ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=bool(skip),
        )
        if single:
            arrays, meta = manager.restore(step, args=restore), {}
        else:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    **{STATE_ITEM: restore, META_ITEM: ocp.args.JsonRestore()}
                ),
            )
            arrays, meta = restored[STATE_ITEM], restored[META_ITEM] or {}
    finally:
        manager.close()
    plain = state.replace(dataset_state=None)
    kept = {k: v for k, v in state_arrays(plain).items() if k in skip}
    new_state = flax.serialization.from_state_dict(
        plain, {**arrays, **kept, "dataset_state": None}
    )
    log.info("Restored checkpoint step %d from %s.", step, directory)
    return new_state.replace(dataset_state=meta.get("dataset_state")), meta
