"""Data loaders for trainers: batches from any iterator, and causal-LM batches of tokens.

Example::

    loader = SimpleDataLoader(iter(batches), validate_batches=True)
    trainer = SimpleTrainer(model, epochs=2, steps_per_epoch=10,
                            batch_spec=loader.get_batch_spec())
    trainer.train(loader)
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxloop import types

Batch = types.Batch
NestedBatch = Any
"""A batch as a (nested) dict of arrays."""

PADDING_TOKEN = -100
"""The label at padded positions (ignored by the loss)."""

_MISSING = object()


class TrainerDataLoader(abc.ABC):
    """A Python iterator of batches for a trainer. Subclasses implement `__next__`."""

    def __iter__(self) -> TrainerDataLoader:
        return self

    @abc.abstractmethod
    def __next__(self) -> NestedBatch:
        """The next batch; raises StopIteration at the end of the data."""


def _leaf_spec(path: str, leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"Batch leaf {path} is {type(leaf).__name__}, not an array: batch leaves must "
            "have a shape and a dtype (numpy or jax arrays)"
        )
    return tuple(shape), np.dtype(dtype)


def _path_str(path: Sequence[Any]) -> str:
    return "batch" + "".join(
        f"[{getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))!r}]" for k in path
    )


def _batch_spec(batch: Batch) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
    specs = [_leaf_spec(_path_str(p), leaf) for p, leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, specs)


class SimpleDataLoader(TrainerDataLoader):
    """Wraps any iterator (or iterable) of ready-made batches.

    `get_batch_spec` peeks at the first batch to report its ``(shape, dtype)`` leaves (a
    spec `SimpleTrainer` and `Step.initialize_model` accept); the peeked batch is still
    the first one `__next__` returns.

    Args:
      dataset: an iterator or iterable of batches (pytrees of arrays).
      validate_batches: check that every batch has the first batch's structure, shapes
        and dtypes (TypeError naming the leaf otherwise).

    Example::

        loader = SimpleDataLoader(iter(batches))
        loader.get_batch_spec()  # {'input_features': ((8, 3), dtype('float32')), ...}
    """

    def __init__(self, dataset: Iterator[Batch] | Iterable[Batch], validate_batches: bool = False):
        if dataset is None:
            raise ValueError("SimpleDataLoader needs a dataset (an iterator of batches)")
        if not isinstance(dataset, Iterator):
            if not isinstance(dataset, Iterable):
                raise TypeError(f"dataset must be an iterator or iterable, got {type(dataset)}")
            dataset = iter(dataset)
        self._dataset = dataset
        self._validate_batches = validate_batches
        self._batch_spec: Any = _MISSING
        self._peeked: Any = _MISSING

    def get_batch_spec(self) -> Any:
        """The ``(shape, dtype)`` spec of the batches, from the first batch.

        Raises:
          ValueError: the dataset is empty.
          TypeError: a leaf of the first batch is not an array.
        """
        if self._batch_spec is _MISSING:
            try:
                first = next(self._dataset)
            except StopIteration:
                raise ValueError("Dataset is empty: SimpleDataLoader found no batch") from None
            self._batch_spec = _batch_spec(first)
            self._peeked = first
        return self._batch_spec

    def _validate(self, batch: Batch) -> None:
        expected = self.get_batch_spec()
        got = _batch_spec(batch)
        exp_leaves, exp_tree = jax.tree_util.tree_flatten_with_path(
            expected, is_leaf=_is_spec_leaf
        )
        got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got, is_leaf=_is_spec_leaf)
        if exp_tree != got_tree:
            raise TypeError(
                f"Batch structure mismatch: expected {exp_tree}, got {got_tree}"
            )
        for (path, want), (_, have) in zip(exp_leaves, got_leaves, strict=True):
            if want != have:
                raise TypeError(
                    f"Batch spec mismatch at {_path_str(path)}: expected shape {want[0]} "
                    f"dtype {want[1]}, got shape {have[0]} dtype {have[1]}"
                )

    def __next__(self) -> Batch:
        if self._peeked is not _MISSING:
            batch, self._peeked = self._peeked, _MISSING
            return batch
        batch = next(self._dataset)
        if self._validate_batches:
            if self._batch_spec is _MISSING:
                self._batch_spec = _batch_spec(batch)  # the first batch sets the spec
            else:
                self._validate(batch)
        return batch


def _is_spec_leaf(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], np.dtype)


class TransformerDataLoader(TrainerDataLoader):
    """Groups token sequences into padded batches for causal language modelling.

    Pulls `batch_size` samples (1-D sequences of token ids) at a time and collates them
    with `collate_fn` (default `clm_collate_fn`). The last batch may be smaller; after it,
    `__next__` raises StopIteration.

    Args:
      dataset: an iterator or iterable of token-id sequences (lists or 1-D arrays).
      batch_size: samples per batch.
      collate_fn: ``fn(list_of_samples) -> batch``.

    Example::

        loader = TransformerDataLoader(iter([[1, 2, 3], [4, 5], [6, 7, 8, 9]]), batch_size=2)
        next(loader)['input_features']['input_ids']  # [[1, 2, 3], [4, 5, 0]]
    """

    def __init__(
        self,
        dataset: Iterator[Any] | Iterable[Any],
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ):
        # The first two messages are google/jaxloop's, which its users' tests match.
        if dataset is None or batch_size is None:
            raise ValueError("`dataset` and `batch_size` must be provided.")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise ValueError(f"`batch_size` must be an integer, got {batch_size!r}")
        if batch_size <= 0:
            raise ValueError(f"`batch_size` must be positive. Got {batch_size}.")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable, got {collate_fn!r}")
        if not isinstance(dataset, Iterator):
            dataset = iter(dataset)
        self._dataset = dataset
        self._batch_size = batch_size
        self._collate_fn = collate_fn if collate_fn is not None else self.clm_collate_fn

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def __next__(self) -> NestedBatch:
        samples = []
        for _ in range(self._batch_size):
            try:
                samples.append(next(self._dataset))
            except StopIteration:
                break
        if not samples:
            raise StopIteration
        return self._collate_fn(samples)

    def clm_collate_fn(self, samples: Sequence[Any]) -> NestedBatch:
        """Right-pads samples with 0 to the longest and builds mask and labels.

        Returns ``{'input_features': {'input_ids', 'attention_mask'}, 'output_features':
        {'labels'}}`` as int32 numpy arrays: the mask is 1 on real tokens and 0 on
        padding, and labels are the input ids with `PADDING_TOKEN` at padding.

        Example::

            clm_collate_fn([[1, 2, 3], [4, 5]])
            # input_ids [[1, 2, 3], [4, 5, 0]], attention_mask [[1, 1, 1], [1, 1, 0]],
            # labels [[1, 2, 3], [4, 5, -100]]
        """
        arrays = []
        for i, sample in enumerate(samples):
            array = np.asarray(sample)
            if array.ndim != 1 or not (
                array.size == 0 or np.issubdtype(array.dtype, np.integer)
            ):
                raise ValueError(
                    f"sample {i} must be a 1-D sequence of integer token ids, got shape "
                    f"{array.shape} dtype {array.dtype}"
                )
            arrays.append(array.astype(np.int32))
        max_len = max(a.shape[0] for a in arrays)
        input_ids = np.zeros((len(arrays), max_len), np.int32)
        attention_mask = np.zeros((len(arrays), max_len), np.int32)
        for i, array in enumerate(arrays):
            input_ids[i, : array.shape[0]] = array
            attention_mask[i, : array.shape[0]] = 1
        labels = np.where(attention_mask == 1, input_ids, PADDING_TOKEN).astype(np.int32)
        return {
            "input_features": {"input_ids": input_ids, "attention_mask": attention_mask},
            "output_features": {"labels": labels},
        }
