"""Saving and restoring the whole training state with orbax: a checkpoint step holds ``state``
(the TrainState's arrays) and ``meta`` (JSON: each process's data position, loop counters);
a manager built the guide's way holds the arrays alone. `restore` reads either::

    manager = checkpoint.make_manager(workdir / 'checkpoints', max_to_keep=3)
    checkpoint.save(manager, int(state.step), state, dataset_state=data.iterator_state(it))
    state, meta = checkpoint.restore(state, workdir / 'checkpoints', dataset=it)
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

from jaxloop import types
from jaxloop.launch import agreement

State = types.TrainState
log = logging.getLogger(__name__)

STATE_ITEM = "state"
META_ITEM = "meta"
_SINGLE_ITEM = ocp.checkpoint_manager.DEFAULT_ITEM_NAME
# A TrainState field of older releases; a whole state saved the guide's way may hold it.
_LEGACY_POSITION = "dataset_state"
# Whether a manager holds one unnamed item, learnt at its first `save`.
_SINGLE_LAYOUT: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _absolute(directory: Any) -> epath.Path:
    """`directory` as an absolute path (orbax refuses relative ones)."""
    path = epath.Path(directory)
    return path if path.is_absolute() else path.absolute()


def make_manager(directory: Any, *, max_to_keep: int | None = 3, async_save: bool = True,
                 **options: Any) -> ocp.CheckpointManager:
    """A CheckpointManager for jaxloop's layout; `options` go to CheckpointManagerOptions."""
    directory = _absolute(directory)
    if "multiprocessing_options" not in options:
        # Two managers saving one step (latest and best) must not share orbax's barriers.
        name = hashlib.blake2b(str(directory).encode(), digest_size=6).hexdigest()
        options["multiprocessing_options"] = ocp.options.MultiprocessingOptions(
            barrier_sync_key_prefix=f"jaxloop-{name}")
    opts = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True, **options)
    return ocp.CheckpointManager(directory, options=opts, item_names=(STATE_ITEM, META_ITEM))


def make_best_manager(directory: Any, metric: str, *, mode: str = "min", k: int = 3,
                      async_save: bool = True) -> ocp.CheckpointManager:
    """A manager keeping the `k` best checkpoints by `metric` (for `BestCheckpointAction`)."""
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
    """Saves `state` at `step` with `meta` (JSON) and each process's `dataset_state` (unless the
    manager holds one item); returns whether a save started. Every process calls it."""
    if not force and not manager.should_save(step):
        return False
    positions = agreement.gathered(dataset_state, phase="checkpoint data position", step=step)
    meta = {**(meta or {}), "dataset_state": positions[0], "dataset_states": positions,
            "process_count": len(positions)}
    single = ocp.args.PyTreeSave(state_arrays(state))
    composite = ocp.args.Composite(**{STATE_ITEM: single, META_ITEM: ocp.args.JsonSave(meta)})
    if manager in _SINGLE_LAYOUT:
        args = single if _SINGLE_LAYOUT[manager] else composite
        return manager.save(step, args=args, metrics=metrics, force=force)
    # orbax refuses a composite for a manager of one unnamed item (a ValueError) before
    # writing anything, so the first save learns the layout alike on every process.
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


