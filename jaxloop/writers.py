"""Metric writers that write TensorBoard event files without TensorFlow.

The writers have the method names of clu's ``MetricWriter`` (``write_scalars``,
``write_images``, ``write_videos``, ``write_audios``, ``write_texts``,
``write_histograms``, ``write_hparams``, ``flush``, ``close``), so code written for clu's
writers works with these unchanged, and clu's writers can be passed wherever a jaxloop
writer is expected. ``clu.metric_writers`` itself is never imported here because it imports
TensorFlow; event files are written with ``tensorboardX`` instead, which is imported lazily
so that ``import jaxloop.writers`` stays cheap.

What ends up in the event file:

* scalars: legacy ``simple_value`` summaries (TensorBoard's Scalars tab);
* images: one ``images``-plugin tensor per key holding all N images as PNGs, the same
  layout ``tf.summary.image`` writes, so N images show as N samples of one card;
* videos: an animated GIF per key (N videos tiled into a grid), encoded with Pillow;
* audios: one ``audio``-plugin tensor per key holding all N clips as 16-bit WAV;
* texts: one ``text``-plugin string tensor per key (rendered as Markdown by TensorBoard);
* histograms: legacy histogram summaries;
* hparams: the hparams-plugin ``session_start_info`` summary, written into the writer's own
  run (unlike ``tensorboardX.SummaryWriter.add_hparams``, which creates a sub-run).

Example::

    from jaxloop import writers

    writer = writers.create_default_writer('/tmp/run', collection='train')
    writer.write_hparams({'lr': 1e-3, 'model': {'depth': 4}})
    for step in range(100):
        writer.write_scalars(step, {'loss': loss})
    writer.close()
"""

from __future__ import annotations

import functools
import io
import itertools
import logging
import math
import numbers
import operator
import os
import queue
import struct
import threading
import time
import types
import wave
import weakref
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxloop import async_action_context

__all__ = [
    "AsyncWriter",
    "LoggingWriter",
    "MetricWriter",
    "MultiWriter",
    "SummaryWriter",
    "create_default_writer",
]

_LOGGER = logging.getLogger(__name__)

ArrayLike = Any
"""A numpy array, a jax array or a Python number."""

DEFAULT_HISTOGRAM_BUCKETS = 30
"""Buckets per histogram when ``num_buckets`` names none (``tf.summary.histogram``'s default)."""


