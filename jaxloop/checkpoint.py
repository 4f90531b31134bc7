"""Saving and restoring the whole training state with orbax.

A checkpoint step directory holds two items: ``state`` (the TrainState's arrays: step, params,
optimizer state, batch stats, written by orbax's PyTree handler, sharded and multi-process
aware) and ``meta`` (JSON host data: each process's data-iterator position, loop counters,
early-stopping progress). The host data never enters the state, so it never enters jit. No
pickle.

Managers built the way the Jaxloop guide builds them (one unnamed `Checkpointer`) hold a
single item; jaxloop saves the state arrays there and restores either layout, including
checkpoints of a whole `TrainState` saved with ``args.PyTreeSave(state)`` by a user or by
google/jaxloop (orbax stores tuples as lists there, and no data position), and those of
jaxloop releases whose TrainState carried a ``dataset_state`` field.

Step directories are found with orbax's own step naming: a manager's ``step_prefix`` and
``step_format_fixed_length`` (``ckpt_000100``) restore like plain ``100``.

With several processes, each process's data position is saved (gathered into the JSON
item), so per-process pipelines resume where each of them stood.

Example, resume a loop called directly (`OuterLoop` does this itself)::

    manager = checkpoint.make_manager(workdir / 'checkpoints', max_to_keep=3)
    checkpoint.save(manager, int(state.step), state, dataset_state=data.iterator_state(it))
    ...
    state, meta = checkpoint.restore(state, workdir / 'checkpoints', partitioner=partitioner,
                                     dataset=it)  # `it` continues where the run stood
    state, outputs = train_loop(state, it, num_steps=100)
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxloop import agreement, types

State = types.TrainState
log = logging.getLogger(__name__)

STATE_ITEM = "state"
META_ITEM = "meta"
# The field where jaxloop's TrainState held the data position before it moved to META_ITEM:
# a whole state saved the guide's way may still hold it.
_LEGACY_POSITION = "dataset_state"


def make_manager(
    directory: Any, *, max_to_keep: int | None = 3, async_save: bool = True, **options: Any
) -> ocp.CheckpointManager:
    """A CheckpointManager for jaxloop's two-item layout (state arrays + JSON metadata).

    Extra keyword arguments go to `ocp.CheckpointManagerOptions` (for example
    ``best_fn=...``, ``keep_period=...``).
    """
    if "multiprocessing_options" not in options:
        # orbax names its cross-process barriers by step; two managers saving the same step
        # (latest and best) in a multi-process job would collide without a distinct prefix.
        name = hashlib.blake2b(str(directory).encode(), digest_size=6).hexdigest()
        options["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
            barrier_sync_key_prefix=f"jaxloop-{name}"
        )
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


def state_arrays(state: State) -> dict[str, Any]:
    """The array part of a TrainState as a plain nested dict (what goes into ``state``)."""
    return flax.serialization.to_state_dict(state)


def _single_item(manager: ocp.CheckpointManager) -> bool | None:
    """Whether `manager`'s checkpoints hold one unnamed item (the guide's way), from the
    layout of its newest checkpoint; None when it has none yet."""
    paths = _step_paths(epath.Path(manager.directory))
    if not paths:
        return None
    return (paths[max(paths)] / ocp.checkpoint_manager.DEFAULT_ITEM_NAME).exists()


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: State,
    meta: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    force: bool = False,
    dataset_state: Any = None,
) -> bool:
    """Saves `state` at `step`, with `dataset_state` (this process's data position, JSON)
    and `meta` (JSON) beside it; asynchronous if the manager is.

    Returns whether a checkpoint was started (the manager may skip steps by its policy).
    A manager holding a single unnamed item (the guide's) gets the state arrays only.

    With several processes every process must call this (orbax's save is collective too):
    each process's `dataset_state` is gathered, so that each one restores its own.

    Example::

        checkpoint.save(manager, int(state.step), state,
                        dataset_state=data.iterator_state(it), meta={'loop_count': 3})
    """
    if not force and not manager.should_save(step):
        return False  # (before the gather below: no collective for a skipped step)
    positions = agreement.gathered(dataset_state)
    meta = {
        **(meta or {}),
        "dataset_state": positions[0],
        "dataset_states": positions,
        "process_count": len(positions),
    }
    arrays = state_arrays(state)
    single = ocp.args.PyTreeSave(arrays)
    composite = ocp.args.Composite(
        **{STATE_ITEM: single, META_ITEM: ocp.args.JsonSave(meta)}
    )
    layout = _single_item(manager)
    if layout is not None:
        args = single if layout else composite
        return manager.save(step, args=args, metrics=metrics, force=force)
    # A manager without checkpoints: orbax's public API does not say how many items it was
    # made for, but it validates the arguments before doing anything else, so the layout it
    # refuses (a ValueError, whatever its words) is not the one it holds.
    try:
        return manager.save(step, args=composite, metrics=metrics, force=force)
    except ValueError as refused:
        try:
            return manager.save(step, args=single, metrics=metrics, force=force)
        except ValueError:
            raise refused from None


def _looks_process_independent(position: Any) -> bool:
    # A GlobalBatchDataset position (next global batch) means the same in any process
    # count; other iterators can say so with a truthy 'process_independent' entry.
    return isinstance(position, Mapping) and (
        bool(position.get("process_independent"))
        or {"next_batch", "global_batch_size"} <= set(position)
    )


def dataset_state_for_process(
    meta: Mapping[str, Any],
    process_index: int | None = None,
    process_count: int | None = None,
) -> Any:
    """This process's data position from a checkpoint's metadata (None if none saved).

    A checkpoint written by the same number of processes gives each process its own
    position. Under another process count only a process-independent position (a
    `data.GlobalBatchDataset` iterator's, identical on every process) can be used.

    Raises:
      ValueError: when the checkpoint holds per-process positions for a different number
        of processes (a per-process pipeline cannot resume exactly on another layout).
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    positions = meta.get("dataset_states")
    if positions is None:  # written by one process, or by an older jaxloop
        positions = [meta.get("dataset_state")]
    saved_count = int(meta.get("process_count", len(positions)))
    if all(p is None for p in positions):
        return None
    if saved_count == process_count and len(positions) == process_count:
        return positions[process_index]
    if all(p == positions[0] for p in positions) and _looks_process_independent(positions[0]):
        return positions[0]
    raise ValueError(
        f"The checkpoint holds the data positions of {saved_count} process(es), but this "
        f"job has {process_count}: a per-process pipeline (e.g. grain with "
        "ShardByJaxProcess) cannot resume on another process count. Resume with "
        f"{saved_count} processes, or read the data with data.GlobalBatchDataset, whose "
        "position does not depend on the process count."
    )


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
    arrays = {k: v for k, v in state_arrays(state).items() if k not in skip}
    if partitioner is not None:
        shardings = state_arrays(partitioner.state_shardings(state))
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


def _step_paths(directory: epath.Path) -> dict[int, epath.Path]:
    """Finalized step directories by step, whatever the manager's step naming."""
    if not directory.exists():
        return {}
    return {
        ocp.path.step.step_from_checkpoint_name(path.name): path
        for path in ocp.path.step.checkpoint_steps_paths(directory)
    }


def _name_format(path: epath.Path, step: int) -> Any:
    """orbax's NameFormat that names `path` for `step` (``100``, ``ckpt_100``,
    ``000100``, ``ckpt_000100``)."""
    prefix, _, digits = path.name.rpartition("_")
    fixed = len(digits) if len(digits) > len(str(step)) else None
    return ocp.path.step.standard_name_format(
        step_prefix=prefix or None, step_format_fixed_length=fixed
    )


def _reader(directory: epath.Path, path: epath.Path, step: int,
            handlers: Any) -> ocp.CheckpointManager:
    """A read-only manager for the checkpoint at `path` (of `step`) with these item
    handlers (one handler for a single unnamed item, else a dict by item name)."""
    # Each process reads its own shards and answers for itself: no barrier across processes
    # inside the restore, so a process whose read fails (a checkpoint deleted by the
    # trainer's max_to_keep meanwhile) cannot leave the others waiting there. Callers that
    # must act alike on a failure agree on it afterwards (see `OuterLoop`).
    own = jax.process_index()
    options = ocp.CheckpointManagerOptions(
        step_name_format=_name_format(path, step), read_only=True, create=False,
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            primary_host=own, active_processes={own}
        ),
    )
    return ocp.CheckpointManager(directory, item_handlers=handlers, options=options)


def all_steps(directory: Any) -> list[int]:
    """The steps of the complete checkpoints in `directory` (half-written ones excluded),
    whatever the step naming (``step_prefix``, ``step_format_fixed_length``)."""
    return sorted(_step_paths(epath.Path(directory)))


def read_meta(directory: Any, step: int) -> dict[str, Any]:
    """The JSON metadata saved with the checkpoint at `step` (loop count, data positions,
    early-stopping progress, a tracker's run id); {} for a single-item checkpoint, which
    has none. Any step naming (``step_prefix``, fixed length) is found."""
    directory = epath.Path(directory)
    paths = _step_paths(directory)
    if step not in paths:
        raise ValueError(f"No checkpoint for step {step} in {directory}; have {sorted(paths)}")
    if not (paths[step] / META_ITEM).exists():
        return {}
    manager = _reader(directory, paths[step], step, {META_ITEM: ocp.JsonCheckpointHandler()})
    try:
        restored = manager.restore(
            step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
        )
    finally:
        manager.close()
    return dict(restored[META_ITEM] or {})


def _has_arrays(tree: Any) -> bool:
    return any(hasattr(x, "shape") for x in jax.tree.leaves(tree))


def _conform(target: Any, saved: Any) -> Any:
    """`target` (a flax state dict) laid out as the checkpoint's tree `saved`.

    flax writes a tuple as a dict with keys '0', '1', ...; orbax writes the tuples of a
    TrainState saved as a whole (the guide's way) as lists, and an empty tuple (optax's
    EmptyState) or an absent field as None. Entries of the target without arrays that the
    checkpoint lacks (such as the data position) are dropped. Anything else is left for
    `check_compatible` to report.
    """
    if isinstance(saved, list | tuple) and isinstance(target, Mapping):
        if set(target) == {str(i) for i in range(len(saved))}:
            return [_conform(target[str(i)], saved[i]) for i in range(len(saved))]
    if isinstance(saved, Mapping) and isinstance(target, Mapping):
        return {
            k: _conform(v, saved[k]) if k in saved else v
            for k, v in target.items()
            if k in saved or _has_arrays(v)
        }
    if saved is None and not _has_arrays(target):
        return None
    return target


def _unconform(restored: Any, target: Any) -> Any:
    """The inverse of `_conform`: `restored` back in the layout of the flax state dict."""
    if isinstance(target, Mapping):
        if isinstance(restored, list | tuple):
            return {k: _unconform(restored[int(k)], v) for k, v in target.items()}
        restored = restored if isinstance(restored, Mapping) else {}
        return {
            k: _unconform(restored[k], v) if k in restored else v for k, v in target.items()
        }
    if restored is None and not _has_arrays(target):
        return target
    return restored


def restore_state(
    state: State,
    directory: Any,
    step: int | None = None,
    partitioner: Any = None,
    skip_optimizer: bool = False,
    transforms: Any = None,
    dataset: Iterator[Any] | None = None,
) -> State:
    """Restores the checkpoint at `step` (latest if None) from `directory` into `state`.

    See `restore`, which also returns the checkpoint's metadata (loop counters).
    """
    return restore(state, directory, step, partitioner, skip_optimizer, transforms, dataset)[0]


def restore(
    state: State,
    directory: Any,
    step: int | None = None,
    partitioner: Any = None,
    skip_optimizer: bool = False,
    transforms: Any = None,
    dataset: Iterator[Any] | None = None,
) -> tuple[State, dict[str, Any]]:
    """Restores the checkpoint at `step` (latest if None); returns (state, metadata).

    With `skip_optimizer` the optimizer state is not read and the given one is kept (an
    evaluation state has no optimizer to restore into).

    Arrays are placed where `partitioner` places `state` (or where the given state's arrays
    are). Given the train iterator as `dataset`, this also moves it to the data position
    saved for this process (`restore_data_position`), so a loop called directly continues
    where the run stood; the metadata holds the positions either way. A training restore
    (no `skip_optimizer`) without `dataset` whose saved positions do not fit this job's
    process count logs a warning: the data would start over. With no checkpoint in
    `directory`, logs "No checkpoint found in <dir>" and returns `state` unchanged. A
    checkpoint whose structure or shapes differ from `state` is a ValueError naming the
    leaf; an unreadable one raises, never a silent fresh start.

    `transforms` are orbax restore transforms (``PyTreeRestore(transforms=...)``), keyed
    by '/'-joined paths of the state dict (regular expressions allowed), e.g. to start a
    new head from the given state while restoring the rest::

        state = checkpoint.restore_state(
            state, ckpt_dir, transforms={r'params/head/.*': ocp.Transform(use_fallback=True)})

    Keys the transforms do not name are restored from the checkpoint unchanged.

    Example, resume a train loop called directly::

        state, meta = checkpoint.restore(state, ckpt_dir, partitioner=partitioner, dataset=it)
        state, outputs = train_loop(state, it, num_steps=100)

    Raises:
      ValueError: no checkpoint for `step`; a structure or shape mismatch; with `dataset`,
        positions saved by another number of processes for a per-process pipeline, or an
        iterator that cannot take a position.
    """
    directory = epath.Path(directory)
    paths = _step_paths(directory)
    if not paths:
        log.info("No checkpoint found in %s. Returning the original model state.", directory)
        return state, {}
    step = max(paths) if step is None else step
    if step not in paths:
        raise ValueError(f"No checkpoint for step {step} in {directory}; have {sorted(paths)}")
    single = (paths[step] / ocp.checkpoint_manager.DEFAULT_ITEM_NAME).exists()
    handlers = (
        ocp.PyTreeCheckpointHandler() if single
        else {STATE_ITEM: ocp.PyTreeCheckpointHandler(), META_ITEM: ocp.JsonCheckpointHandler()}
    )
    manager = _reader(directory, paths[step], step, handlers)
    arrays_now = state_arrays(state)
    try:
        skip = ("opt_state",) if skip_optimizer else ()
        target = _abstract_target(state, partitioner, skip)
        saved = manager.item_metadata(step)
        saved = saved if single else saved[STATE_ITEM]
        saved = {
            k: v for k, v in getattr(saved, "tree", saved).items()
            if k not in skip and not (k == _LEGACY_POSITION and k not in target)
        }
        if transforms is None:
            item = _conform(target, saved)
            check_compatible(saved, item, str(paths[step]))
            restore_args = ocp.checkpoint_utils.construct_restore_args(item)
            restore = ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True
            )
        else:
            # Values the transforms take from the given state ("use_fallback") must be
            # real arrays, not shapes.
            restore = ocp.args.PyTreeRestore(
                item={k: v for k, v in arrays_now.items() if k not in skip},
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                transforms=transforms,
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
    arrays = _unconform(arrays, target) if transforms is None else arrays
    kept = {k: v for k, v in arrays_now.items() if k in skip}
    new_state = flax.serialization.from_state_dict(state, {**arrays, **kept})
    log.info("Restored checkpoint step %d from %s.", step, directory)
    if dataset is not None:
        restore_data_position(dataset, meta)
    elif not skip_optimizer:
        try:
            dataset_state_for_process(meta)
        except ValueError as e:
            log.warning(
                "Checkpoint step %d in %s: its data positions are not restored, so a train "
                "loop given this state reads its data from the start. %s", step, directory, e
            )
    return new_state, meta


def restore_data_position(dataset: Iterator[Any], meta: Mapping[str, Any]) -> bool:
    """Moves `dataset` (the train iterator) to this process's data position in a
    checkpoint's metadata (`restore`, `read_meta`); returns whether one was saved.

    Example::

        state, meta = checkpoint.restore(state, ckpt_dir)
        checkpoint.restore_data_position(it, meta)  # what restore(..., dataset=it) does

    Raises:
      ValueError: positions saved by another number of processes that only fit their own
        process (see `dataset_state_for_process`), or an iterator without ``set_state``.
    """
    position = dataset_state_for_process(meta)
    if position is None:
        return False
    from jaxloop import data  # noqa: PLC0415 (grain loads only when needed)

    data.restore_iterator_state(dataset, position)
    return True


# Warm start: parameters only, from another run's checkpoint.
# ----------------------------------------------------------------------------------------

PARAMS_KEY = "params"


def _path_name(path: tuple[Any, ...]) -> str:
    """'backbone/kernel' for a pytree key path (dict keys, attributes, sequence indices)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _named_leaves(tree: Any) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """name -> (key path, leaf) for every leaf of `tree`."""
    return {
        _path_name(path): (path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _renamer(rename: Any) -> Any:
    """A function checkpoint name -> target name (None: not loaded) from `rename`."""
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    if not isinstance(rename, dict):
        raise TypeError(
            f"`rename` must be a dict of name prefixes or a callable, got {type(rename).__name__}"
        )
    for old, new in rename.items():
        if not isinstance(old, str) or not (new is None or isinstance(new, str)):
            raise TypeError(
                f"`rename` maps checkpoint name prefixes (str) to target prefixes (str, or None "
                f"to skip them); got {old!r}: {new!r}"
            )
    # The longest matching prefix wins, so {'a/': 'x/', 'a/b/': None} drops a/b/ only.
    prefixes = sorted(rename, key=len, reverse=True)

    def apply(name: str) -> str | None:
        for old in prefixes:
            if name.startswith(old):
                new = rename[old]
                return None if new is None else new + name[len(old):]
        return name

    return apply


def _nest(flat: dict[tuple[Any, ...], Any]) -> dict[Any, Any]:
    """A nested dict from {key path: leaf} (dict keys as the checkpoint spells them)."""
    out: dict[Any, Any] = {}
    for path, leaf in flat.items():
        node = out
        keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = leaf
    return out


def _warm_start_item(directory: epath.Path, step: int | None) -> epath.Path:
    """The directory of the state item (jaxloop's ``state`` or the guide's single item) of
    the checkpoint at `step` (latest if None), whatever the manager's step naming."""
    paths = _step_paths(directory)
    if not paths:
        raise ValueError(f"Warm start: no checkpoint in {directory}")
    step = max(paths) if step is None else step
    if step not in paths:
        raise ValueError(
            f"Warm start: no checkpoint for step {step} in {directory}; have {sorted(paths)}"
        )
    for name in (STATE_ITEM, ocp.checkpoint_manager.DEFAULT_ITEM_NAME):
        if (paths[step] / name).exists():
            return paths[step] / name
    raise ValueError(
        f"Warm start: {paths[step]} holds neither a {STATE_ITEM!r} item (jaxloop) nor a "
        f"single unnamed item (the Jaxloop guide's way)"
    )


def warm_start(
    state: State,
    directory: Any,
    step: int | None = None,
    *,
    rename: dict[str, str | None] | Any = None,
    strict: bool = True,
    partitioner: Any = None,
) -> State:
    """Loads only the parameters of another run's checkpoint into a fresh `state`.

    The optimizer state, the step and everything else in `state` stay as given. `directory`
    holds checkpoints written by jaxloop (`CheckpointAction`, `save`) or the Jaxloop guide's
    way (a single-item manager saving a whole state); `step` picks one (latest if None).

    Names are the parameters' paths joined by '/', e.g. ``'backbone/Dense_0/kernel'``.
    `rename` maps checkpoint names to the state's names: a dict of prefixes
    (``{'backbone/': 'encoder/'}``; a prefix mapped to None is not loaded, e.g. an old head:
    ``{'head/': None}``) or a callable ``name -> new name or None``.

    Parameters of `state` the checkpoint lacks are "missing" (they keep their fresh values);
    checkpoint parameters `state` lacks are "unexpected". With `strict` either is a
    ValueError listing them; otherwise they are logged. A parameter whose shape differs is
    always a ValueError naming it and both shapes (drop it with `rename` to keep it fresh).
    Each loaded parameter is cast to the dtype of, and placed like, the state's parameter
    (by `partitioner` where given, else where the given array lives).

    Example, fine-tune with a new 3-class head from a 10-class run::

        state = step.initialize_model(spec)
        state = checkpoint.warm_start(state, 'runs/a/checkpoints', rename={'head/': None},
                                      strict=False, partitioner=partitioner)
    """
    item_dir = _warm_start_item(epath.Path(directory), step)
    where = str(item_dir.parent)
    rename_fn = _renamer(rename)

    # The state's parameters as saved (the same names the checkpoint uses) and as targets:
    # shape, dtype and placement of each.
    arrays = state_arrays(state)
    if PARAMS_KEY not in arrays:
        raise ValueError(f"Warm start: the state has no {PARAMS_KEY!r}; it has {sorted(arrays)}")
    others = tuple(k for k in arrays if k != PARAMS_KEY)
    targets = _named_leaves(_abstract_target(state, partitioner, others)[PARAMS_KEY])

    # orbax's PyTree checkpointer reads the one item directly, whatever the step naming.
    reader = ocp.PyTreeCheckpointer()
    try:
        saved = reader.metadata(item_dir)
        saved = getattr(saved, "item_metadata", saved)
        saved = getattr(saved, "tree", saved)
        if PARAMS_KEY not in saved:
            raise ValueError(
                f"Warm start: checkpoint {where} holds no {PARAMS_KEY!r}; it has {sorted(saved)}"
            )
        sources = _named_leaves({PARAMS_KEY: saved[PARAMS_KEY]})

        loads: dict[str, str] = {}  # target name -> checkpoint name
        unexpected, mismatched = [], []
        for full_name, (_, meta) in sources.items():
            name = full_name[len(PARAMS_KEY) + 1:]
            new = rename_fn(name)
            if new is None:
                continue
            if new not in targets:
                unexpected.append(name if new == name else f"{name} (as {new})")
                continue
            if new in loads:
                raise ValueError(
                    f"Warm start: checkpoint parameters {loads[new]} and {name} both map to {new}"
                )
            target_shape = tuple(targets[new][1].shape)
            saved_shape = tuple(getattr(meta, "shape", ()) or ())
            if saved_shape != target_shape:
                mismatched.append(f"{name} {saved_shape} -> {new} {target_shape}")
                continue
            loads[new] = name
        missing = sorted(set(targets) - set(loads))
        if mismatched:
            raise ValueError(
                f"Warm start from {where}: parameter shapes differ (checkpoint -> state): "
                f"{mismatched}. Skip them with `rename` (a prefix mapped to None)."
            )
        if (missing or unexpected) and strict:
            raise ValueError(
                f"Warm start from {where}: missing from the checkpoint (kept fresh if "
                f"strict=False): {missing}; unexpected in the checkpoint (not in the state): "
                f"{sorted(unexpected)}. Use `rename` to map names or strict=False."
            )
        if missing:
            log.warning("Warm start from %s: parameters missing from the checkpoint, kept "
                        "fresh: %s", where, missing)
        if unexpected:
            log.warning("Warm start from %s: checkpoint parameters not in the state, not "
                        "loaded: %s", where, sorted(unexpected))

        # A partial restore of just the chosen leaves, each shaped, typed and placed as its
        # target; the rest of the checkpoint (optimizer state, step) is never read.
        item = _nest({
            sources[f"{PARAMS_KEY}/{name}"][0]: targets[new][1] for new, name in loads.items()
        })
        restored = {}
        if loads:
            args = ocp.args.PyTreeRestore(
                item=item,
                restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                partial_restore=True,
            )
            restored = reader.restore(item_dir, args=args)
    finally:
        reader.close()

    loaded = {name: leaf for name, (_, leaf) in _named_leaves(restored).items()}
    current = _named_leaves(arrays[PARAMS_KEY])
    leaves = [
        loaded[f"{PARAMS_KEY}/{loads[name]}"] if name in loads else leaf
        for name, (_, leaf) in current.items()
    ]
    treedef = jax.tree_util.tree_structure(arrays[PARAMS_KEY])
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    new_state = flax.serialization.from_state_dict(state, {**arrays, PARAMS_KEY: params})
    log.info("Warm start: loaded %d of %d parameters from %s.", len(loads), len(targets), where)
    return new_state