def dataset_state_for_process(meta: Mapping[str, Any], process_index: int | None = None,
                              process_count: int | None = None) -> Any:
    """This process's data position from a checkpoint's metadata (None if none saved)."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    positions = meta.get("dataset_states") or [meta.get("dataset_state")]
    saved_count = int(meta.get("process_count", len(positions)))
    if all(p is None for p in positions):
        return None
    if saved_count == process_count and len(positions) == process_count:
        return positions[process_index]
    first = positions[0]
    # A GlobalBatchDataset position, or one that says so.
    if all(p == first for p in positions) and isinstance(first, Mapping) and (
            first.get("process_independent") or {"next_batch", "global_batch_size"} <= set(first)):
        return first
    raise ValueError(
        f"The checkpoint holds the data positions of {saved_count} process(es), but this job "
        f"has {process_count}: a per-process pipeline cannot resume on another process count. "
        f"Resume with {saved_count} processes, or read with data.GlobalBatchDataset.")


def _named_leaves(tree: Any) -> dict[str, Any]:
    """'backbone/kernel' -> leaf, for every leaf of `tree` in its flattening order."""
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    return {name: tuple(leaf.shape) for name, leaf in _named_leaves(tree).items()
            if getattr(leaf, "shape", None) is not None}


def check_compatible(saved: Any, target: Any, where: str, partial: bool = False) -> None:
    """Raises ValueError naming a leaf whose structure or shape differs (`partial`: a subset)."""
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
    else:
        default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda x: getattr(x, "sharding", None) or default, arrays)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.dtype(x.dtype), sharding=s),
        arrays, {k: shardings[k] for k in arrays})


def _step_paths(directory: epath.Path) -> dict[int, epath.Path]:
    return {ocp.path.step.step_from_checkpoint_name(path.name): path
            for path in ocp.path.step.checkpoint_steps_paths(directory)}


def all_steps(directory: Any) -> list[int]:
    """The steps of the complete checkpoints in `directory`, whatever the step naming."""
    return sorted(_step_paths(epath.Path(directory)))


def _reader(handlers: dict[str, Any]) -> ocp.Checkpointer:
    """Reads these items of a step directory with no barrier: a failed read leaves none waiting."""
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
    """(the state item's name, the items' handlers) of the checkpoint at `path`."""
    if (path / _SINGLE_ITEM).exists():
        return _SINGLE_ITEM, {_SINGLE_ITEM: ocp.PyTreeCheckpointHandler()}
    return STATE_ITEM, {STATE_ITEM: ocp.PyTreeCheckpointHandler(),
                        META_ITEM: ocp.JsonCheckpointHandler()}


def _saved_tree(reader: ocp.Checkpointer, path: epath.Path, name: str) -> dict[str, Any]:
    saved = reader.metadata(path).item_metadata[name]
    return dict(getattr(saved, "tree", saved))


def _json(path: epath.Path, name: str, filename: str | None = None) -> dict[str, Any]:
    if not (path / name).exists():
        return {}
    with _reader({name: ocp.JsonCheckpointHandler(filename)}) as reader:
        restored = reader.restore(path, args=ocp.args.Composite(**{name: ocp.args.JsonRestore()}))
    return dict(restored[name] or {})


def read_meta(directory: Any, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata saved with the checkpoint at `step` (None: the latest; {} for a
    single-item one, or where there is no checkpoint), e.g. a tracker's run id
    (``read_meta(ckpt_dir).get(trackers.RUN_ID_KEY)``)."""
    found = _step_path(epath.Path(directory), step)
    return {} if found is None else _json(found[1], META_ITEM)


def _best_step(directory: epath.Path, metric: str, mode: str) -> int:
    """The step whose saved metrics have the best `metric` (the latest of equals)."""
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    scores = {}
    for step, path in _step_paths(directory).items():
        name = ocp.checkpoint_manager.METRIC_ITEM_NAME
        saved = _json(path, name, filename=name)
        if metric in saved:
            scores[step] = float(saved[metric]) * (1 if mode == "max" else -1)
    if not scores:
        raise ValueError(f"No checkpoint with metric {metric!r} in {directory}")
    return max(scores, key=lambda step: (scores[step], step))


def _has_arrays(tree: Any) -> bool:
    return any(hasattr(x, "shape") for x in jax.tree.leaves(tree))


def _conform(target: Any, saved: Any) -> Any:
    """`target` (a flax state dict) laid out as the checkpoint's tree `saved` (a TrainState
    saved whole has lists and Nones for tuples); array-less entries it lacks are dropped."""
    if isinstance(saved, list | tuple) and isinstance(target, Mapping):
        if set(target) == {str(i) for i in range(len(saved))}:
            return [_conform(target[str(i)], saved[i]) for i in range(len(saved))]
    if isinstance(saved, Mapping) and isinstance(target, Mapping):
        return {k: _conform(v, saved[k]) if k in saved else v
                for k, v in target.items() if k in saved or _has_arrays(v)}
    if saved is None and not _has_arrays(target):
        return None
    return target


def restore(state: State, directory: Any, step: int | None = None, partitioner: Any = None,
            skip_optimizer: bool = False, transforms: Any = None,
            dataset: Iterator[Any] | None = None, *, best: str | None = None,
            mode: str = "min", partial: bool = False) -> tuple[State, dict[str, Any]]:
    """Restores the checkpoint at `step` (the latest if None, the best by metric `best`):
    (state, metadata), or (`state`, {}) if there is none. `state` may be abstract or, with
    `partial`, some leaves only; `dataset` moves to its saved position. `transforms` are
    orbax's, keyed by '/'-joined paths, e.g. for a new head::

        state, _ = checkpoint.restore(
            state, ckpt_dir, transforms={r'params/head/.*': ocp.Transform(use_fallback=True)})
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
            # "use_fallback" takes values from the given state: real arrays, not shapes.
            args = ocp.args.PyTreeRestore(
                item={k: v for k, v in state_arrays(state).items() if k not in skip},
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                transforms=transforms)
        items = {k: args if k == name else ocp.args.JsonRestore() for k in handlers}
        restored = reader.restore(path, args=ocp.args.Composite(**items))
    arrays, meta = restored[name], dict(restored.get(META_ITEM) or {})
    if transforms is None:  # back in the state's layout: its leaves by name
        by_name = _named_leaves(arrays)
        arrays = jax.tree_util.tree_map_with_path(
            lambda path, _: by_name[jax.tree_util.keystr(path, simple=True, separator="/")], target)
    new_state = flax.serialization.from_state_dict(state, {**state_arrays(state), **arrays})
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
    """`restore` of the best checkpoint by `metric` (as `BestCheckpointAction` saves them)."""
    return restore(state, directory, partitioner=partitioner, skip_optimizer=skip_optimizer,
                   best=metric, mode=mode)[0]


def restore_data_position(dataset: Iterator[Any], meta: Mapping[str, Any]) -> bool:
    """Moves `dataset` to this process's saved data position; returns whether one was saved."""
    position = dataset_state_for_process(meta)
    if position is None:
        return False
    from jaxloop.data import iterators  # noqa: PLC0415 (grain loads only when needed)
    iterators.restore_iterator_state(dataset, position)
    return True


