"""Tests for jaxloop.metrics.writers: events are written for real and read back with TensorBoard."""

from __future__ import annotations

import gc
import io
import logging
import os
import re
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxloop.metrics import writers

eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
from tensorboard.backend.event_processing import plugin_event_accumulator  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def load(logdir: Path) -> eam.EventAccumulator:
    """Reads every event under ``logdir`` (size 0 = keep all, no reservoir sampling)."""
    guidance = {
        kind: 0 for kind in (eam.SCALARS, eam.IMAGES, eam.TENSORS, eam.HISTOGRAMS, eam.AUDIO)
    }
    accumulator = eam.EventAccumulator(str(logdir), size_guidance=guidance)
    accumulator.Reload()
    return accumulator


def load_plugin_data(logdir: Path) -> plugin_event_accumulator.EventAccumulator:
    """Reads ``logdir`` as TensorBoard's plugins see it: legacy image, audio and histogram
    summaries migrated to their plugins' tensors, as the dashboards receive them."""
    accumulator = plugin_event_accumulator.EventAccumulator(
        str(logdir), tensor_size_guidance={plugin_event_accumulator.TENSORS: 0})
    accumulator.Reload()
    return accumulator


def event_files(logdir: Path) -> list[Path]:
    return sorted(p for p in logdir.rglob("*") if "tfevents" in p.name)


def async_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("jaxloop-AsyncWriter")]


class Recorder:
    """A stand-in inner writer that records calls; may wait on a gate or fail on one method."""

    def __init__(self, *, gate: threading.Event | None = None, fail: str | None = None):
        self.calls: list[tuple] = []
        self.gate = gate
        self.fail = fail

    def __getattr__(self, name):
        if not name.startswith(("write_", "flush", "close")):
            raise AttributeError(name)

        def method(*args, **kwargs):
            if self.gate is not None:
                assert self.gate.wait(timeout=10)
            if name == self.fail:
                raise RuntimeError(f"boom in {name}")
            self.calls.append((name, args, kwargs))

        return method


# ----------------------------------------------------------------------------- scalars


def test_scalars_roundtrip_numbers_numpy_and_jax(tmp_path):
    with writers.SummaryWriter(tmp_path) as w:
        w.write_scalars(0, {"float": 0.5, "int": 3, "np16": np.float16(0.25)})
        w.write_scalars(
            np.int64(1),
            {
                "float": jnp.float32(1.5),
                "int": jnp.asarray([7]),  # size 1 is a scalar too
                "np16": jnp.asarray(2.5, jnp.bfloat16),
            },
        )
        w.write_scalars(jnp.int32(2), {"float": np.array([[4.0]]), "int": True, "np16": 0})

    ea = load(tmp_path)
    assert set(ea.Tags()["scalars"]) == {"float", "int", "np16"}
    got = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    assert got == {
        "float": [(0, 0.5), (1, 1.5), (2, 4.0)],
        "int": [(0, 3.0), (1, 7.0), (2, 1.0)],
        "np16": [(0, 0.25), (1, 2.5), (2, 0.0)],
    }


def test_step_must_be_an_integer(tmp_path):
    with writers.SummaryWriter(tmp_path) as w:
        with pytest.raises(TypeError, match="step must be an integer"):
            w.write_scalars(1.5, {"a": 1.0})
        with pytest.raises(TypeError, match="step must be an integer"):
            w.write_scalars(jnp.float32(2), {"a": 1.0})
        w.write_scalars(np.array([3]), {"a": 1.0})
    assert [e.step for e in load(tmp_path).Scalars("a")] == [3]


