"""Metric writers with clu's ``MetricWriter`` methods that write TensorBoard event files
with tensorboardX, without TensorFlow (which ``clu.metric_writers`` imports). Example::

    writer = writers.create_default_writer(workdir / 'tb', collection='train')
    writer.write_scalars(100, {'loss': 0.25})
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jaxloop import async_action_context
from jaxloop.metrics import writer_values as values

__all__ = ["AsyncWriter", "LoggingWriter", "MetricWriter", "MultiWriter", "SummaryWriter",
           "create_default_writer"]

_LOGGER = logging.getLogger(__name__)

DEFAULT_HISTOGRAM_BUCKETS = 30  # tf.summary.histogram's default


@runtime_checkable
class MetricWriter(Protocol):
    """clu's ``MetricWriter`` methods, which jaxloop's and clu's writers have."""

    def write_scalars(self, step: int, scalars: values.Arrays) -> None: ...
    def write_images(self, step: int, images: values.Arrays) -> None: ...
    def write_videos(self, step: int, videos: values.Arrays) -> None: ...
    def write_audios(self, step: int, audios: values.Arrays, *, sample_rate: int) -> None: ...
    def write_texts(self, step: int, texts: Mapping[str, str]) -> None: ...
    def write_histograms(self, step: int, arrays: values.Arrays,
                         num_buckets: Mapping[str, int] | None = None) -> None: ...
    def write_hparams(self, hparams: Mapping[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


_EVENT_FILES = itertools.count()


class SummaryWriter(values.Closing):
    """Writes TensorBoard event files into ``logdir`` (a path or a ``gs://`` URL) on the
    calling thread (see `AsyncWriter`); N images or videos of a key are tiled into one PNG
    or GIF (videos need moviepy). A write `flush_secs` after the last flush flushes."""

    def __init__(self, logdir: str | os.PathLike[str], *, flush_secs: float = 120.0,
                 video_fps: float = 4.0) -> None:
        self.logdir = os.fspath(logdir)
        self._flush_secs, self._video_fps = flush_secs, video_fps
        self._lock, self._closed = threading.Lock(), False
        from tensorboardX.event_file_writer import EventsWriter
        if "://" not in self.logdir:  # buckets have no directories
            os.makedirs(self.logdir, exist_ok=True)
        # Files are named by the second; the pid and a counter keep two of one second apart.
        suffix = f".{os.getpid()}.{next(_EVENT_FILES):06d}"
        self._events = EventsWriter(os.path.join(self.logdir, "events"), suffix)
        # Closes the file once: at `close`, or when the writer is collected or Python exits.
        self._close_events = weakref.finalize(self, self._events.close)
        self._flushed_at = time.monotonic()

    def _add(self, encode: str, step: int, tagged: Mapping[str, Any], **kwargs: Any) -> None:
        import tensorboardX.summary
        encoder = getattr(tensorboardX.summary, encode)
        self._append([encoder(tag, value, **kwargs) for tag, value in tagged.items()], step)

    def _append(self, summaries: Sequence[Any], step: int) -> None:
        from tensorboardX.proto.event_pb2 import Event
        with self._lock:
            if self._closed:
                raise RuntimeError(f"SummaryWriter for {self.logdir!r} is closed.")
            for summary in summaries:
                self._events.write_event(Event(summary=summary, wall_time=time.time(), step=step))
            if time.monotonic() - self._flushed_at >= self._flush_secs:
                self._flush()

    def write_scalars(self, step: int, scalars: values.Arrays) -> None:
        self._add("scalar", values.as_step(step), values.prepare_scalars(scalars))

    def write_images(self, step: int, images: values.Arrays) -> None:
        """Images of shape [H, W], [H, W, C] or [N, H, W, C], C in 1/3/4."""
        self._add("image", values.as_step(step), {key: values.pixels("Image", key, value)
                                            for key, value in images.items()}, dataformats="NHWC")

    def write_videos(self, step: int, videos: values.Arrays) -> None:
        """Videos of shape [T, H, W, C] or [N, T, H, W, C], as animated GIFs."""
        step = values.as_step(step)
        batches = {k: values.pixels("Video", k, v)[..., :3] for k, v in videos.items()}
        if batches and values.has_moviepy(self):
            self._add("video", step, batches, fps=self._video_fps, dataformats="NTHWC")

    def write_audios(self, step: int, audios: values.Arrays, *, sample_rate: int) -> None:
        """Clips of shape [N, T, C], [N, T] or [T], as 16-bit WAV: floats in [-1, 1] or int16."""
        step, sample_rate = values.as_step(step), operator.index(sample_rate)
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}.")
        clips = {}
        for key, value in audios.items():
            batch = values.audios_ntc(key, value)
            clips.update({key if len(batch) == 1 else f"{key}/{i}": c for i, c in enumerate(batch)})
        self._add("audio", step, clips, sample_rate=sample_rate)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        """Strings, shown as Markdown in the Text tab."""
        self._add("text", values.as_step(step), {key: str(text) for key, text in texts.items()})

    def write_histograms(self, step: int, arrays: values.Arrays,
                         num_buckets: Mapping[str, int] | None = None) -> None:
        """``num_buckets[key]`` buckets; non-finite values are left out with a warning."""
        step, buckets = values.as_step(step), num_buckets or {}
        for key, value in arrays.items():
            flat = np.asarray(value, np.float64).reshape(-1)
            finite = flat[np.isfinite(flat)]
            if finite.size < flat.size:
                _LOGGER.warning("Histogram %r at step %d: left out %d non-finite of %d "
                                "values.", key, step, flat.size - finite.size, flat.size)
            if finite.size:
                self._add("histogram", step, {key: finite},
                          bins=buckets.get(key, DEFAULT_HISTOGRAM_BUCKETS))

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Nested mappings become dotted names (``opt.lr``), other values than bools, numbers
        and strings their ``str()``; into this writer's run (not a sub-run per call, as
        tensorboardX's add_hparams does), which a resumed run appends to."""
        import tensorboardX.summary
        flat = {key: values.hparam_value(v) for key, v in values.flatten_hparams(hparams).items()}
        # Step 0 is no step: proto3 does not write a zero.
        self._append(tensorboardX.summary.hparams(flat, {}), 0)

    def _flush(self) -> None:
        self._events.flush()
        self._flushed_at = time.monotonic()

    def flush(self) -> None:
        """Makes everything written so far readable; later writes go to the same file."""
        with self._lock:
            if not self._closed:
                self._flush()

    def close(self) -> None:
        with self._lock:
            self._close_events()
            self._closed = True


class _Forwarder(values.Closing):
    """Checks and converts a call's arguments once, then hands the call to `_forward`."""

    _to_host: Any = staticmethod(np.asarray)  # what array values are passed on as
    _forward: Any  # (method name, *args, **kwargs) -> None

    def _arrays(self, arrays: values.Arrays) -> dict[str, Any]:
        return {key: self._to_host(value) for key, value in arrays.items()}

    def write_scalars(self, step: int, scalars: values.Arrays) -> None:
        self._forward("write_scalars", values.as_step(step), values.prepare_scalars(scalars))

    def write_images(self, step: int, images: values.Arrays) -> None:
        self._forward("write_images", values.as_step(step), self._arrays(images))

    def write_videos(self, step: int, videos: values.Arrays) -> None:
        self._forward("write_videos", values.as_step(step), self._arrays(videos))

    def write_audios(self, step: int, audios: values.Arrays, *, sample_rate: int) -> None:
        self._forward("write_audios", values.as_step(step), self._arrays(audios),
                      sample_rate=sample_rate)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        self._forward("write_texts", values.as_step(step), dict(texts))

    def write_histograms(self, step: int, arrays: values.Arrays,
                         num_buckets: Mapping[str, int] | None = None) -> None:
        buckets = dict(num_buckets) if num_buckets is not None else None
        self._forward("write_histograms", values.as_step(step), self._arrays(arrays), buckets)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._forward("write_hparams", values.snapshot_tree(hparams))

    def flush(self) -> None:
        self._forward("flush")

    def close(self) -> None:
        self._forward("close")


class LoggingWriter(_Forwarder):
    """Logs ``[prefix] step | key=value, ...`` for scalars, only the shapes of arrays, to
    the ``jaxloop.metrics.writers`` logger::

        writer = LoggingWriter('eval')   # INFO:jaxloop.metrics.writers:[eval] 400 | accuracy=0.97
        writer.write_scalars(400, {'accuracy': 0.97})
    """

    _to_host = staticmethod(lambda value: value)  # only shapes are logged: no device copy

    def __init__(self, prefix: str = "", *, logger: logging.Logger | None = None,
                 level: int = logging.INFO) -> None:
        self._prefix = f"[{prefix}] " if prefix else ""
        self._logger, self._level = logger if logger is not None else _LOGGER, level

    def _log(self, message: str) -> None:
        self._logger.log(self._level, "%s%s", self._prefix, message)

    def _forward(self, method: str, *args: Any, **kwargs: Any) -> None:
        if method == "write_hparams":
            plain = {k: np.asarray(v).item() if values.is_array(v) and np.ndim(v) == 0 else v
                     for k, v in values.flatten_hparams(args[0]).items()}
            self._log("hparams: " + ", ".join(f"{k}={v!r}" for k, v in plain.items()))
        elif method == "write_texts":
            for key, text in args[1].items():
                self._log(f"{args[0]} | text {key}: {text}")
        elif method == "write_scalars" and args[1]:
            step, scalars = args
            self._log(f"{step} | " + ", ".join(f"{k}={v:.6g}" for k, v in scalars.items()))
        elif method not in ("write_scalars", "flush", "close") and args[1]:
            step, arrays = args[:2]
            kind = method.removeprefix("write_")
            if "sample_rate" in kwargs:
                kind += f" at {kwargs['sample_rate']} Hz"
            shapes = ", ".join(f"{key} shape={np.shape(value)}" for key, value in arrays.items())
            self._log(f"{step} | {kind}: {shapes}")


class MultiWriter(_Forwarder):
    """Forwards every call to each of ``writers``, in order, arguments checked once before
    any writer is called; the first writer's error is raised after all were called."""

    def __init__(self, writers: Sequence[MetricWriter]) -> None:
        self.writers = tuple(writers)

    def _forward(self, method: str, *args: Any, **kwargs: Any) -> None:
        errors = []
        for writer in self.writers:
            try:
                getattr(writer, method)(*args, **kwargs)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]


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
    # Collected unclosed (maybe on its own thread, which must not wait for itself), or exit.
    try:
        pool.submit(close)
    except RuntimeError:
        close()
    pool.shutdown(wait=False)


