"""Metric writers that write TensorBoard event files without TensorFlow.

The writers have the method names of clu's ``MetricWriter``, so code written for clu's
writers works with these and clu's writers go wherever a jaxloop writer does.
``clu.metric_writers`` imports TensorFlow, so `SummaryWriter` writes with tensorboardX's
``SummaryWriter``, imported when the first one is made (``import jaxloop.writers`` is cheap).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import itertools
import logging
import math
import numbers
import operator
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxloop import async_action_context

__all__ = ["AsyncWriter", "LoggingWriter", "MetricWriter", "MultiWriter", "SummaryWriter",
           "create_default_writer"]

_LOGGER = logging.getLogger(__name__)

ArrayLike = Any
"""A numpy array, a jax array or a Python number."""
Arrays = Mapping[str, ArrayLike]
"""Names mapped to `ArrayLike` values, what the ``write_*`` methods take."""

DEFAULT_HISTOGRAM_BUCKETS = 30
"""Buckets per histogram when ``num_buckets`` names none (``tf.summary.histogram``'s default)."""


@runtime_checkable
class MetricWriter(Protocol):
    """What a metric writer provides: clu's ``MetricWriter`` methods, which jaxloop's and
    clu's writers have (``isinstance(writer, MetricWriter)`` checks the names)."""

    def write_scalars(self, step: int, scalars: Arrays) -> None: ...
    def write_images(self, step: int, images: Arrays) -> None: ...
    def write_videos(self, step: int, videos: Arrays) -> None: ...
    def write_audios(self, step: int, audios: Arrays, *, sample_rate: int) -> None: ...
    def write_texts(self, step: int, texts: Mapping[str, str]) -> None: ...
    def write_histograms(
        self, step: int, arrays: Arrays, num_buckets: Mapping[str, int] | None = None
    ) -> None: ...
    def write_hparams(self, hparams: Mapping[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class _ContextManagerMixin:
    """Makes a writer usable in a ``with`` block that closes it on exit."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self.close()


# Argument checks and conversions, shared by the writers here and by jaxloop.trackers.


def _as_step(step: Any) -> int:
    """Returns ``step`` as a Python int; accepts numpy and jax integer scalars."""
    with contextlib.suppress(TypeError):
        return operator.index(step)
    arr = np.asarray(step)  # a size-1 integer array has no __index__ but is still a step
    if arr.size == 1 and arr.dtype.kind in "iu":
        return int(arr.reshape(()))
    raise TypeError(f"step must be an integer, got {step!r} of type {type(step).__name__} "
                    f"(dtype {arr.dtype}, shape {arr.shape}).")


def _prepare_scalars(scalars: Arrays) -> dict[str, float]:
    """Every value as a float, all checked before any is written."""
    out = {}
    for key, value in scalars.items():
        arr = np.asarray(value)
        if arr.size != 1:
            raise ValueError(f"write_scalars: value for key {key!r} must be a scalar (0-d or "
                             f"size 1), got an array of shape {arr.shape}.")
        try:
            out[key] = float(arr.reshape(()))
        except (TypeError, ValueError) as e:
            raise ValueError(f"write_scalars: value for key {key!r} is not a number: "
                             f"{value!r}") from e
    return out


def _prepare_arrays(arrays: Arrays) -> dict[str, np.ndarray]:
    return {key: np.asarray(value) for key, value in arrays.items()}


def _snapshot(value: ArrayLike) -> np.ndarray:
    """A host copy of ``value`` that nothing else can change or free later: the caller may
    reuse a numpy buffer, and a later donation may overwrite a CPU jax array's buffer."""
    if isinstance(value, np.ndarray):
        return value.copy()
    arr = np.asarray(value)
    return arr if arr.flags.owndata else arr.copy()


def _is_array(value: Any) -> bool:
    return hasattr(value, "__array__") and hasattr(value, "shape")


def _snapshot_tree(value: Any) -> Any:
    """Copies nested mappings and turns every array leaf into a host snapshot."""
    if isinstance(value, Mapping):
        return {key: _snapshot_tree(v) for key, v in value.items()}
    return _snapshot(value) if _is_array(value) else value


def _plain(value: Any) -> Any:
    """A 0-d array as the Python number it holds (for readable logs), anything else as is."""
    return np.asarray(value).item() if _is_array(value) and np.ndim(value) == 0 else value


def _flatten_hparams(hparams: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flattens nested mappings into dotted names: ``{'opt': {'lr': 1}}`` -> ``opt.lr``."""
    flat: dict[str, Any] = {}
    for key, value in hparams.items():
        if isinstance(value, Mapping):
            flat.update(_flatten_hparams(value, prefix=f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _hparam_value(value: Any) -> bool | float | str:
    """Maps a value onto what the hparams plugin can store: bool, number or string."""
    if isinstance(value, bool | np.bool_ | str):
        return value if isinstance(value, str) else bool(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if _is_array(value) and np.size(value) == 1:
        arr = np.asarray(value).reshape(())
        with contextlib.suppress(TypeError, ValueError):
            return bool(arr) if arr.dtype.kind == "b" else float(arr)
    return str(value)  # lists, None, objects: the plugin has no type for them


def _pixels(kind: str, key: str, value: ArrayLike, layouts: Sequence[str]) -> np.ndarray:
    """Checks an image or video batch; returns it as uint8 with the axes of ``layouts[-1]``.
    Floats are taken to lie in [0, 1], integers in [0, 255]."""
    arr = np.asarray(value)
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
    try:
        floats = np.clip(np.nan_to_num(arr.astype(np.float32)), 0.0, 1.0)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{kind} {key!r} has unsupported dtype {arr.dtype}.") from e
    return (floats * 255.0 + 0.5).astype(np.uint8)


def _images_nhwc(key: str, value: ArrayLike) -> np.ndarray:
    """[H, W], [H, W, C] or [N, H, W, C] -> uint8 [N, H, W, C]."""
    return _pixels("Image", key, value, ["HW", "HWC", "NHWC"])


def _videos_nthwc(key: str, value: ArrayLike) -> np.ndarray:
    """[T, H, W, C] or [N, T, H, W, C] -> uint8 [N, T, H, W, C]."""
    return _pixels("Video", key, value, ["THWC", "NTHWC"])


def _audios_ntc(key: str, value: ArrayLike) -> np.ndarray:
    """[T], [N, T] (mono) or [N, T, C] -> float64 [N, T, C] in [-1, 1]; int16 is divided
    by 2**15, which the WAV encoder multiplies back."""
    arr = np.asarray(value)
    if arr.ndim not in (1, 2, 3) or (arr.ndim == 3 and arr.shape[2] not in (1, 2)):
        raise ValueError(f"Audio {key!r} must have shape [N, T, C] with 1 or 2 channels, "
                         f"[N, T] or [T], got shape {arr.shape}.")
    arr = arr.reshape((1,) * (arr.ndim == 1) + arr.shape + (1,) * (arr.ndim < 3))
    floats = arr / 32768.0 if arr.dtype == np.int16 else np.nan_to_num(arr.astype(np.float64))
    return np.clip(floats, -1.0, 1.0)


# GIF helpers of jaxloop.trackers (W&B videos).


def _tile_videos(videos: np.ndarray) -> np.ndarray:
    """[N, T, H, W, C] -> [T, rows * H, cols * W, C], the N videos laid out in a grid."""
    n, t, h, w, c = videos.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = np.zeros((rows * cols, t, h, w, c), np.uint8)
    grid[:n] = videos
    grid = grid.reshape(rows, cols, t, h, w, c).transpose(2, 0, 3, 1, 4, 5)
    return grid.reshape(t, rows * h, cols * w, c)


def _encode_gif(frames: np.ndarray, fps: float) -> bytes:
    """Encodes uint8 [T, H, W, C] frames as a looping animated GIF with Pillow."""
    from PIL import Image

    frames = frames[..., 0] if frames.shape[-1] == 1 else frames[..., :3]  # GIF has no alpha
    images = [Image.fromarray(np.ascontiguousarray(frame)) for frame in frames]
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:],
                   duration=max(1, round(1000.0 / fps)), loop=0)
    return buffer.getvalue()


_EVENT_FILES = itertools.count()


class SummaryWriter(_ContextManagerMixin):
    """Writes TensorBoard event files into ``logdir`` with tensorboardX, without TensorFlow.

    Where tensorboardX puts things:

    * scalars (``add_scalar``): characters of a key other than letters, digits and ``_-/.``
      become ``_``.
    * images (``add_images``): one PNG per key and step, N images tiled into one grid.
    * videos (``add_video``): one GIF per key and step, N videos tiled; needs ``moviepy``.
    * audios (``add_audio``): one WAV per clip, 1 or 2 channels; N clips of a key are tagged
      ``key/0`` ... ``key/{N-1}``; needs ``soundfile``.
    * texts (``add_text``): tagged ``key/text_summary``, shown as Markdown.
    * histograms (``add_histogram``).
    * hparams (``add_hparams``): into a new sub-run named by the time of the call (e.g.
      ``train/1718000000.25``) that lists no metrics: the HParams tab shows each such
      session's hyperparameters, the Scalars tab the metrics.

    Without ``moviepy`` or ``soundfile``, the writer warns once and skips videos or audios.
    Encoding happens on the calling thread (see `AsyncWriter`); tensorboardX's thread
    writes the file and flushes it every ``flush_secs``. tensorboardX's flush does not wait
    for that thread, so `flush` closes the file and the next write opens a new one.

    Args:
      logdir: directory for the event files, created if missing (a path, an ``epath.Path``,
        or a ``gs://``/``s3://`` URL with google-cloud-storage or boto3 installed).
      flush_secs: how often tensorboardX's thread flushes the file.
      video_fps: frame rate of the GIFs written by `write_videos`.

    Example::

        with SummaryWriter('/tmp/run/train') as writer:
            writer.write_scalars(0, {'loss': 0.5, 'accuracy': jnp.float32(0.9)})
            writer.write_images(0, {'inputs': images})  # [N, H, W, C], floats in [0, 1]
    """

    def __init__(self, logdir: str | os.PathLike[str], *, flush_secs: float = 120.0,
                 video_fps: float = 4.0) -> None:
        self._logdir = os.fspath(logdir)
        self._flush_secs, self._video_fps = flush_secs, video_fps
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._closed = self._unflushed = False
        self._events = self._open()

    def _open(self) -> Any:
        from tensorboardX import SummaryWriter as EventWriter

        # Files are named by the second they are opened in; the pid and a zero-padded
        # counter keep two of one second apart and in the order they were opened.
        suffix = f".{os.getpid()}.{next(_EVENT_FILES):06d}"
        return EventWriter(self._logdir, flush_secs=self._flush_secs, filename_suffix=suffix)

    @property
    def logdir(self) -> str:
        """The directory the event files are written to."""
        return self._logdir

    @contextlib.contextmanager
    def _writing(self):
        """The tensorboardX writer to add to, held for this thread."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"SummaryWriter for {self._logdir!r} is closed.")
            if self._events is None:
                self._events = self._open()
            self._unflushed = True
            yield self._events

    def _add(self, adder: str, step: int, values: Mapping[str, Any], **kwargs: Any) -> None:
        """Calls tensorboardX's ``adder(tag, value, step, **kwargs)`` for each value."""
        with self._writing() as events:
            for tag, value in values.items():
                getattr(events, adder)(tag, value, step, **kwargs)

    def _can_import(self, package: str, method: str) -> bool:
        try:
            importlib.import_module(package)
            return True
        except ImportError:
            if method not in self._warned:
                self._warned.add(method)
                _LOGGER.warning("%s needs %s (pip install %s); skipping.", method, package,
                                package)
            return False

    def write_scalars(self, step: int, scalars: Arrays) -> None:
        """Writes scalars (0-d or size-1 arrays, or numbers)."""
        self._add("add_scalar", _as_step(step), _prepare_scalars(scalars))

    def write_images(self, step: int, images: Arrays) -> None:
        """Writes images of shape [H, W], [H, W, C] or [N, H, W, C], C in 1/3/4: floats in
        [0, 1] (clipped), integers in [0, 255]."""
        step = _as_step(step)
        batches = {key: _images_nhwc(key, value) for key, value in images.items()}
        self._add("add_images", step, batches, dataformats="NHWC")

    def write_videos(self, step: int, videos: Arrays) -> None:
        """Writes videos of shape [T, H, W, C] or [N, T, H, W, C] as animated GIFs."""
        step = _as_step(step)
        batches = {key: _videos_nthwc(key, value)[..., :3] for key, value in videos.items()}
        if batches and self._can_import("moviepy", "write_videos"):
            self._add("add_video", step, batches, fps=self._video_fps, dataformats="NTHWC")

    def write_audios(self, step: int, audios: Arrays, *, sample_rate: int) -> None:
        """Writes clips, [N, T, C] (or [N, T] / [T] for mono), as 16-bit WAV: floats in
        [-1, 1] (clipped), or int16."""
        step, sample_rate = _as_step(step), operator.index(sample_rate)
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}.")
        clips = {}
        for key, value in audios.items():
            batch = _audios_ntc(key, value)
            clips.update({key if len(batch) == 1 else f"{key}/{i}": c for i, c in enumerate(batch)})
        if clips and self._can_import("soundfile", "write_audios"):
            self._add("add_audio", step, clips, sample_rate=sample_rate)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        """Writes strings, shown as Markdown in the Text tab."""
        self._add("add_text", _as_step(step), {key: str(text) for key, text in texts.items()})

    def write_histograms(self, step: int, arrays: Arrays,
                         num_buckets: Mapping[str, int] | None = None) -> None:
        """Writes a histogram of each array, with ``num_buckets[key]`` buckets (default
        `DEFAULT_HISTOGRAM_BUCKETS`). Non-finite values are left out with a warning (the
        buckets cannot hold them); an array with no finite values is skipped."""
        step, buckets = _as_step(step), num_buckets or {}
        finite = {}
        for key, value in arrays.items():
            flat = np.asarray(value, np.float64).reshape(-1)
            finite[key] = flat[np.isfinite(flat)]
            if finite[key].size < flat.size:
                _LOGGER.warning("Histogram %r at step %d: left out %d non-finite of %d values.",
                                key, step, flat.size - finite[key].size, flat.size)
        with self._writing() as events:
            for key, values in finite.items():
                if values.size:
                    bins = buckets.get(key, DEFAULT_HISTOGRAM_BUCKETS)
                    events.add_histogram(key, values, step, bins=bins)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Writes hyperparameters, into a sub-run (see above). Nested mappings become dotted
        names (``opt.lr``); bools, numbers (as floats) and strings keep their type, anything
        else is written as its ``str()``."""
        flat = {key: _hparam_value(v) for key, v in _flatten_hparams(hparams).items()}
        with self._writing() as events:
            events.add_hparams(flat, {})

    def flush(self) -> None:
        """Makes everything written so far readable: closes the event file (see above)."""
        with self._lock:
            if self._unflushed:
                self._events.close()
                self._events, self._unflushed = None, False

    def close(self) -> None:
        """Closes the event file; closing twice is fine."""
        with self._lock:
            if self._events is not None:
                self._events.close()
            self._events, self._unflushed, self._closed = None, False, True


class _Forwarder(_ContextManagerMixin):
    """Checks and converts a call's arguments once, then hands the call to `_forward`."""

    _to_host: Any = staticmethod(np.asarray)  # what array values are passed on as

    def _forward(self, method: str, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def _arrays(self, arrays: Arrays) -> dict[str, Any]:
        return {key: self._to_host(value) for key, value in arrays.items()}

    def write_scalars(self, step: int, scalars: Arrays) -> None:
        self._forward("write_scalars", _as_step(step), _prepare_scalars(scalars))

    def write_images(self, step: int, images: Arrays) -> None:
        self._forward("write_images", _as_step(step), self._arrays(images))

    def write_videos(self, step: int, videos: Arrays) -> None:
        self._forward("write_videos", _as_step(step), self._arrays(videos))

    def write_audios(self, step: int, audios: Arrays, *, sample_rate: int) -> None:
        self._forward("write_audios", _as_step(step), self._arrays(audios),
                      sample_rate=sample_rate)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._forward("write_texts", _as_step(step), dict(texts))

    def write_histograms(self, step: int, arrays: Arrays,
                         num_buckets: Mapping[str, int] | None = None) -> None:
        buckets = dict(num_buckets) if num_buckets is not None else None
        self._forward("write_histograms", _as_step(step), self._arrays(arrays), buckets)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._forward("write_hparams", _snapshot_tree(hparams))


class LoggingWriter(_Forwarder):
    """Writes metrics as lines of Python `logging`: ``[prefix] step | key=value, ...`` for
    scalars, only the shapes of images, videos, audios and histograms. Records go to the
    ``jaxloop.writers`` logger at INFO unless ``logger``/``level`` say otherwise.

    Example::

        writer = LoggingWriter('train')
        writer.write_scalars(10, {'loss': 0.25})  # logs "[train] 10 | loss=0.25"
    """

    _to_host = staticmethod(lambda value: value)  # only shapes are logged: no device copy

    def __init__(self, prefix: str = "", *, logger: logging.Logger | None = None,
                 level: int = logging.INFO) -> None:
        self._prefix = f"[{prefix}] " if prefix else ""
        self._logger = logger if logger is not None else _LOGGER
        self._level = level

    def _log(self, message: str) -> None:
        self._logger.log(self._level, "%s%s", self._prefix, message)

    def _forward(self, method: str, *args: Any, **kwargs: Any) -> None:
        if method == "write_hparams":
            flat = _flatten_hparams(args[0])
            self._log("hparams: " + ", ".join(f"{k}={_plain(v)!r}" for k, v in flat.items()))
            return
        step, values = args[:2]
        if method == "write_texts":
            for key, text in values.items():
                self._log(f"{step} | text {key}: {text}")
        elif method == "write_scalars" and values:
            self._log(f"{step} | " + ", ".join(f"{k}={v:.6g}" for k, v in values.items()))
        elif method != "write_scalars" and values:
            kind = method.removeprefix("write_")
            if "sample_rate" in kwargs:
                kind += f" at {kwargs['sample_rate']} Hz"
            shapes = ", ".join(f"{key} shape={np.shape(value)}" for key, value in values.items())
            self._log(f"{step} | {kind}: {shapes}")

    def flush(self) -> None:
        """Nothing to do: records are handed to logging as they come."""

    def close(self) -> None:
        """Nothing to do."""


class MultiWriter(_Forwarder):
    """Forwards every call to each of ``writers``, in order.

    Steps and values are converted (and checked) once, before any writer is called, so a
    bad value never leaves one writer with the data and another without. A writer that
    raises does not keep the others from the call; the first error is raised after.

    Example::

        writer = MultiWriter([LoggingWriter(), SummaryWriter('/tmp/run')])
        writer.write_scalars(0, {'loss': 1.0})
    """

    def __init__(self, writers: Sequence[MetricWriter]) -> None:
        self._writers = tuple(writers)

    @property
    def writers(self) -> tuple[MetricWriter, ...]:
        """The writers called, in order."""
        return self._writers

    def _forward(self, method: str, *args: Any, **kwargs: Any) -> None:
        errors = []
        for writer in self._writers:
            try:
                getattr(writer, method)(*args, **kwargs)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def flush(self) -> None:
        self._forward("flush")

    def close(self) -> None:
        self._forward("close")


def _call(writer: MetricWriter, method: str, args: tuple, kwargs: dict,
          failed: list[Future], room: threading.Semaphore) -> None:
    """Runs one call on an `AsyncWriter`'s thread and records its failure."""
    try:
        getattr(writer, method)(*args, **kwargs)
    except BaseException as e:
        _LOGGER.error("AsyncWriter: %s failed; the error is raised again by the next call.",
                      method, exc_info=True)
        failed.append(async_action_context.get_async_action_context().add_exception(
            f"AsyncWriter({type(writer).__name__}).{method}", e))
    finally:
        room.release()


def _close_abandoned(pool: ThreadPoolExecutor, close: Any) -> None:
    # An unclosed AsyncWriter was collected (maybe on its own thread, which must not wait
    # for itself), or the interpreter exits (the pool has then finished its queue).
    try:
        pool.submit(close)
    except RuntimeError:
        close()
    pool.shutdown(wait=False)


class AsyncWriter(_Forwarder):
    """Does another writer's writing on one background thread, in the order of the calls.

    A call returns once its arguments are host numpy copies (buffers donated or deleted
    afterwards are never read); encoding and file I/O happen on the thread. When
    ``max_queue`` calls wait, the next one blocks. An error of the wrapped writer is raised
    by the next call here, or at the next loop boundary (`jaxloop.async_action_context`).
    An abandoned writer is closed when collected or at exit; `close` it to see errors.

    Example::

        with AsyncWriter(SummaryWriter('/tmp/run')) as writer:
            for step in range(1000):
                writer.write_scalars(step, {'loss': loss})  # returns without file I/O
            writer.flush()  # everything so far is on disk
    """

    _to_host = staticmethod(_snapshot)

    def __init__(self, writer: MetricWriter, *, max_queue: int = 128) -> None:
        self._writer = writer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxloop-AsyncWriter")
        self._room = threading.Semaphore(max_queue)
        self._failed: list[Future] = []
        self._closed = False
        # Starts the thread now: started inside the first write, it would run that write
        # while the caller waits for it to start.
        self._pool.submit(int)
        # Holds the pool and the writer, never self, so an abandoned writer is collected.
        self._abandoned = weakref.finalize(self, _close_abandoned, self._pool, writer.close)

    @property
    def writer(self) -> MetricWriter:
        """The wrapped writer."""
        return self._writer

    def _submit(self, method: str, *args: Any, **kwargs: Any) -> Future:
        self._room.acquire()
        return self._pool.submit(_call, self._writer, method, args, kwargs, self._failed,
                                 self._room)

    def _raise_pending(self) -> None:
        failed = [self._failed.pop(0) for _ in range(len(self._failed))]
        # An error a loop boundary already raised is not raised again. Of the others, the
        # first is the likely cause; later ones were logged on the thread.
        context = async_action_context.get_async_action_context()
        unraised = [f for f in failed if context.discard(f)]
        if unraised:
            raise unraised[0].exception()

    def _forward(self, method: str, *args: Any, **kwargs: Any) -> None:
        self._raise_pending()
        if self._closed:
            raise RuntimeError(f"AsyncWriter.{method} called after close().")
        self._submit(method, *args, **kwargs)

    def flush(self) -> None:
        """Waits until every call so far has been written, then flushes the wrapped writer."""
        self._raise_pending()
        if not self._closed:
            self._submit("flush").result()
            self._raise_pending()

    def close(self) -> None:
        """Writes what is queued, closes the wrapped writer and ends the thread."""
        if not self._closed:
            self._closed = True
            self._abandoned.detach()
            self._submit("close")
            self._pool.shutdown(wait=True)
        self._raise_pending()


def create_default_writer(logdir: str | os.PathLike[str] | None = None, *,
                          just_logging: bool = False, asynchronous: bool = True,
                          collection: str | None = None) -> MetricWriter:
    """``MultiWriter([LoggingWriter, SummaryWriter])``, in an `AsyncWriter` when
    ``asynchronous``, or only a `LoggingWriter` when ``just_logging`` or ``logdir`` is None;
    as clu's function of that name.

    Only process 0 of a multi-process job writes event files (elsewhere the writer only
    logs), so create the writer after ``jax.distributed.initialize()``.

    Args:
      logdir: the directory for event files, or None to only log.
      just_logging: only log, even when ``logdir`` is given.
      asynchronous: write on a background thread (see `AsyncWriter`).
      collection: write event files into ``logdir/collection`` and prefix log lines with
        ``[collection]``, e.g. ``'train'`` and ``'eval'`` to get two TensorBoard runs.

    Example::

        train_writer = create_default_writer(workdir, collection='train')
        train_writer.write_scalars(step, {'loss': loss})
    """
    prefix = collection or ""
    if just_logging or logdir is None:
        return LoggingWriter(prefix)
    import jax

    writers: list[MetricWriter] = [LoggingWriter(prefix)]
    if jax.process_index() == 0:
        path = os.fspath(logdir)
        writers.append(SummaryWriter(os.path.join(path, collection) if collection else path))
    writer = MultiWriter(writers)
    return AsyncWriter(writer) if asynchronous else writer