@pytest.mark.parametrize("kind", ["summary", "logging", "multi", "async"])
def test_non_scalar_value_raises_with_key_and_shape(tmp_path, kind):
    make = {
        "summary": lambda: writers.SummaryWriter(tmp_path),
        "logging": lambda: writers.LoggingWriter(),
        "multi": lambda: writers.MultiWriter([writers.SummaryWriter(tmp_path)]),
        "async": lambda: writers.AsyncWriter(writers.SummaryWriter(tmp_path)),
    }[kind]
    with make() as w:
        with pytest.raises(ValueError, match=r"'loss'.*\(2, 3\)"):
            w.write_scalars(0, {"ok": 1.0, "loss": jnp.ones((2, 3))})
        with pytest.raises(ValueError, match=r"'empty'.*\(0,\)"):
            w.write_scalars(0, {"empty": np.zeros((0,))})
    if kind != "logging":
        # Checked before anything is written: no half-written call.
        assert load(tmp_path).Tags()["scalars"] == []


# ----------------------------------------------------------------------------- images


def decode_image(acc, tag):
    """The step, (width, height) and pixels of the one image the images plugin sees."""
    from PIL import Image

    (event,) = acc.Tensors(tag)
    width, height, png = event.tensor_proto.string_val
    return event.step, (int(width), int(height)), np.asarray(Image.open(io.BytesIO(png)))


def grey_as_rgb(pixels):
    return np.repeat(np.asarray(pixels)[..., None], 3, axis=-1)


def test_images_shapes_and_pixels(tmp_path):
    rng = np.random.default_rng(0)
    gray = np.linspace(0.0, 1.0, 6 * 5).reshape(6, 5)  # [H, W] floats in [0, 1]
    rgb = rng.integers(0, 256, size=(4, 7, 3), dtype=np.uint8)  # [H, W, C] uint8
    rgba = rng.random((3, 2, 5, 4)).astype(np.float32)  # [N, H, W, C] floats
    with writers.SummaryWriter(tmp_path) as w:
        w.write_images(5, {"gray": gray, "rgb": rgb, "rgba": jnp.asarray(rgba)})
        w.write_images(6, {"clipped": np.array([[-1.0, 0.5, 2.0]])})

    acc = load_plugin_data(tmp_path)
    assert acc.SummaryMetadata("rgb").plugin_data.plugin_name == "images"

    step, size, image = decode_image(acc, "gray")  # stored as RGB
    assert step == 5 and size == (5, 6)
    np.testing.assert_array_equal(image, grey_as_rgb(np.round(gray * 255).astype(np.uint8)))

    _, size, image = decode_image(acc, "rgb")
    assert size == (7, 4)
    np.testing.assert_array_equal(image, rgb)

    # N images: one image of the N side by side (a grid of up to 8 columns).
    _, size, image = decode_image(acc, "rgba")
    assert size == (15, 2)
    expected = np.concatenate(list(np.round(rgba * 255).astype(np.uint8)), axis=1)
    np.testing.assert_array_equal(image, expected)

    step, _, image = decode_image(acc, "clipped")
    assert step == 6
    np.testing.assert_array_equal(image, grey_as_rgb([[0, 128, 255]]))


@pytest.mark.parametrize("shape", [(4, 4, 2), (2, 4, 4, 5), (4,), (1, 2, 4, 4, 3)])
def test_images_bad_shape_raises(tmp_path, shape):
    with writers.SummaryWriter(tmp_path) as w:
        with pytest.raises(ValueError, match=r"'bad'.*" + re.escape(str(shape))):
            w.write_images(0, {"bad": np.zeros(shape)})


# ----------------------------------------------------------------------------- videos


def test_videos_as_gif(tmp_path):
    from PIL import Image

    frames = np.zeros((5, 8, 6, 3), np.uint8)
    for t in range(5):
        frames[t, :, :, t % 3] = 50 * t + 40  # distinct frames, so none are merged
    with writers.SummaryWriter(tmp_path) as w:
        w.write_videos(2, {"single": frames})
        w.write_videos(3, {"batch": np.stack([frames, frames, frames]) / 255.0})
        w.write_videos(3, {"grey_alpha": np.zeros((2, 4, 4, 1)), "rgba": np.ones((2, 4, 4, 4))})

    ea = load(tmp_path)
    (event,) = ea.Images("single")
    gif = Image.open(io.BytesIO(event.encoded_image_string))
    assert (event.step, gif.format, gif.n_frames, gif.size) == (2, "GIF", 5, (6, 8))
    gif.seek(3)
    np.testing.assert_allclose(np.asarray(gif.convert("RGB")), frames[3], atol=2)
    (event,) = ea.Images("batch")
    # Three videos tiled into one (tensorboardX's grid: a row of 4 places).
    assert (event.height, event.width) == (8, 24)
    assert Image.open(io.BytesIO(event.encoded_image_string)).n_frames == 5
    assert {"grey_alpha", "rgba"} <= set(ea.Tags()["images"])


