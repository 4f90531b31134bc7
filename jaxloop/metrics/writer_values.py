"""Values made ready for a metric writer, checked before any is written: steps as ints,
scalars as floats, images and videos as uint8 pixels, audio as [N, T, C] floats, hparams
flattened to the types TensorBoard's hparams plugin stores::

    prepare_scalars({'loss': np.float32(0.25)})  # {'loss': 0.25}
    flatten_hparams({'opt': {'lr': 1e-3}})        # {'opt.lr': 0.001}
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

ArrayLike = Any  # a numpy array, a jax array or a Python number
Arrays = Mapping[str, ArrayLike]

_LOGGER = logging.getLogger("jaxloop.metrics.writers")  # where a writer's user looks


class Closing(contextlib.AbstractContextManager):
    """Closes the writer at the end of a ``with`` block."""

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self.close()


def as_step(step: Any) -> int:
    with contextlib.suppress(TypeError):
        return operator.index(step)
    arr = np.asarray(step)  # a size-1 integer array has no __index__ but is still a step
    if arr.size == 1 and arr.dtype.kind in "iu":
        return int(arr.reshape(()))
    raise TypeError(f"step must be an integer, got {step!r} of type {type(step).__name__} "
                    f"(dtype {arr.dtype}, shape {arr.shape}).")


def prepare_scalars(scalars: Arrays) -> dict[str, float]:
    """Every value as a float, all checked before any is written."""
    out = {}
    for key, value in scalars.items():
        # The shape is read first: a per-example array may span other processes' devices.
        shape = np.shape(value)
        if math.prod(shape) != 1:
            raise ValueError(f"write_scalars: value for key {key!r} must be a scalar (0-d or "
                             f"size 1), got an array of shape {shape}.")
        try:
            out[key] = float(np.asarray(value).reshape(()))
        except (TypeError, ValueError) as e:
            raise ValueError(f"write_scalars: value for key {key!r} is not a number: "
                             f"{value!r}") from e
    return out


def is_array(value: Any) -> bool:
    return hasattr(value, "__array__") and hasattr(value, "shape")


def snapshot(value: ArrayLike) -> np.ndarray:
    """A host copy of ``value`` that a reused numpy buffer or a later donation cannot change."""
    arr = np.asarray(value)
    return arr.copy() if isinstance(value, np.ndarray) or not arr.flags.owndata else arr


def snapshot_tree(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: snapshot_tree(v) for key, v in value.items()}
    return snapshot(value) if is_array(value) else value


def flatten_hparams(hparams: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{'opt': {'lr': 1}}`` -> ``{'opt.lr': 1}``."""
    flat: dict[str, Any] = {}
    for key, value in hparams.items():
        flat.update(flatten_hparams(value, prefix=f"{prefix}{key}.")
                    if isinstance(value, Mapping) else {f"{prefix}{key}": value})
    return flat


def hparam_value(value: Any) -> bool | float | str:
    """The value as a bool, float or string, the types the hparams plugin stores."""
    if is_array(value) and np.size(value) == 1:
        value = np.asarray(value).reshape(()).item()
    if isinstance(value, bool | str):
        return value
    return float(value) if isinstance(value, numbers.Real) else str(value)


LAYOUTS = {"Image": ["HW", "HWC", "NHWC"], "Video": ["THWC", "NTHWC"]}


def pixels(kind: str, key: str, value: ArrayLike) -> np.ndarray:
    """An image or video batch as uint8 [N, (T,) H, W, C]; floats in [0, 1], ints in [0, 255]."""
    arr, layouts = np.asarray(value), LAYOUTS[kind]
    shape = arr.shape
    if arr.ndim not in {len(layout) for layout in layouts}:
        names = ", ".join(f"[{', '.join(layout)}]" for layout in layouts)
        raise ValueError(f"{kind} {key!r} must have shape {names}, got shape {shape}.")
    arr = arr[..., None] if arr.ndim == 2 else arr  # [H, W]: one grey image
    arr = arr.reshape((1,) * (len(layouts[-1]) - arr.ndim) + arr.shape)
    if arr.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"{kind} {key!r} must have 1, 3 or 4 channels in its last axis, got shape {shape}.")
    if arr.dtype == np.uint8:
        return arr
    if arr.dtype.kind in "biu":
        return np.clip(arr * 255 if arr.dtype == np.bool_ else arr, 0, 255).astype(np.uint8)
    floats = np.clip(np.nan_to_num(arr.astype(np.float32)), 0.0, 1.0)
    return (floats * 255.0 + 0.5).astype(np.uint8)


def audios_ntc(key: str, value: ArrayLike) -> np.ndarray:
    """[T], [N, T] (mono) or [N, T, C] -> float64 [N, T, C] in [-1, 1]; int16 is divided
    by 2**15, which the WAV encoder multiplies back."""
    arr = np.asarray(value)
    if arr.ndim not in (1, 2, 3) or (arr.ndim == 3 and arr.shape[2] not in (1, 2)):
        raise ValueError(f"Audio {key!r} must have shape [N, T, C] with 1 or 2 channels, "
                         f"[N, T] or [T], got shape {arr.shape}.")
    arr = arr.reshape((1,) * (arr.ndim == 1) + arr.shape + (1,) * (arr.ndim < 3))
    floats = arr / 32768.0 if arr.dtype == np.int16 else np.nan_to_num(arr.astype(np.float64))
    return np.clip(floats, -1.0, 1.0)


def warn_once(writer: Any, message: str, logger: logging.Logger = _LOGGER) -> None:
    """Logs `message` (its ``%s``: the writer's class) at WARNING, once per writer."""
    warned = writer.__dict__.setdefault("_warned", set())
    if message not in warned:
        warned.add(message)
        logger.warning(message, type(writer).__name__)


def has_moviepy(writer: Any) -> bool:
    """Whether moviepy (``jaxloop[video]``) is installed; warns once per writer if not."""
    try:
        import moviepy  # noqa: F401
        return True
    except ImportError:
        warn_once(writer, "%s: videos need moviepy (pip install jaxloop[video]); skipping.")
        return False
