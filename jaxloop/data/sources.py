"""`ArraySource`: random access to the examples of a pytree of in-memory arrays."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

Batch = Any
Example = Any


class ArraySource(Sequence[Example]):
    """A random-access source over a pytree of arrays that share their leading dimension::

        source = ArraySource({'image': images, 'label': labels})
        len(source)  # images.shape[0]
        source[3]  # {'image': images[3], 'label': labels[3]}
    """

    def __init__(self, arrays: Any):
        self._arrays = jax.tree.map(np.asarray, arrays)
        lengths = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(self._arrays)}
        if not lengths:
            raise ValueError("ArraySource needs at least one array.")
        if None in lengths or len(lengths) != 1:
            raise ValueError("ArraySource arrays must share a leading dimension; got shapes "
                             f"{jax.tree.map(np.shape, self._arrays)}.")
        self._length = lengths.pop()

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Example:
        if not isinstance(index, int | np.integer):
            raise TypeError(f"ArraySource index must be an int, got {type(index).__name__}.")
        # np.asarray keeps 0-d leaves as arrays, as a gather of several rows would.
        return jax.tree.map(lambda x: np.asarray(x[index]), self._arrays)

    def gather(self, indices: np.ndarray) -> Batch:
        """The examples at `indices`, stacked (one numpy gather per leaf)."""
        return jax.tree.map(lambda x: x[indices], self._arrays)

    def __repr__(self) -> str:
        return f"ArraySource({jax.tree.map(np.shape, self._arrays)})"