@pytest.mark.parametrize("shape", [(4, 4, 3), (2, 4, 4, 2), (1, 1, 2, 4, 4, 3)])
def test_videos_bad_shape_raises(tmp_path, shape):
    with writers.SummaryWriter(tmp_path) as w:
        with pytest.raises(ValueError, match=r"Video 'bad'.*" + re.escape(str(shape))):
            w.write_videos(0, {"bad": np.zeros(shape)})


def test_videos_without_moviepy_warn_once_and_skip(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "moviepy", None)  # makes `import moviepy` fail
    with writers.SummaryWriter(tmp_path) as w:
        with caplog.at_level(logging.WARNING, logger="jaxloop.metrics.writers"):
            w.write_videos(0, {"v": np.zeros((2, 4, 4, 3))})
            w.write_videos(1, {"v": np.zeros((2, 4, 4, 3))})
        w.write_scalars(1, {"still_works": 1.0})
    assert [r.message for r in caplog.records].count(
        "SummaryWriter: videos need moviepy (pip install jaxloop[video]); skipping."
    ) == 1
    ea = load(tmp_path)
    assert ea.Tags()["images"] == [] and ea.Tags()["scalars"] == ["still_works"]


# ----------------------------------------------------------------------------- audio


def read_wav(acc, tag):
    """The step, channels, rate and samples (scaled to [-1, 1]) of a clip the audio plugin
    sees."""
    (event,) = acc.Tensors(tag)
    with wave.open(io.BytesIO(event.tensor_proto.string_val[0])) as wav:
        channels, rate, frames = wav.getnchannels(), wav.getframerate(), wav.getnframes()
        pcm = np.frombuffer(wav.readframes(frames), "<i2").reshape(frames, channels)
    return event.step, channels, rate, pcm


def test_audios_as_wav(tmp_path):
    from tensorboard.plugins.audio import plugin_data_pb2

    t = np.arange(800) / 8000
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.cos(2 * np.pi * 220 * t)], -1)
    pcm16 = np.array([-32768, -1, 0, 1, 32767], np.int16)
    with writers.SummaryWriter(tmp_path) as w:
        w.write_audios(4, {"clips": np.stack([stereo, -stereo])}, sample_rate=8000)  # [N, T, C]
        w.write_audios(4, {"mono": jnp.asarray(t)}, sample_rate=16000)  # [T]
        w.write_audios(5, {"int16": pcm16[None]}, sample_rate=8000)  # [N, T]

    acc = load_plugin_data(tmp_path)
    content = acc.SummaryMetadata("clips/0").plugin_data.content
    assert (
        plugin_data_pb2.AudioPluginData.FromString(content).encoding
        == plugin_data_pb2.AudioPluginData.WAV
    )
    # N clips of one key: one tag each.
    for tag, expected in [("clips/0", stereo), ("clips/1", -stereo)]:
        step, channels, rate, pcm = read_wav(acc, tag)
        assert (step, channels, rate, len(pcm)) == (4, 2, 8000, 800)
        np.testing.assert_allclose(pcm / 32767, expected, atol=1e-4)
    assert read_wav(acc, "mono")[1:3] == (1, 16000)
    np.testing.assert_array_equal(read_wav(acc, "int16")[3][:, 0], pcm16)