@runtime_checkable
class MetricWriter(Protocol):
    """What a metric writer provides: clu's ``MetricWriter`` method names.

    jaxloop's writers and clu's writers both satisfy this protocol, so either can be used
    where one is expected.

    Example::

        def log_loss(writer: MetricWriter, step: int, loss: float) -> None:
            writer.write_scalars(step, {'loss': loss})
    """

    def write_scalars(self, step: int, scalars: Mapping[str, ArrayLike]) -> None: ...

    def write_images(self, step: int, images: Mapping[str, ArrayLike]) -> None: ...

    def write_videos(self, step: int, videos: Mapping[str, ArrayLike]) -> None: ...

    def write_audios(
        self, step: int, audios: Mapping[str, ArrayLike], *, sample_rate: int
    ) -> None: ...

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None: ...

    def write_histograms(
        self,
        step: int,
        arrays: Mapping[str, ArrayLike],
        num_buckets: Mapping[str, int] | None = None,
    ) -> None: ...

    def write_hparams(self, hparams: Mapping[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class _ContextManagerMixin:
    """Makes a writer usable in a ``with`` block that closes it on exit."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self.close()


# --------------------------------------------------------------------------------------
# Argument normalisation shared by all writers.
# --------------------------------------------------------------------------------------


def _as_step(step: Any) -> int:
    """Returns ``step`` as a Python int; accepts numpy and jax integer scalars."""
    try:
        return operator.index(step)
    except TypeError:
        pass
    # A size-1 integer array (shape (1,), say) has no __index__ but is still a step.
    arr = np.asarray(step)
    if arr.size == 1 and arr.dtype.kind in "iu":
        return int(arr.reshape(()))
    raise TypeError(
        f"step must be an integer, got {step!r} of type {type(step).__name__} "
        f"(dtype {arr.dtype}, shape {arr.shape})."
    )


def _scalar_to_float(key: str, value: ArrayLike) -> float:
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(
            f"write_scalars: value for key {key!r} must be a scalar (0-d or size 1), "
            f"got an array of shape {arr.shape}."
        )
    try:
        return float(arr.reshape(()))
    except (TypeError, ValueError) as e:
        raise ValueError(f"write_scalars: value for key {key!r} is not a number: {value!r}") from e


def _prepare_scalars(scalars: Mapping[str, ArrayLike]) -> dict[str, float]:
    return {key: _scalar_to_float(key, value) for key, value in scalars.items()}


def _prepare_arrays(arrays: Mapping[str, ArrayLike]) -> dict[str, np.ndarray]:
    return {key: np.asarray(value) for key, value in arrays.items()}


def _snapshot(value: ArrayLike) -> np.ndarray:
    """A host copy of ``value`` that nothing else can change or free later.

    numpy inputs are copied because the caller may reuse the buffer after the call returns.
    A jax array usually comes back from ``np.asarray`` as a fresh host copy that owns its
    memory; on the CPU backend it can be a view of the device buffer instead, which a
    later donation could overwrite, so views are copied too.
    """
    if isinstance(value, np.ndarray):
        return value.copy()
    arr = np.asarray(value)
    return arr if arr.flags.owndata else arr.copy()


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray | np.generic) or (
        hasattr(value, "__array__") and hasattr(value, "shape")
    )


def _snapshot_tree(value: Any) -> Any:
    """Copies nested mappings and turns every array leaf into a host snapshot."""
    if isinstance(value, Mapping):
        return {key: _snapshot_tree(v) for key, v in value.items()}
    if _is_array(value):
        return _snapshot(value)
    return value


def _plain(value: Any) -> Any:
    """A 0-d array as the Python number it holds (for readable logs), anything else as is."""
    if _is_array(value) and np.ndim(value) == 0:
        return np.asarray(value).item()
    return value


def _flatten_hparams(hparams: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flattens nested mappings into dotted names: ``{'opt': {'lr': 1}}`` -> ``opt.lr``."""
    flat: dict[str, Any] = {}
    for key, value in hparams.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten_hparams(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


def _hparam_value(value: Any) -> bool | float | str:
    """Maps a value onto what the hparams plugin can store: bool, number or string."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if _is_array(value):
        arr = np.asarray(value)
        if arr.size == 1:
            if arr.dtype.kind == "b":
                return bool(arr.reshape(()))
            try:
                return float(arr.reshape(()))
            except (TypeError, ValueError):
                pass
    # Lists, tuples, None and arbitrary objects: the plugin has no type for them.
    return str(value)


# --------------------------------------------------------------------------------------
# Encoders: PNG, GIF and WAV from numpy arrays.
# --------------------------------------------------------------------------------------


def _to_uint8(key: str, arr: np.ndarray) -> np.ndarray:
    """Converts image data to uint8: floats are taken to lie in [0, 1], integers in [0, 255]."""
    if arr.dtype == np.uint8:
        return arr
    if arr.dtype == np.bool_:
        return arr.astype(np.uint8) * np.uint8(255)
    if arr.dtype.kind in "iu":
        return np.clip(arr, 0, 255).astype(np.uint8)
    try:
        floats = arr.astype(np.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Image {key!r} has unsupported dtype {arr.dtype}.") from e
    floats = np.clip(np.nan_to_num(floats), 0.0, 1.0)
    return (floats * 255.0 + 0.5).astype(np.uint8)


def _check_channels(kind: str, key: str, channels: int, shape: tuple[int, ...]) -> None:
    """Checks the channel count; ``shape`` is the caller's, before any axes were added."""
    if channels not in (1, 3, 4):
        raise ValueError(
            f"{kind} {key!r} must have 1, 3 or 4 channels in its last axis, got shape {shape}."
        )


def _images_nhwc(key: str, value: ArrayLike) -> np.ndarray:
    """[H, W], [H, W, C] or [N, H, W, C] -> uint8 [N, H, W, C]."""
    arr = np.asarray(value)
    shape = arr.shape
    if arr.ndim == 2:
        arr = arr[None, :, :, None]
    elif arr.ndim == 3:
        arr = arr[None]
    elif arr.ndim != 4:
        raise ValueError(
            f"Image {key!r} must have shape [H, W], [H, W, C] or [N, H, W, C], "
            f"got shape {arr.shape}."
        )
    _check_channels("Image", key, arr.shape[-1], shape)
    return _to_uint8(key, arr)


def _videos_nthwc(key: str, value: ArrayLike) -> np.ndarray:
    """[T, H, W, C] or [N, T, H, W, C] -> uint8 [N, T, H, W, C]."""
    arr = np.asarray(value)
    shape = arr.shape
    if arr.ndim == 4:
        arr = arr[None]
    elif arr.ndim != 5:
        raise ValueError(
            f"Video {key!r} must have shape [T, H, W, C] or [N, T, H, W, C], got shape {arr.shape}."
        )
    _check_channels("Video", key, arr.shape[-1], shape)
    return _to_uint8(key, arr)


def _encode_png(image: np.ndarray) -> bytes:
    """Encodes a uint8 [H, W, C] image (C in 1, 3, 4) as PNG, with zlib and no Pillow."""
    height, width, channels = image.shape
    color_type = {1: 0, 3: 2, 4: 6}[channels]  # greyscale, RGB, RGBA
    # Each scanline starts with its filter type; 0 (none) keeps the encoder trivial.
    rows = np.zeros((height, 1 + width * channels), np.uint8)
    rows[:, 1:] = image.reshape(height, width * channels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes()))
        + chunk(b"IEND", b"")
    )


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
    """Encodes uint8 [T, H, W, C] frames as a looping animated GIF (needs Pillow)."""
    from PIL import Image

    if frames.shape[-1] == 1:
        frames = frames[..., 0]
    elif frames.shape[-1] == 4:
        frames = frames[..., :3]  # GIF has only on/off transparency; drop alpha
    images = [Image.fromarray(np.ascontiguousarray(frame)) for frame in frames]
    buffer = io.BytesIO()
    images[0].save(
        buffer,
        format="GIF",
        save_all=True,
        append_images=images[1:],
        duration=max(1, round(1000.0 / fps)),
        loop=0,
    )
    return buffer.getvalue()


def _audios_ntc(key: str, value: ArrayLike) -> np.ndarray:
    """[T] (one mono clip), [N, T] (N mono clips) or [N, T, C] -> [N, T, C]."""
    arr = np.asarray(value)
    if arr.ndim == 1:
        arr = arr[None, :, None]
    elif arr.ndim == 2:
        arr = arr[:, :, None]
    elif arr.ndim != 3:
        raise ValueError(
            f"Audio {key!r} must have shape [N, T, C], [N, T] or [T], got shape {arr.shape}."
        )
    return arr


def _encode_wav(clip: np.ndarray, sample_rate: int) -> bytes:
    """Encodes a [T, C] clip as 16-bit PCM WAV; floats are taken to lie in [-1, 1]."""
    if clip.dtype == np.int16:
        pcm = clip
    else:
        floats = np.clip(np.nan_to_num(clip.astype(np.float32)), -1.0, 1.0)
        pcm = np.round(floats * 32767.0)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(clip.shape[1])
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(np.ascontiguousarray(pcm, dtype="<i2").tobytes())
    return buffer.getvalue()


# The serialized AudioPluginData{encoding: WAV}: field 2 (varint) = 11. Written by hand so
# that the audio plugin's proto module (part of the tensorboard package) is not needed.
_AUDIO_PLUGIN_CONTENT_WAV = b"\x10\x0b"


@functools.cache
def _tbx() -> types.SimpleNamespace:
    """tensorboardX's protos and helpers, imported on first use (the import takes ~0.3 s)."""
    from tensorboardX import event_file_writer, record_writer, summary
    from tensorboardX.proto import (
        event_pb2,
        plugin_hparams_pb2,
        summary_pb2,
        tensor_pb2,
        tensor_shape_pb2,
    )

    return types.SimpleNamespace(
        EventsWriter=event_file_writer.EventsWriter,
        directory_check=record_writer.directory_check,
        make_histogram=summary.make_histogram,
        Event=event_pb2.Event,
        HParamsPluginData=plugin_hparams_pb2.HParamsPluginData,
        SessionStartInfo=plugin_hparams_pb2.SessionStartInfo,
        Summary=summary_pb2.Summary,
        SummaryMetadata=summary_pb2.SummaryMetadata,
        TensorProto=tensor_pb2.TensorProto,
        TensorShapeProto=tensor_shape_pb2.TensorShapeProto,
    )


def _string_tensor(values: Sequence[bytes], shape: Sequence[int]) -> Any:
    tbx = _tbx()
    dims = [tbx.TensorShapeProto.Dim(size=size) for size in shape]
    return tbx.TensorProto(
        dtype="DT_STRING",
        tensor_shape=tbx.TensorShapeProto(dim=dims),
        string_val=list(values),
    )


def _plugin_metadata(plugin_name: str, content: bytes = b"") -> Any:
    tbx = _tbx()
    return tbx.SummaryMetadata(
        plugin_data=tbx.SummaryMetadata.PluginData(plugin_name=plugin_name, content=content)
    )


# Events files are named events.out.tfevents.<seconds>.<host><suffix>; the pid and a
# counter in the suffix keep two writers opened in the same second from clobbering a file.
_EVENT_FILE_COUNTER = itertools.count()


class SummaryWriter(_ContextManagerMixin):
    """Writes TensorBoard event files into ``logdir`` without TensorFlow.

    Writes happen on the calling thread; wrap the writer in `AsyncWriter` to keep file I/O
    and image encoding off the training loop. The file is flushed by `flush`, `close`, and
    by the first write after ``flush_secs`` seconds have passed since the last flush.

    Args:
      logdir: directory for the event file, created if missing. A local path, an
        ``etils.epath.Path``, or a ``gs://``/``s3://`` URL (tensorboardX's writers for these
        need google-cloud-storage or boto3).
      flush_secs: flush at most this long after a write, when the next write comes.
      video_fps: frame rate of the GIFs written by `write_videos`.

    Example::

        with SummaryWriter('/tmp/run/train') as writer:
            writer.write_scalars(0, {'loss': 0.5, 'accuracy': jnp.float32(0.9)})
            writer.write_images(0, {'inputs': images})  # [N, H, W, C], floats in [0, 1]
    """

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        *,
        flush_secs: float = 120.0,
        video_fps: float = 4.0,
    ) -> None:
        tbx = _tbx()
        self._logdir = os.fspath(logdir)
        if "://" in self._logdir:
            tbx.directory_check(self._logdir)
        else:
            os.makedirs(self._logdir, exist_ok=True)
        suffix = f".{os.getpid()}.{next(_EVENT_FILE_COUNTER)}"
        self._events = tbx.EventsWriter(os.path.join(self._logdir, "events"), suffix)
        self._flush_secs = flush_secs
        self._next_flush = time.monotonic() + flush_secs
        self._video_fps = video_fps
        self._warned_no_video = False
        self._lock = threading.Lock()
        self._closed = False

    @property
    def logdir(self) -> str:
        """The directory the event file is written to."""
        return self._logdir

    def _write(self, step: int, values: list[Any]) -> None:
        if not values:
            return
        tbx = _tbx()
        event = tbx.Event(wall_time=time.time(), step=step, summary=tbx.Summary(value=values))
        with self._lock:
            if self._closed:
                raise RuntimeError(f"SummaryWriter for {self._logdir!r} is closed.")
            self._events.write_event(event)
            if time.monotonic() >= self._next_flush:
                self._flush_locked()

    def _flush_locked(self) -> None:
        self._events.flush()
        self._next_flush = time.monotonic() + self._flush_secs

    def write_scalars(self, step: int, scalars: Mapping[str, ArrayLike]) -> None:
        """Writes scalars (0-d or size-1 arrays, or numbers) as TensorBoard scalars."""
        step = _as_step(step)
        Value = _tbx().Summary.Value
        values = [
            Value(tag=key, simple_value=value) for key, value in _prepare_scalars(scalars).items()
        ]
        self._write(step, values)

    def write_images(self, step: int, images: Mapping[str, ArrayLike]) -> None:
        """Writes images of shape [H, W], [H, W, C] or [N, H, W, C], C in 1/3/4.

        Float images are taken to lie in [0, 1] (and clipped), integers in [0, 255].
        """
        step = _as_step(step)
        Value = _tbx().Summary.Value
        values = []
        for key, value in images.items():
            batch = _images_nhwc(key, value)
            _, height, width, _ = batch.shape
            # Same layout as tf.summary.image: [width, height, png_0, ..., png_{N-1}].
            blobs = [str(width).encode(), str(height).encode()]
            blobs += [_encode_png(image) for image in batch]
            values.append(
                Value(
                    tag=key,
                    metadata=_plugin_metadata("images"),
                    tensor=_string_tensor(blobs, [len(blobs)]),
                )
            )
        self._write(step, values)

    def write_videos(self, step: int, videos: Mapping[str, ArrayLike]) -> None:
        """Writes videos of shape [T, H, W, C] or [N, T, H, W, C] as animated GIFs.

        N videos are tiled into one grid. Needs Pillow; without it, logs a warning (once per
        writer) and writes nothing.
        """
        step = _as_step(step)
        try:
            import PIL.Image  # noqa: F401
        except ImportError:
            if not self._warned_no_video:
                self._warned_no_video = True
                _LOGGER.warning("write_videos needs Pillow (pip install pillow); skipping videos.")
            return
        Summary = _tbx().Summary
        values = []
        for key, value in videos.items():
            frames = _tile_videos(_videos_nthwc(key, value))
            _, height, width, channels = frames.shape
            gif = Summary.Image(
                height=height,
                width=width,
                colorspace=channels,
                encoded_image_string=_encode_gif(frames, self._video_fps),
            )
            values.append(Summary.Value(tag=key, image=gif))
        self._write(step, values)

    def write_audios(self, step: int, audios: Mapping[str, ArrayLike], *, sample_rate: int) -> None:
        """Writes audio clips, [N, T, C] (or [N, T] / [T] for mono), as 16-bit WAV.

        Float samples are taken to lie in [-1, 1] (and clipped); int16 is written as is.
        """
        step = _as_step(step)
        sample_rate = operator.index(sample_rate)
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}.")
        Value = _tbx().Summary.Value
        values = []
        for key, value in audios.items():
            clips = _audios_ntc(key, value)
            # Same layout as tf.summary.audio: [N, 2] of (wav, label), labels left empty.
            blobs = []
            for clip in clips:
                blobs += [_encode_wav(clip, sample_rate), b""]
            values.append(
                Value(
                    tag=key,
                    metadata=_plugin_metadata("audio", _AUDIO_PLUGIN_CONTENT_WAV),
                    tensor=_string_tensor(blobs, [len(clips), 2]),
                )
            )
        self._write(step, values)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        """Writes strings, shown (as Markdown) in TensorBoard's Text tab."""
        step = _as_step(step)
        Value = _tbx().Summary.Value
        values = [
            Value(
                tag=key,
                metadata=_plugin_metadata("text"),
                tensor=_string_tensor([str(text).encode("utf-8")], []),
            )
            for key, text in texts.items()
        ]
        self._write(step, values)

    def write_histograms(
        self,
        step: int,
        arrays: Mapping[str, ArrayLike],
        num_buckets: Mapping[str, int] | None = None,
    ) -> None:
        """Writes a histogram of each array's values.

        ``num_buckets`` maps keys to bucket counts (default `DEFAULT_HISTOGRAM_BUCKETS`).
        Non-finite values are left out of the histogram (with a warning), since the bucket
        range cannot include them; an array with no finite values is skipped.
        """
        step = _as_step(step)
        tbx = _tbx()
        num_buckets = num_buckets or {}
        values = []
        for key, value in arrays.items():
            flat = np.asarray(value).astype(np.float64).reshape(-1)
            finite = flat[np.isfinite(flat)]
            if finite.size < flat.size:
                _LOGGER.warning(
                    "Histogram %r at step %d: left out %d non-finite of %d values.",
                    key,
                    step,
                    flat.size - finite.size,
                    flat.size,
                )
            if finite.size == 0:
                continue
            bins = num_buckets.get(key, DEFAULT_HISTOGRAM_BUCKETS)
            histogram = tbx.make_histogram(finite, bins=bins)
            values.append(tbx.Summary.Value(tag=key, histo=histogram))
        self._write(step, values)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Writes hyperparameters for TensorBoard's HParams tab, into this writer's run.

        Nested mappings are flattened to dotted names (``{'opt': {'lr': 1e-3}}`` becomes
        ``opt.lr``). Bools, numbers and strings keep their type (numbers become floats, the
        plugin's only numeric type); anything else is written as its ``str()``. Only the
        session-start summary is written: TensorBoard infers the experiment's hparams and
        metrics from it and from the run's scalars.
        """
        tbx = _tbx()
        session = tbx.SessionStartInfo(start_time_secs=time.time())
        for name, value in _flatten_hparams(hparams).items():
            value = _hparam_value(value)
            if isinstance(value, bool):
                session.hparams[name].bool_value = value
            elif isinstance(value, float):
                session.hparams[name].number_value = value
            else:
                session.hparams[name].string_value = value
        content = tbx.HParamsPluginData(version=0, session_start_info=session)
        value = tbx.Summary.Value(
            tag="_hparams_/session_start_info",
            metadata=_plugin_metadata("hparams", content.SerializeToString()),
        )
        self._write(0, [value])

    def flush(self) -> None:
        """Writes everything buffered so far to the event file."""
        with self._lock:
            if not self._closed:
                self._flush_locked()

    def close(self) -> None:
        """Flushes and closes the event file; closing twice is fine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._events.close()


class LoggingWriter(_ContextManagerMixin):
    """Writes metrics as human-readable lines with Python `logging`.

    Scalars are logged as ``[prefix] step | key=value, ...``; for images, videos, audios and
    histograms only the shapes are logged. Records go to the ``jaxloop.writers`` logger at
    INFO unless ``logger``/``level`` say otherwise, so a logging set-up that shows INFO
    (``logging.basicConfig(level=logging.INFO)``, or absl's) is needed to see them.

    Args:
      prefix: put in brackets before every line, e.g. the collection name.
      logger: the logger to write to.
      level: the level of the records.

    Example::

        writer = LoggingWriter('train')
        writer.write_scalars(10, {'loss': 0.25})  # logs "[train] 10 | loss=0.25"
    """

    def __init__(
        self,
        prefix: str = "",
        *,
        logger: logging.Logger | None = None,
        level: int = logging.INFO,
    ) -> None:
        self._prefix = f"[{prefix}] " if prefix else ""
        self._logger = logger if logger is not None else _LOGGER
        self._level = level

    def _log(self, message: str) -> None:
        self._logger.log(self._level, "%s%s", self._prefix, message)

    def _log_shapes(self, step: int, kind: str, arrays: Mapping[str, ArrayLike]) -> None:
        if arrays:
            shapes = ", ".join(f"{key} shape={np.shape(value)}" for key, value in arrays.items())
            self._log(f"{_as_step(step)} | {kind}: {shapes}")

    def write_scalars(self, step: int, scalars: Mapping[str, ArrayLike]) -> None:
        """Logs ``step | key=value, ...``."""
        step = _as_step(step)
        scalars = _prepare_scalars(scalars)
        if scalars:
            self._log(f"{step} | " + ", ".join(f"{k}={v:.6g}" for k, v in scalars.items()))

    def write_images(self, step: int, images: Mapping[str, ArrayLike]) -> None:
        """Logs the images' shapes."""
        self._log_shapes(step, "images", images)

    def write_videos(self, step: int, videos: Mapping[str, ArrayLike]) -> None:
        """Logs the videos' shapes."""
        self._log_shapes(step, "videos", videos)

    def write_audios(self, step: int, audios: Mapping[str, ArrayLike], *, sample_rate: int) -> None:
        """Logs the audios' shapes and sample rate."""
        self._log_shapes(step, f"audios at {sample_rate} Hz", audios)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        """Logs each text."""
        step = _as_step(step)
        for key, text in texts.items():
            self._log(f"{step} | text {key}: {text}")

    def write_histograms(
        self,
        step: int,
        arrays: Mapping[str, ArrayLike],
        num_buckets: Mapping[str, int] | None = None,
    ) -> None:
        """Logs the histogrammed arrays' shapes."""
        del num_buckets
        self._log_shapes(step, "histograms", arrays)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Logs the hyperparameters, nested mappings flattened to dotted names."""
        flat = _flatten_hparams(hparams)
        self._log("hparams: " + ", ".join(f"{k}={_plain(v)!r}" for k, v in flat.items()))

    def flush(self) -> None:
        """Nothing to do: records are handed to logging as they come."""

    def close(self) -> None:
        """Nothing to do."""


class MultiWriter(_ContextManagerMixin):
    """Forwards every call to each of ``writers``, in order.

    Step and scalars are converted (and checked) once, before any writer is called, so a
    bad value never leaves one writer with the data and another without.

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

    def write_scalars(self, step: int, scalars: Mapping[str, ArrayLike]) -> None:
        step, scalars = _as_step(step), _prepare_scalars(scalars)
        for writer in self._writers:
            writer.write_scalars(step, scalars)

    def write_images(self, step: int, images: Mapping[str, ArrayLike]) -> None:
        step, images = _as_step(step), _prepare_arrays(images)
        for writer in self._writers:
            writer.write_images(step, images)

    def write_videos(self, step: int, videos: Mapping[str, ArrayLike]) -> None:
        step, videos = _as_step(step), _prepare_arrays(videos)
        for writer in self._writers:
            writer.write_videos(step, videos)

    def write_audios(self, step: int, audios: Mapping[str, ArrayLike], *, sample_rate: int) -> None:
        step, audios = _as_step(step), _prepare_arrays(audios)
        for writer in self._writers:
            writer.write_audios(step, audios, sample_rate=sample_rate)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        step = _as_step(step)
        for writer in self._writers:
            writer.write_texts(step, texts)

    def write_histograms(
        self,
        step: int,
        arrays: Mapping[str, ArrayLike],
        num_buckets: Mapping[str, int] | None = None,
    ) -> None:
        step, arrays = _as_step(step), _prepare_arrays(arrays)
        for writer in self._writers:
            writer.write_histograms(step, arrays, num_buckets)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        for writer in self._writers:
            writer.write_hparams(hparams)

    def _call_all(self, method: str) -> None:
        # Every writer gets the call even if an earlier one fails: one broken writer must
        # not keep the others' files unflushed or open. The first error is re-raised.
        errors = []
        for writer in self._writers:
            try:
                getattr(writer, method)()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def flush(self) -> None:
        self._call_all("flush")

    def close(self) -> None:
        self._call_all("close")


_CLOSE = "close"


def _async_worker(
    work: queue.Queue[tuple[str, tuple[Any, ...], dict[str, Any]]],
    writer: MetricWriter,
    errors: list[Future],
) -> None:
    # A plain function, not a bound method, so the thread holds no reference to the
    # AsyncWriter and an abandoned one can still be garbage-collected (see weakref.finalize).
    while True:
        method, args, kwargs = work.get()
        try:
            getattr(writer, method)(*args, **kwargs)
        except BaseException as e:
            _LOGGER.error(
                "AsyncWriter: %s failed; the error is re-raised on the next call.",
                method,
                exc_info=True,
            )
            # Also reported to the loop, which re-raises it at its next boundary.
            errors.append(async_action_context.get_async_action_context().add_exception(
                f"AsyncWriter({type(writer).__name__}).{method}", e))
        finally:
            work.task_done()
        if method == _CLOSE:
            return


def _stop_worker(work: queue.Queue, thread: threading.Thread) -> None:
    if threading.current_thread() is thread:
        # Garbage collection can run this finalizer on the worker itself, which can neither
        # join itself nor wait for room in its own queue; a helper thread enqueues the stop.
        threading.Thread(target=work.put, args=((_CLOSE, (), {}),), daemon=True).start()
        return
    work.put((_CLOSE, (), {}))
    thread.join()


class AsyncWriter(_ContextManagerMixin):
    """Does another writer's writing on one background thread.

    The training loop only pays for converting arguments to numpy (which for jax arrays
    waits for them to be computed and copies them to the host); encoding and file I/O
    happen on the thread. The conversion is done before a call returns, so device buffers
    that are donated or deleted afterwards are never read. Calls are written in the order
    they were made. When ``max_queue`` calls are waiting, the next call blocks until the
    thread catches up.

    An exception raised by the wrapped writer on the thread is re-raised by the next call
    to this writer (write, `flush` or `close`). An abandoned writer is closed when it is
    garbage-collected or at interpreter exit, but call `close` (or use ``with``) to see
    errors and to have the files complete when you expect them.

    Args:
      writer: the writer to call, e.g. a `SummaryWriter`, a `MultiWriter`, or a clu writer.
      max_queue: how many calls may wait for the thread.

    Example::

        with AsyncWriter(SummaryWriter('/tmp/run')) as writer:
            for step in range(1000):
                writer.write_scalars(step, {'loss': loss})  # returns without file I/O
            writer.flush()  # everything so far is on disk
    """

    def __init__(self, writer: MetricWriter, *, max_queue: int = 128) -> None:
        self._writer = writer
        self._queue: queue.Queue[tuple[str, tuple[Any, ...], dict[str, Any]]] = queue.Queue(
            maxsize=max_queue
        )
        self._errors: list[Future] = []
        self._closed = False
        self._thread = threading.Thread(
            target=_async_worker,
            args=(self._queue, writer, self._errors),
            name="jaxloop-AsyncWriter",
            daemon=True,
        )
        self._thread.start()
        self._stop = weakref.finalize(self, _stop_worker, self._queue, self._thread)

    @property
    def writer(self) -> MetricWriter:
        """The wrapped writer."""
        return self._writer

    def _raise_pending(self) -> None:
        if self._errors:
            failed = list(self._errors)
            self._errors.clear()
            # An error a loop boundary already raised is not raised again. Of the others,
            # the first is the likely cause; later ones were logged on the thread.
            context = async_action_context.get_async_action_context()
            unraised = [f for f in failed if context.discard(f)]
            if unraised:
                raise unraised[0].exception()

    def _enqueue(self, method: str, *args: Any, **kwargs: Any) -> None:
        self._raise_pending()
        if self._closed:
            raise RuntimeError(f"AsyncWriter.{method} called after close().")
        self._queue.put((method, args, kwargs))

    def write_scalars(self, step: int, scalars: Mapping[str, ArrayLike]) -> None:
        self._enqueue("write_scalars", _as_step(step), _prepare_scalars(scalars))

    def write_images(self, step: int, images: Mapping[str, ArrayLike]) -> None:
        images = {key: _snapshot(value) for key, value in images.items()}
        self._enqueue("write_images", _as_step(step), images)

    def write_videos(self, step: int, videos: Mapping[str, ArrayLike]) -> None:
        videos = {key: _snapshot(value) for key, value in videos.items()}
        self._enqueue("write_videos", _as_step(step), videos)

    def write_audios(self, step: int, audios: Mapping[str, ArrayLike], *, sample_rate: int) -> None:
        audios = {key: _snapshot(value) for key, value in audios.items()}
        self._enqueue("write_audios", _as_step(step), audios, sample_rate=sample_rate)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._enqueue("write_texts", _as_step(step), dict(texts))

    def write_histograms(
        self,
        step: int,
        arrays: Mapping[str, ArrayLike],
        num_buckets: Mapping[str, int] | None = None,
    ) -> None:
        arrays = {key: _snapshot(value) for key, value in arrays.items()}
        num_buckets = dict(num_buckets) if num_buckets is not None else None
        self._enqueue("write_histograms", _as_step(step), arrays, num_buckets)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._enqueue("write_hparams", _snapshot_tree(hparams))

    def flush(self) -> None:
        """Waits until every call so far has been written, then flushes the wrapped writer."""
        self._raise_pending()
        if self._closed:
            return
        self._queue.put(("flush", (), {}))
        self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        """Writes what is queued, closes the wrapped writer and ends the thread."""
        if not self._closed:
            self._closed = True
            self._stop()
        self._raise_pending()


def create_default_writer(
    logdir: str | os.PathLike[str] | None = None,
    *,
    just_logging: bool = False,
    asynchronous: bool = True,
    collection: str | None = None,
) -> MetricWriter:
    """The writer most training loops want; mirrors clu's function of the same name.

    Returns ``MultiWriter([LoggingWriter, SummaryWriter])``, wrapped in `AsyncWriter` when
    ``asynchronous``; or only a `LoggingWriter` when ``just_logging`` or ``logdir`` is None.

    With several JAX processes, only process 0 writes event files: elsewhere the
    `SummaryWriter` is left out (no directory or file is created) and the writer only logs.
    This calls ``jax.process_index()``, so in a multi-process job create the writer after
    ``jax.distributed.initialize()``.

    Args:
      logdir: the directory for event files, or None to only log.
      just_logging: only log, even when ``logdir`` is given.
      asynchronous: write on a background thread (see `AsyncWriter`).
      collection: write event files into ``logdir/collection`` and prefix log lines with
        ``[collection]``, e.g. ``'train'`` and ``'eval'`` to get two TensorBoard runs.

    Example::

        train_writer = create_default_writer(workdir, collection='train')
        eval_writer = create_default_writer(workdir, collection='eval')
        train_writer.write_scalars(step, {'loss': loss})
        train_writer.close(); eval_writer.close()
    """
    prefix = collection or ""
    if just_logging or logdir is None:
        return LoggingWriter(prefix)
    import jax

    writers: list[MetricWriter] = [LoggingWriter(prefix)]
    if jax.process_index() == 0:
        path = os.fspath(logdir)
        if collection:
            path = os.path.join(path, collection)
        writers.append(SummaryWriter(path))
    writer = MultiWriter(writers)
    return AsyncWriter(writer) if asynchronous else writer