PARAMS_KEY = "params"


def _renamer(rename: Any) -> Any:
    """A function checkpoint name -> target name (None: not loaded)."""
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
        old = next((old for old in prefixes if name.startswith(old)), "")
        new = rename.get(old, "")  # no prefix matched: the name as it is
        return None if new is None else new + name[len(old):]

    return apply


def warm_start(state: State, directory: Any, step: int | None = None, *,
               rename: dict[str, str | None] | Callable[[str], str | None] | None = None,
               strict: bool = True, partitioner: Any = None) -> State:
    """Loads only the parameters of another run's checkpoint into a fresh `state`. `rename`
    maps checkpoint names (``'backbone/Dense_0/kernel'``) to the state's: a dict of prefixes
    (None: not loaded) or a callable. With `strict`, missing or unexpected parameters are a
    ValueError, else logged. A new head::

        state = checkpoint.warm_start(state, 'runs/a/checkpoints', rename={'head/': None},
                                      strict=False, partitioner=partitioner)
    """
    found = _step_path(epath.Path(directory), step)
    if found is None:
        raise ValueError(f"Warm start: no checkpoint in {directory}")
    step, path = found
    rename_fn = _renamer({} if rename is None else rename)
    arrays = state_arrays(state)
    if PARAMS_KEY not in arrays:
        raise ValueError(f"Warm start: the state has no {PARAMS_KEY!r}; it has {sorted(arrays)}")
    others = tuple(k for k in arrays if k != PARAMS_KEY)
    targets = _named_leaves(_abstract_target(state, partitioner, others)[PARAMS_KEY])
    name, handlers = _layout(path)
    with _reader(handlers) as reader:
        saved = _saved_tree(reader, path, name)
    if PARAMS_KEY not in saved:
        raise ValueError(f"Warm start: checkpoint {path} has no {PARAMS_KEY!r}: {sorted(saved)}")
    sources = _named_leaves(saved[PARAMS_KEY])
    loads: dict[str, str] = {}  # target name -> checkpoint name
    unexpected, mismatched = [], []
    for source, meta in sources.items():
        new = rename_fn(source)
        if new is None:
            continue
        if new not in targets:
            unexpected.append(source if new == source else f"{source} (as {new})")
            continue
        if new in loads:
            raise ValueError(f"Warm start: parameters {loads[new]} and {source} both map to {new}")
        target_shape = tuple(targets[new].shape)
        saved_shape = tuple(getattr(meta, "shape", ()) or ())
        if saved_shape != target_shape:
            mismatched.append(f"{source} {saved_shape} -> {new} {target_shape}")
            continue
        loads[new] = source
    missing = sorted(set(targets) - set(loads))
    if mismatched:
        raise ValueError(f"Warm start from {path}: parameter shapes differ (checkpoint -> state): "
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
        # Only the chosen leaves (orbax's renaming transforms match every name against every other).
        item = {PARAMS_KEY: traverse_util.unflatten_dict(
            {old: targets[new] for new, old in loads.items()}, sep="/")}
        restored, _ = restore(item, directory, step, skip_optimizer=True, partial=True)
        from_checkpoint = _named_leaves(restored[PARAMS_KEY])
        loaded = {new: from_checkpoint[old] for new, old in loads.items()}
    leaves = [loaded.get(n, leaf) for n, leaf in _named_leaves(arrays[PARAMS_KEY]).items()]
    params = jax.tree.unflatten(jax.tree.structure(arrays[PARAMS_KEY]), leaves)
    new_state = flax.serialization.from_state_dict(state, {**arrays, PARAMS_KEY: params})
    log.info("Warm start: loaded %d of %d parameters from %s.", len(loads), len(targets), path)
    return new_state