@pytest.mark.parametrize("shape", [(2, 10, 3), (1, 1, 10, 1)])
def test_audios_bad_shape_raises(tmp_path, shape):
    with writers.SummaryWriter(tmp_path) as w:
        with pytest.raises(ValueError, match=r"Audio 'bad'.*" + re.escape(str(shape))):
            w.write_audios(0, {"bad": np.zeros(shape)}, sample_rate=8000)
        with pytest.raises(ValueError, match="sample_rate must be positive"):
            w.write_audios(0, {"ok": np.zeros(4)}, sample_rate=0)


# ----------------------------------------------------------------------------- text


def test_texts(tmp_path):
    with writers.SummaryWriter(tmp_path) as w:
        w.write_texts(3, {"notes": "hello **world**", "unicode": "héllo ✓"})
        w.write_texts(4, {"notes": "again"})

    ea = load(tmp_path)
    # tensorboardX's add_text names the tag key/text_summary.
    assert ea.SummaryMetadata("notes/text_summary").plugin_data.plugin_name == "text"
    notes = ea.Tensors("notes/text_summary")
    assert [(e.step, e.tensor_proto.string_val[0].decode()) for e in notes] == [
        (3, "hello **world**"), (4, "again")]
    unicode = ea.Tensors("unicode/text_summary")
    assert unicode[0].tensor_proto.string_val[0].decode() == "héllo ✓"


# ----------------------------------------------------------------------------- histograms


def test_histograms(tmp_path):
    values = np.arange(100, dtype=np.float32)
    with writers.SummaryWriter(tmp_path) as w:
        w.write_histograms(7, {"ten": values, "default": jnp.asarray(values)}, {"ten": 10})
        w.write_histograms(8, {"nonfinite": np.array([1.0, np.nan, 2.0, np.inf])})
        w.write_histograms(8, {"all_nan": np.full(3, np.nan)})

    ea = load(tmp_path)
    assert set(ea.Tags()["histograms"]) == {"ten", "default", "nonfinite"}
    (event,) = ea.Histograms("ten")
    h = event.histogram_value
    assert event.step == 7
    assert (h.min, h.max, h.num, h.sum) == (0.0, 99.0, 100.0, 4950.0)
    assert sum(h.bucket) == 100
    assert len([c for c in h.bucket if c]) == 10
    assert h.bucket_limit[-1] == 99.0
    h = ea.Histograms("default")[0].histogram_value
    assert sum(h.bucket) == 100 and len(h.bucket) <= writers.DEFAULT_HISTOGRAM_BUCKETS + 1
    h = ea.Histograms("nonfinite")[0].histogram_value
    assert (h.num, h.min, h.max) == (2.0, 1.0, 2.0)


# ----------------------------------------------------------------------------- hparams


def test_hparams_in_the_writers_run(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    with writers.SummaryWriter(tmp_path) as w:
        w.write_hparams(
            {
                "lr": 0.1,
                "batch_size": np.int64(32),
                "opt": "adam",
                "use_bn": True,
                "model": {"depth": 4, "width": jnp.float32(1.5)},
                "schedule": [1, 2],
                "none": None,
            }
        )
        w.write_scalars(0, {"loss": 1.0})

    # In the run itself, beside its scalars: no sub-run folder per call.
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]
    assert load(tmp_path).Scalars("loss")[0].value == 1.0
    contents = load(tmp_path).PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in contents
    data = plugin_data_pb2.HParamsPluginData.FromString(contents["_hparams_/session_start_info"])
    hp = data.session_start_info.hparams
    assert hp["lr"].number_value == pytest.approx(0.1)
    assert hp["batch_size"].number_value == 32.0
    assert hp["opt"].string_value == "adam"
    assert hp["use_bn"].bool_value is True
    assert hp["model.depth"].number_value == 4.0
    assert hp["model.width"].number_value == 1.5
    assert hp["schedule"].string_value == "[1, 2]"
    assert hp["none"].string_value == "None"


# ----------------------------------------------------------------------------- SummaryWriter


