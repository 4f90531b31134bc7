"""Saving and restoring the whole training state with orbax.

A checkpoint step directory holds two items: ``state`` (the TrainState's arrays, written by
orbax's PyTree handler, sharded and multi-process aware) and ``meta`` (JSON host data: each
process's data position, loop counters, early-stopping progress), so host data never enters
jit. No pickle. A manager built the guide's way (one unnamed `Checkpointer`) holds the state
arrays alone. Each checkpoint keeps the layout it was saved with (orbax names the item
directories), and `restore` reads either, including a whole `TrainState` saved with
``args.PyTreeSave(state)`` by a user or google/jaxloop (tuples stored as lists, no data
position) and states of releases whose TrainState carried a ``dataset_state`` field.

`restore` is the one reader (a state, an abstract state, the best by a metric, some leaves,
orbax's restore transforms); `Step.restore_model`, `OuterLoop`,
`restore_best` and `warm_start` call it. Steps are found with orbax's step naming
(``step_prefix``, ``step_format_fixed_length``: ``ckpt_000100`` restores like ``100``).

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
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util

from jaxloop import agreement, types

State = types.TrainState
log = logging.getLogger(__name__)

STATE_ITEM = "state"
META_ITEM = "meta"
# The item of a manager holding one unnamed item (the guide's way), as orbax names it.
_SINGLE_ITEM = ocp.checkpoint_manager.DEFAULT_ITEM_NAME
# The field where jaxloop's TrainState held the data position before it moved to META_ITEM:
# a whole state saved the guide's way may still hold it.
_LEGACY_POSITION = "dataset_state"
# Whether a manager holds one unnamed item: known for `make_manager`'s, learnt at the first
# `save` to any other.
_SINGLE_LAYOUT: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _absolute(directory: Any) -> epath.Path:
    """`directory` as an absolute path (orbax's array readers and writers refuse relative
    ones): a notebook's ``'ckpt'`` is taken from the current directory."""
    path = epath.Path(directory)
    return path if path.is_absolute() else path.absolute()


def make_manager(
    directory: Any, *, max_to_keep: int | None = 3, async_save: bool = True, **options: Any
) -> ocp.CheckpointManager:
    """A CheckpointManager for jaxloop's two-item layout (state arrays + JSON metadata).

    Extra keyword arguments go to `ocp.CheckpointManagerOptions` (for example
    ``best_fn=...``, ``keep_period=...``). A relative `directory` is taken from the current
    directory (a notebook's ``make_manager('ckpt')``: orbax's writers need absolute paths).
    """
    directory = _absolute(directory)
    if "multiprocessing_options" not in options:
        # orbax names its cross-process barriers by step; two managers saving the same step
        # (latest and best) in a multi-process job would collide without a distinct prefix.
        name = hashlib.blake2b(str(directory).encode(), digest_size=6).hexdigest()
        options["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
            barrier_sync_key_prefix=f"jaxloop-{name}")
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True, **options)
    manager = ocp.CheckpointManager(directory, options=opts, item_names=(STATE_ITEM, META_ITEM))
    _SINGLE_LAYOUT[manager] = False
    return manager


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

    return make_manager(directory, max_to_keep=k, async_save=async_save, best_fn=best_fn,
                        best_mode=mode, keep_checkpoints_without_metrics=False)


def state_arrays(state: State) -> dict[str, Any]:
    """The array part of a TrainState as a plain nested dict (what goes into ``state``)."""
    return flax.serialization.to_state_dict(state)


def save(manager: ocp.CheckpointManager, step: int, state: State,
         meta: dict[str, Any] | None = None, metrics: dict[str, float] | None = None,
         force: bool = False, dataset_state: Any = None) -> bool:
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
    meta = {**(meta or {}), "dataset_state": positions[0], "dataset_states": positions,
            "process_count": len(positions)}
    single = ocp.args.PyTreeSave(state_arrays(state))
    composite = ocp.args.Composite(**{STATE_ITEM: single, META_ITEM: ocp.args.JsonSave(meta)})
    if manager in _SINGLE_LAYOUT:
        args = single if _SINGLE_LAYOUT[manager] else composite
        return manager.save(step, args=args, metrics=metrics, force=force)
    # The first save learns the layout from the manager itself, alike on every process: orbax
    # validates the arguments first, and a manager of one unnamed item (the guide's) refuses
    # a composite (a ValueError, whatever its words). Later saves keep the answer.
    try:
        saved = manager.save(step, args=composite, metrics=metrics, force=force)
        _SINGLE_LAYOUT[manager] = False
    except ValueError as refused:
        try:
            saved = manager.save(step, args=single, metrics=metrics, force=force)
        except ValueError:
            raise refused from None
        _SINGLE_LAYOUT[manager] = True
    return saved