class AsyncWriter(_Forwarder):
    """Does another writer's writing on one background thread, in the order of the calls: a
    call returns once its arguments are host copies (it blocks while ``max_queue`` wait), and
    the writer's error is raised by the next call or at the next loop boundary."""

    _to_host = staticmethod(values.snapshot)

    def __init__(self, writer: MetricWriter, *, max_queue: int = 128) -> None:
        self.writer, self._closed = writer, False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxloop-AsyncWriter")
        self._room = threading.Semaphore(max_queue)
        self._failed: list[Future] = []
        # Starts the thread now, not inside the first write (which would wait for it).
        self._pool.submit(int)
        # Holds the pool and the writer, never self, so an abandoned writer is collected.
        self._abandoned = weakref.finalize(self, _close_abandoned, self._pool, writer.close)

    def _submit(self, method: str, *args: Any, **kwargs: Any) -> Future:
        self._room.acquire()
        return self._pool.submit(_call, self.writer, method, args, kwargs, self._failed,
                                 self._room)

    def _raise_pending(self) -> None:
        failed = [self._failed.pop(0) for _ in range(len(self._failed))]
        # Not those a loop boundary already raised; the first is the likely cause.
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
    """As clu's: ``MultiWriter([LoggingWriter, SummaryWriter])`` (the latter on process 0 only),
    in an `AsyncWriter` when ``asynchronous``; a `LoggingWriter` alone without ``logdir``.
    ``collection`` (``'train'``) names a sub-directory and prefixes log lines."""
    prefix = collection or ""
    if just_logging or logdir is None:
        return LoggingWriter(prefix)
    import jax
    writers: list[MetricWriter] = [LoggingWriter(prefix)]
    if jax.process_index() == 0:
        writers.append(SummaryWriter(os.path.join(logdir, collection) if collection else logdir))
    writer = MultiWriter(writers)
    return AsyncWriter(writer) if asynchronous else writer