def test_summary_writer_creates_logdir_closes_once_and_rejects_late_writes(tmp_path):
    logdir = tmp_path / "a" / "b"
    w = writers.SummaryWriter(str(logdir))
    assert logdir.is_dir() and w.logdir == str(logdir)
    for step in range(20):
        w.write_scalars(step, {"x": float(step)})
        w.flush()
        # Readable after each flush, in order, all in one file.
        assert [(e.step, e.value) for e in load(logdir).Scalars("x")] == [
            (s, float(s)) for s in range(step + 1)]
    w.close()
    w.close()
    w.flush()
    with pytest.raises(RuntimeError, match="closed"):
        w.write_scalars(1, {"x": 2.0})
    assert [e.step for e in load(logdir).Scalars("x")] == list(range(20))
    assert len(event_files(logdir)) == 1


def test_train_loops_flushing_each_call_write_one_event_file(tmp_path):
    """A SummaryAction with flush_each_call=True on a train loop called several times
    (a notebook running cells) writes every loop's scalars into one event file, each
    readable as soon as its loop returns."""
    import jax
    import optax
    from models import ClassifierStep, LinenMLP, toy_data

    from jaxloop import actions, train_loop

    data = toy_data(64)
    batches = [{k: v[i:i + 16] for k, v in data.items()} for i in range(0, 64, 16)]
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    writer = writers.SummaryWriter(tmp_path)
    loop = train_loop.TrainLoop(
        step, end_actions=[actions.SummaryAction(writer, flush_each_call=True)])
    state = step.initialize_model([1, 16])
    for cell in range(3):
        state, _ = loop(state, iter(batches), num_steps=4)
        assert [e.step for e in load(tmp_path).Scalars("loss")] == list(range(1, 4 * cell + 5))
    writer.close()
    assert len(event_files(tmp_path)) == 1
    assert [e.step for e in load(tmp_path).Scalars("loss")] == list(range(1, 13))


def test_two_writers_in_one_logdir_get_separate_files(tmp_path):
    with writers.SummaryWriter(tmp_path) as a, writers.SummaryWriter(tmp_path) as b:
        a.write_scalars(0, {"a": 1.0})
        b.write_scalars(1, {"b": 2.0})
    assert len(event_files(tmp_path)) == 2
    ea = load(tmp_path)
    assert ea.Scalars("a")[0].value == 1.0 and ea.Scalars("b")[0].value == 2.0


def test_epath_logdir(tmp_path):
    from etils import epath

    with writers.SummaryWriter(epath.Path(tmp_path) / "run") as w:
        w.write_scalars(0, {"x": 1.0})
    assert load(tmp_path / "run").Scalars("x")[0].value == 1.0


def test_writers_satisfy_the_protocol(tmp_path):
    with writers.SummaryWriter(tmp_path) as summary:
        for w in [
            summary,
            writers.LoggingWriter(),
            writers.MultiWriter([]),
            writers.AsyncWriter(writers.LoggingWriter()),
        ]:
            assert isinstance(w, writers.MetricWriter)
            w.close()


# ----------------------------------------------------------------------------- LoggingWriter


def test_logging_writer_lines(caplog):
    w = writers.LoggingWriter("train")
    with caplog.at_level(logging.INFO, logger="jaxloop.metrics.writers"):
        w.write_scalars(np.int32(10), {"loss": jnp.float32(0.25), "acc": 1})
        w.write_images(10, {"img": jnp.zeros((2, 8, 8, 3))})
        w.write_histograms(10, {"w": np.zeros((3, 4))})
        w.write_audios(10, {"au": np.zeros((1, 5, 1))}, sample_rate=8000)
        w.write_videos(10, {"v": np.zeros((4, 2, 2, 3))})
        w.write_texts(10, {"note": "hi"})
        w.write_hparams({"lr": np.float32(0.5), "model": {"depth": 2}})
        w.write_scalars(11, {})
        w.flush()
        w.close()
    assert caplog.messages == [
        "[train] 10 | loss=0.25, acc=1",
        "[train] 10 | images: img shape=(2, 8, 8, 3)",
        "[train] 10 | histograms: w shape=(3, 4)",
        "[train] 10 | audios at 8000 Hz: au shape=(1, 5, 1)",
        "[train] 10 | videos: v shape=(4, 2, 2, 3)",
        "[train] 10 | text note: hi",
        "[train] hparams: lr=0.5, model.depth=2",
    ]