def _looks_process_independent(position: Any) -> bool:
    # A GlobalBatchDataset position (next global batch) means the same in any process
    # count; other iterators can say so with a truthy 'process_independent' entry.
    return isinstance(position, Mapping) and (bool(position.get("process_independent")) or
                                              {"next_batch", "global_batch_size"} <= set(position))


def dataset_state_for_process(meta: Mapping[str, Any], process_index: int | None = None,
                              process_count: int | None = None) -> Any:
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
    # (Only "dataset_state": written by one process, or by an older jaxloop.)
    positions = meta.get("dataset_states") or [meta.get("dataset_state")]
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
        "position does not depend on the process count.")


def _key(k: Any) -> Any:
    """A pytree path entry's key, as the tree spells it (dict key, attribute, index)."""
    return next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k)


def _path_name(path: tuple[Any, ...]) -> str:
    """'backbone/kernel' for a pytree key path."""
    return "/".join(str(_key(k)) for k in path)


def _named_leaves(tree: Any) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """name -> (key path, leaf) for every leaf of `tree`."""
    return {_path_name(path): (path, leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    return {name: tuple(leaf.shape) for name, (_, leaf) in _named_leaves(tree).items()
            if getattr(leaf, "shape", None) is not None}


def check_compatible(saved: Any, target: Any, where: str, partial: bool = False) -> None:
    """Raises ValueError naming the first leaf whose structure or shape differs (with
    `partial`, leaves only in the checkpoint are fine)."""
    saved_shapes, target_shapes = _shapes(saved), _shapes(target)
    missing = sorted(set(target_shapes) - set(saved_shapes))
    extra = [] if partial else sorted(set(saved_shapes) - set(target_shapes))
    if missing or extra:
        raise ValueError(
            f"Checkpoint {where} does not match the state's structure: leaves missing from "
            f"the checkpoint: {missing[:5]}; leaves only in the checkpoint: {extra[:5]}")
    for key, shape in target_shapes.items():
        if saved_shapes[key] != shape:
            raise ValueError(f"Checkpoint {where}: leaf {key} has shape {saved_shapes[key]}, "
                             f"but the state expects {shape}")


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
        arrays, shardings)


def _step_paths(directory: epath.Path) -> dict[int, epath.Path]:
    """Finalized step directories by step, whatever the manager's step naming."""
    if not directory.exists():
        return {}
    return {ocp.path.step.step_from_checkpoint_name(path.name): path
            for path in ocp.path.step.checkpoint_steps_paths(directory)}


def all_steps(directory: Any) -> list[int]:
    """The steps of the complete checkpoints in `directory` (half-written ones excluded),
    whatever the step naming (``step_prefix``, ``step_format_fixed_length``)."""
    return sorted(_step_paths(epath.Path(directory)))


def _reader(handlers: dict[str, Any]) -> ocp.Checkpointer:
    """A checkpointer reading these items (by name) of one checkpoint step directory."""
    # Each process reads its own shards, with no barrier across processes: a process whose
    # read fails (a checkpoint deleted by max_to_keep meanwhile) cannot leave the others
    # waiting there. Callers that must act alike on a failure agree afterwards (`OuterLoop`).
    own = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=own, active_processes={own})
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(multiprocessing_options=alone), **handlers),
        multiprocessing_options=alone)


def _step_path(directory: epath.Path, step: int | None) -> tuple[int, epath.Path] | None:
    """(step, its directory): `step`'s, or the newest with None; None when there is none."""
    paths = _step_paths(directory)
    if step is None:
        return (max(paths), paths[max(paths)]) if paths else None
    if step not in paths:
        raise ValueError(
            f"There is no checkpoint for step {step} in {directory}; it has {sorted(paths)}")
    return step, paths[step]


def _layout(path: epath.Path) -> tuple[str, dict[str, Any]]:
    """(the name of the state's item, the handlers of the items) of the checkpoint at `path`:
    the layout it was saved with, told by the directory orbax names a single item by."""
    if (path / _SINGLE_ITEM).exists():
        return _SINGLE_ITEM, {_SINGLE_ITEM: ocp.PyTreeCheckpointHandler()}
    return STATE_ITEM, {STATE_ITEM: ocp.PyTreeCheckpointHandler(),
                        META_ITEM: ocp.JsonCheckpointHandler()}