def test_logging_writer_custom_logger_and_no_prefix(caplog):
    custom = logging.getLogger("my.metrics")
    w = writers.LoggingWriter(logger=custom, level=logging.WARNING)
    with caplog.at_level(logging.WARNING, logger="my.metrics"):
        w.write_scalars(1, {"x": 1e-7})
    assert [(r.name, r.levelno, r.message) for r in caplog.records] == [
        ("my.metrics", logging.WARNING, "1 | x=1e-07")
    ]


# ----------------------------------------------------------------------------- MultiWriter


def test_multi_writer_forwards_to_every_writer(tmp_path, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    recorder = Recorder()
    w = writers.MultiWriter(
        [writers.SummaryWriter(a), writers.SummaryWriter(b), writers.LoggingWriter(), recorder]
    )
    with caplog.at_level(logging.INFO, logger="jaxloop.metrics.writers"), w:
        w.write_scalars(jnp.int32(1), {"loss": jnp.float32(0.5)})
        w.write_texts(1, {"t": "x"})
        w.write_images(1, {"i": jnp.zeros((2, 2))})
        w.write_histograms(1, {"h": jnp.arange(4.0)}, {"h": 2})
        w.write_audios(1, {"a": np.zeros(10)}, sample_rate=100)
        w.write_videos(1, {"v": np.zeros((2, 2, 2, 1))})
        w.write_hparams({"lr": 0.1})
        w.flush()
    for logdir in (a, b):
        ea = load(logdir)
        assert [(e.step, e.value) for e in ea.Scalars("loss")] == [(1, 0.5)]
        assert ea.Tensors("t/text_summary")[0].tensor_proto.string_val == [b"x"]
        assert ea.Histograms("h")[0].histogram_value.num == 4
    assert "1 | loss=0.5" in caplog.messages
    # Arguments were converted once: the other writers got an int step and numpy arrays.
    assert [c[0] for c in recorder.calls] == [
        "write_scalars",
        "write_texts",
        "write_images",
        "write_histograms",
        "write_audios",
        "write_videos",
        "write_hparams",
        "flush",
        "close",
    ]
    assert recorder.calls[0][1] == (1, {"loss": 0.5})
    assert type(recorder.calls[0][1][0]) is int
    assert type(recorder.calls[2][1][1]["i"]) is np.ndarray
    assert recorder.calls[4][2] == {"sample_rate": 100}


def test_multi_writer_calls_every_writer_even_if_one_fails(tmp_path):
    summary = writers.SummaryWriter(tmp_path)
    w = writers.MultiWriter([Recorder(fail="write_scalars"), summary])
    with pytest.raises(RuntimeError, match="boom in write_scalars"):
        w.write_scalars(0, {"x": 1.0})
    w = writers.MultiWriter([Recorder(fail="close"), summary])
    with pytest.raises(RuntimeError, match="boom in close"):
        w.close()
    with pytest.raises(RuntimeError, match="closed"):
        summary.write_scalars(1, {"x": 2.0})
    assert [e.value for e in load(tmp_path).Scalars("x")] == [1.0]


# ----------------------------------------------------------------------------- AsyncWriter


def test_async_writer_keeps_order_and_flush_waits(tmp_path):
    before = async_threads()
    w = writers.AsyncWriter(writers.SummaryWriter(tmp_path), max_queue=4)
    for step in range(50):  # more than max_queue: put blocks, nothing is dropped
        w.write_scalars(step, {"x": jnp.float32(step) / 2})
    w.write_texts(50, {"t": "done"})
    w.flush()
    ea = load(tmp_path)
    assert [(e.step, e.value) for e in ea.Scalars("x")] == [(s, s / 2) for s in range(50)]
    assert ea.Tensors("t/text_summary")[0].step == 50

    w.write_scalars(51, {"x": 0.0})
    w.close()
    assert [e.step for e in load(tmp_path).Scalars("x")][-1] == 51
    assert async_threads() == before


def test_async_writer_flush_waits_for_slow_writes():
    gate = threading.Event()
    recorder = Recorder(gate=gate)
    w = writers.AsyncWriter(recorder)
    for step in range(3):
        w.write_scalars(step, {"x": step})
    assert recorder.calls == []  # the thread is held at the gate; calls returned anyway

    flushed = threading.Event()
    flusher = threading.Thread(target=lambda: (w.flush(), flushed.set()))
    flusher.start()
    assert not flushed.wait(timeout=0.2)  # flush is waiting for the queued writes
    gate.set()
    flusher.join(timeout=10)
    assert flushed.is_set()
    assert recorder.calls == [
        ("write_scalars", (0, {"x": 0.0}), {}),
        ("write_scalars", (1, {"x": 1.0}), {}),
        ("write_scalars", (2, {"x": 2.0}), {}),
        ("flush", (), {}),
    ]
    w.close()
    assert recorder.calls[-1] == ("close", (), {})


def test_async_writer_converts_arguments_before_returning():
    gate = threading.Event()
    recorder = Recorder(gate=gate)
    w = writers.AsyncWriter(recorder)
    device = jnp.arange(6.0).reshape(2, 3)
    host = np.ones((2, 2), np.float32)
    nested = {"lr": jnp.float32(0.5)}
    w.write_images(0, {"device": device, "host": host})
    w.write_histograms(0, {"device": device}, {"device": 3})
    w.write_hparams({"opt": nested})
    device.delete()  # as if donated: the writer must not read it any more
    host[:] = 0  # the caller reuses its buffer
    nested["lr"] = 99
    gate.set()
    w.close()

    (_, (_, images), _), (_, (_, arrays, buckets), _) = recorder.calls[:2]
    np.testing.assert_array_equal(images["device"], np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(images["host"], np.ones((2, 2)))
    np.testing.assert_array_equal(arrays["device"], np.arange(6.0).reshape(2, 3))
    assert buckets == {"device": 3}
    assert float(recorder.calls[2][1][0]["opt"]["lr"]) == 0.5


def test_async_writer_reraises_background_error_on_next_call():
    before = async_threads()
    recorder = Recorder(fail="write_texts")
    w = writers.AsyncWriter(recorder)
    w.write_texts(0, {"t": "x"})  # fails later, on the thread
    with pytest.raises(RuntimeError, match="boom in write_texts"):
        w.flush()
    w.write_scalars(1, {"x": 1.0})  # the error was reported once; the writer goes on
    w.flush()
    assert ("write_scalars", (1, {"x": 1.0}), {}) in recorder.calls

    w.write_texts(2, {"t": "y"})
    deadline = time.monotonic() + 10
    while not w._failed and time.monotonic() < deadline:  # the failure happens on the thread
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="boom in write_texts"):
        w.write_scalars(3, {"x": 3.0})
    w.close()
    assert async_threads() == before


def test_async_writer_error_in_close_is_raised_and_thread_ends():
    before = async_threads()
    w = writers.AsyncWriter(Recorder(fail="close"))
    w.write_scalars(0, {"x": 1.0})
    with pytest.raises(RuntimeError, match="boom in close"):
        w.close()
    assert async_threads() == before
    w.close()  # closing again is fine
    w.flush()
    with pytest.raises(RuntimeError, match="after close"):
        w.write_scalars(1, {"x": 1.0})


def test_async_writer_context_manager_leaves_no_thread(tmp_path):
    before = async_threads()
    with writers.AsyncWriter(writers.SummaryWriter(tmp_path)) as w:
        assert len(async_threads()) == len(before) + 1
        w.write_scalars(0, {"x": 1.0})
    assert async_threads() == before
    assert [e.value for e in load(tmp_path).Scalars("x")] == [1.0]


def test_abandoned_async_writer_is_closed_when_collected(tmp_path):
    before = async_threads()
    w = writers.AsyncWriter(writers.SummaryWriter(tmp_path))
    w.write_scalars(0, {"x": 1.0})
    (thread,) = [t for t in async_threads() if t not in before]
    del w
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert [e.value for e in load(tmp_path).Scalars("x")] == [1.0]


# ------------------------------------------------------------------ create_default_writer


def test_create_default_writer_async_with_collection(tmp_path, caplog):
    w = writers.create_default_writer(tmp_path, collection="train")
    assert isinstance(w, writers.AsyncWriter)
    with caplog.at_level(logging.INFO, logger="jaxloop.metrics.writers"):
        w.write_scalars(3, {"loss": 0.5})
        w.close()
    assert [(e.step, e.value) for e in load(tmp_path / "train").Scalars("loss")] == [(3, 0.5)]
    assert "[train] 3 | loss=0.5" in caplog.messages


def test_create_default_writer_sync(tmp_path):
    w = writers.create_default_writer(str(tmp_path), asynchronous=False)
    assert isinstance(w, writers.MultiWriter)
    kinds = [type(x) for x in w.writers]
    assert kinds == [writers.LoggingWriter, writers.SummaryWriter]
    w.write_scalars(0, {"x": 1.0})
    w.close()
    assert load(tmp_path).Scalars("x")[0].value == 1.0


def test_create_default_writer_just_logging(tmp_path):
    assert isinstance(writers.create_default_writer(None), writers.LoggingWriter)
    w = writers.create_default_writer(tmp_path / "unused", just_logging=True)
    assert isinstance(w, writers.LoggingWriter)
    w.close()
    assert not (tmp_path / "unused").exists()


# ----------------------------------------------------------------------------- no TensorFlow


@pytest.mark.slow
def test_import_and_writing_do_not_import_tensorflow(tmp_path):
    code = (
        "import sys, numpy as np\n"
        "import jaxloop.metrics.writers as w\n"
        "assert 'tensorflow' not in sys.modules, 'import'\n"
        "x = w.create_default_writer(sys.argv[1], collection='c')\n"
        "x.write_scalars(0, {'a': 1.0})\n"
        "x.write_images(0, {'i': np.zeros((2, 2, 3))})\n"
        "x.write_histograms(0, {'h': np.arange(3)})\n"
        "x.write_texts(0, {'t': 's'})\n"
        "x.write_audios(0, {'a': np.zeros(4)}, sample_rate=10)\n"
        "x.write_hparams({'lr': 0.1})\n"
        "x.close()\n"
        "assert 'tensorflow' not in sys.modules, 'writing'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # One file, in the run's folder: the hparams too (no sub-run folder).
    assert [p.parent for p in event_files(tmp_path / "c")] == [tmp_path / "c"]


# ----------------------------------------------------------------------------- clu interop


@pytest.mark.tf
def test_wraps_clu_writers(tmp_path):
    """clu's writers work inside jaxloop's MultiWriter/AsyncWriter (duck-typed)."""
    from clu import metric_writers

    shared = set(dir(writers.SummaryWriter)) & set(metric_writers.MetricWriter.__abstractmethods__)
    assert shared >= {"write_scalars", "write_images", "write_texts", "write_hparams", "flush"}

    w = writers.AsyncWriter(
        writers.MultiWriter(
            [metric_writers.SummaryWriter(str(tmp_path / "clu")), writers.SummaryWriter(tmp_path)]
        )
    )
    w.write_scalars(jnp.int32(2), {"loss": jnp.float32(0.5)})
    w.write_images(2, {"img": jnp.zeros((1, 4, 4, 3))})
    w.write_hparams({"lr": 0.1})
    w.close()
    clu_events = load(tmp_path / "clu")
    (event,) = clu_events.Tensors("loss")
    assert event.step == 2
    assert load(tmp_path).Scalars("loss")[0].value == 0.5