def _saved_tree(reader: ocp.Checkpointer, path: epath.Path, name: str) -> dict[str, Any]:
    """The tree metadata (names, shapes, dtypes) of the state item `name` at `path`."""
    saved = reader.metadata(path).item_metadata[name]
    return dict(getattr(saved, "tree", saved))


def _json(path: epath.Path, name: str, filename: str | None = None) -> dict[str, Any]:
    """The JSON item `name` of the checkpoint at `path` ({} where it has none)."""
    if not (path / name).exists():
        return {}
    with _reader({name: ocp.JsonCheckpointHandler(filename)}) as reader:
        restored = reader.restore(path, args=ocp.args.Composite(**{name: ocp.args.JsonRestore()}))
    return dict(restored[name] or {})


def read_meta(directory: Any, step: int) -> dict[str, Any]:
    """The JSON metadata saved with the checkpoint at `step` (loop count, data positions,
    early-stopping progress, a tracker's run id); {} for a single-item checkpoint, which
    has none. Any step naming (``step_prefix``, fixed length) is found."""
    return _json(_step_path(epath.Path(directory), step)[1], META_ITEM)


def _best_step(directory: epath.Path, metric: str, mode: str) -> int:
    """The step whose saved metrics have the best `metric` (the latest of equals, as orbax's
    ``best_step`` picks)."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    scores = {}
    for step, path in _step_paths(directory).items():
        name = ocp.checkpoint_manager.METRIC_ITEM_NAME  # (orbax's file is named alike)
        saved = _json(path, name, filename=name)
        if metric in saved:
            scores[step] = float(saved[metric]) * (1 if mode == "max" else -1)
    if not scores:
        raise ValueError(f"No checkpoint with metric {metric!r} in {directory}")
    return max(scores, key=lambda step: (scores[step], step))


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
        return {k: _conform(v, saved[k]) if k in saved else v
                for k, v in target.items() if k in saved or _has_arrays(v)}
    if saved is None and not _has_arrays(target):
        return None
    return target


def _unconform(restored: Any, target: Any) -> Any:
    """The inverse of `_conform`: `restored` back in the layout of the flax state dict."""
    if isinstance(target, Mapping):
        if isinstance(restored, list | tuple):
            return {k: _unconform(restored[int(k)], v) for k, v in target.items()}
        restored = restored if isinstance(restored, Mapping) else {}
        return {k: _unconform(restored[k], v) if k in restored else v
                for k, v in target.items()}
    if restored is None and not _has_arrays(target):
        return target
    return restored


def restore(state: State, directory: Any, step: int | None = None, partitioner: Any = None,
            skip_optimizer: bool = False, transforms: Any = None,
            dataset: Iterator[Any] | None = None, *, best: str | None = None,
            mode: str = "min", partial: bool = False) -> tuple[State, dict[str, Any]]:
    """Restores the checkpoint at `step` (latest if None); returns (state, metadata).

    The one function that reads a checkpoint: its tree metadata once, then the arrays and
    the JSON item together; it logs "Resumed from step <N> of <dir>".

    `state` may be abstract (`Step.abstract_state`): arrays are read straight into place.
    `skip_optimizer` keeps the given optimizer state (an eval state has none to restore).
    `best` restores the checkpoint whose saved metrics (`BestCheckpointAction`'s) have the
    lowest (`mode` ``'min'``) or highest (``'max'``) value of that metric. With `partial`,
    `state` may hold some of the checkpoint's leaves only (a dict of its names): only those
    are read (`warm_start` reads parameters this way).

    Arrays are placed where `partitioner` places `state` (else where its arrays are). Given
    the train iterator as `dataset`, this moves it to this process's saved data position
    (`restore_data_position`), so a loop called directly continues where the run stood; a
    training restore (no `skip_optimizer`) without it whose saved positions do not fit this
    job's process count logs a warning. With no checkpoint in `directory`, logs "No
    checkpoint found in <dir>" and returns `state`. A structure or shape mismatch is a
    ValueError naming the leaf; an unreadable checkpoint raises, never a silent fresh start.

    `transforms` are orbax restore transforms (``PyTreeRestore(transforms=...)``), keyed
    by '/'-joined paths of the state dict (regular expressions allowed), e.g. to start a
    new head from the given state while restoring the rest::

        state, _ = checkpoint.restore(
            state, ckpt_dir, transforms={r'params/head/.*': ocp.Transform(use_fallback=True)})

    Raises:
      ValueError: no checkpoint for `step` (or none with metric `best`); a structure or
        shape mismatch; with `dataset`, positions saved by another number of processes for
        a per-process pipeline, or an iterator that cannot take a position.
    """
    directory = _absolute(directory)
    if best is not None:
        step = _best_step(directory, best, mode)
    found = _step_path(directory, step)
    if found is None:
        log.info("No checkpoint found in %s. Returning the original model state.", directory)
        return state, {}
    step, path = found
    name, handlers = _layout(path)
    skip = ("opt_state",) if skip_optimizer else ()
    target = _abstract_target(state, partitioner, skip)
    with _reader(handlers) as reader:
        saved = {k: v for k, v in _saved_tree(reader, path, name).items()
                 if k not in skip and not (k == _LEGACY_POSITION and k not in target)}
        if transforms is None:
            item = _conform(target, saved)
            check_compatible(saved, item, str(path), partial)
            args = ocp.args.PyTreeRestore(
                item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                partial_restore=True)
        else:
            # Values the transforms take from the given state ("use_fallback") must be
            # real arrays, not shapes.
            args = ocp.args.PyTreeRestore(
                item={k: v for k, v in state_arrays(state).items() if k not in skip},
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                transforms=transforms)
        items = {k: args if k == name else ocp.args.JsonRestore() for k in handlers}
        restored = reader.restore(path, args=ocp.args.Composite(**items))
    arrays, meta = restored[name], dict(restored.get(META_ITEM) or {})
    arrays = _unconform(arrays, target) if transforms is None else arrays
    kept = {k: v for k, v in state_arrays(state).items() if k in skip}
    new_state = flax.serialization.from_state_dict(state, {**arrays, **kept})
    log.info("Resumed from step %d of %s.", step, directory)
    if dataset is not None:
        restore_data_position(dataset, meta)
    elif not skip_optimizer:
        try:
            dataset_state_for_process(meta)
        except ValueError as e:
            log.warning("Checkpoint step %d in %s: its data positions are not restored, so a "
                        "train loop given this state reads its data from the start. %s",
                        step, directory, e)
    return new_state, meta


def restore_best(state: State, directory: Any, metric: str, mode: str = "min",
                 partitioner: Any = None, skip_optimizer: bool = False) -> State:
    """Restores the best checkpoint (by `metric`, as saved by BestCheckpointAction): `restore`
    with ``best=metric``."""
    return restore(state, directory, partitioner=partitioner, skip_optimizer=skip_optimizer,
                   best=metric, mode=mode)[0]


def restore_data_position(dataset: Iterator[Any], meta: Mapping[str, Any]) -> bool:
    """Moves `dataset` (the train iterator) to this process's data position in a
    checkpoint's metadata (`restore`, `read_meta`); returns whether one was saved.

    Raises:
      ValueError: positions saved by another number of processes that only fit their own
        process (see `dataset_state_for_process`), or an iterator without ``set_state``.
    """
    position = dataset_state_for_process(meta)
    if position is None:
        return False
    from jaxloop.data import iterators  # noqa: PLC0415 (grain loads only when needed)

    iterators.restore_iterator_state(dataset, position)
    return True


# Warm start: parameters only, from another run's checkpoint.
# ----------------------------------------------------------------------------------------

PARAMS_KEY = "params"


def _renamer(rename: Any) -> Any:
    """A function checkpoint name -> target name (None: not loaded) from `rename`."""
    if rename is None:
        return lambda name: name
    if callable(rename):
        return rename
    if not isinstance(rename, dict):
        raise TypeError(f"`rename` must be a dict of name prefixes or a callable, got "
                        f"{type(rename).__name__}")
    for old, new in rename.items():
        if not isinstance(old, str) or not (new is None or isinstance(new, str)):
            raise TypeError(f"`rename` maps checkpoint name prefixes (str) to target prefixes "
                            f"(str, or None to skip them); got {old!r}: {new!r}")
    # The longest matching prefix wins, so {'a/': 'x/', 'a/b/': None} drops a/b/ only.
    prefixes = sorted(rename, key=len, reverse=True)

    def apply(name: str) -> str | None:
        old = next((old for old in prefixes if name.startswith(old)), None)
        if old is None:
            return name
        return None if rename[old] is None else rename[old] + name[len(old):]

    return apply


def warm_start(state: State, directory: Any, step: int | None = None, *,
               rename: dict[str, str | None] | Callable[[str], str | None] | None = None,
               strict: bool = True, partitioner: Any = None) -> State:
    """Loads only the parameters of another run's checkpoint (jaxloop's or the guide's
    layout; `step`, latest if None) into a fresh `state`; all else stays as given.

    Names are the parameters' paths joined by '/', e.g. ``'backbone/Dense_0/kernel'``.
    `rename` maps checkpoint names to the state's names: a dict of prefixes
    (``{'backbone/': 'encoder/'}``; a prefix mapped to None is not loaded, e.g. an old head:
    ``{'head/': None}``) or a callable ``name -> new name or None``.

    Parameters of `state` the checkpoint lacks are "missing" (they keep their fresh values);
    checkpoint parameters `state` lacks are "unexpected". With `strict` either is a
    ValueError listing them; otherwise they are logged. A parameter whose shape differs is
    always a ValueError naming it and both shapes (drop it with `rename` to keep it fresh).
    Each loaded parameter is cast to the dtype of, and placed like, the state's parameter
    (by `partitioner`, else where the given array lives): a partial `restore` of them alone.

    Example, fine-tune with a new 3-class head from a 10-class run::

        state = step.initialize_model(spec)
        state = checkpoint.warm_start(state, 'runs/a/checkpoints', rename={'head/': None},
                                      strict=False, partitioner=partitioner)
    """
    found = _step_path(epath.Path(directory), step)
    if found is None:
        raise ValueError(f"Warm start: no checkpoint in {directory}")
    step, path = found
    rename_fn = _renamer(rename)
    arrays = state_arrays(state)
    if PARAMS_KEY not in arrays:
        raise ValueError(f"Warm start: the state has no {PARAMS_KEY!r}; it has {sorted(arrays)}")
    # Each parameter's shape, dtype and placement, by name.
    others = tuple(k for k in arrays if k != PARAMS_KEY)
    targets = _named_leaves(_abstract_target(state, partitioner, others)[PARAMS_KEY])
    name, handlers = _layout(path)
    with _reader(handlers) as reader:
        saved = _saved_tree(reader, path, name)
    if PARAMS_KEY not in saved:
        raise ValueError(
            f"Warm start: checkpoint {path} holds no {PARAMS_KEY!r}; it has {sorted(saved)}")
    sources = _named_leaves(saved[PARAMS_KEY])

    loads: dict[str, str] = {}  # target name -> checkpoint name
    unexpected, mismatched = [], []
    for source, (_, meta) in sources.items():
        new = rename_fn(source)
        if new is None:
            continue
        if new not in targets:
            unexpected.append(source if new == source else f"{source} (as {new})")
            continue
        if new in loads:
            raise ValueError(
                f"Warm start: checkpoint parameters {loads[new]} and {source} both map to {new}")
        target_shape = tuple(targets[new][1].shape)
        saved_shape = tuple(getattr(meta, "shape", ()) or ())
        if saved_shape != target_shape:
            mismatched.append(f"{source} {saved_shape} -> {new} {target_shape}")
            continue
        loads[new] = source
    missing = sorted(set(targets) - set(loads))
    if mismatched:
        raise ValueError(
            f"Warm start from {path}: parameter shapes differ (checkpoint -> state): "
            f"{mismatched}. Skip them with `rename` (a prefix mapped to None).")
    if (missing or unexpected) and strict:
        raise ValueError(
            f"Warm start from {path}: missing from the checkpoint (kept fresh if "
            f"strict=False): {missing}; unexpected in the checkpoint (not in the state): "
            f"{sorted(unexpected)}. Use `rename` to map names or strict=False.")
    if missing or unexpected:
        log.warning("Warm start from %s: parameters missing from the checkpoint, kept fresh: "
                    "%s; checkpoint parameters not in the state, not loaded: %s",
                    path, missing, sorted(unexpected))

    loaded = {}
    if loads:
        # A partial restore of just the chosen leaves under their checkpoint names, each
        # shaped, typed and placed as its target; the rest (optimizer state, step) is never
        # read. (Orbax's renaming transforms would match every name against every other.)
        item = {PARAMS_KEY: traverse_util.unflatten_dict(
            {tuple(map(_key, sources[old][0])): targets[new][1] for new, old in loads.items()})}
        # (skip_optimizer: another run's data positions are no concern of this state's.)
        restored, _ = restore(item, directory, step, skip_optimizer=True, partial=True)
        loaded = {n: leaf for n, (_, leaf) in _named_leaves(restored[PARAMS_KEY]).items()}
    current = _named_leaves(arrays[PARAMS_KEY])
    leaves = [loaded[loads[n]] if n in loads else leaf for n, (_, leaf) in current.items()]
    params = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(arrays[PARAMS_KEY]), leaves)
    new_state = flax.serialization.from_state_dict(state, {**arrays, PARAMS_KEY: params})
    log.info("Warm start: loaded %d of %d parameters from %s.", len(loads), len(targets), path)
    return new_state
