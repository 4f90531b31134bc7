"""MFU and goodput: how much of the hardware and of the wall time went into training.

MFU is model flop/s per device over the device's dense bf16 peak (`PEAK_FLOPS`); a `Recorder`
splits the wall time into `CATEGORIES` and ``other``; `StatLoop` reports both::

    recorder = goodput.Recorder()
    ckpt_start, ckpt_stop = recorder.span('checkpoint')
    train = TrainLoop(step, recorder=recorder, model_flops_per_example=3 * 2 * 784 * 256,
                      global_batch_size=128,
                      end_actions=[summary, ckpt_start, checkpoint_action, ckpt_stop])
    recorder.totals()   # the whole run: {'compile': ..., 'compute': ..., 'wall': ...}
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxloop.hooks.action import Action

__all__ = ["CATEGORIES", "PEAK_FLOPS", "Recorder", "compile_seconds", "mfu", "peak_flops",
           "resolved_peak"]

log = logging.getLogger(__name__)

# Dense bf16 peak flop/s per chip from the vendors' data sheets; the first substring of
# `jax.Device.device_kind` found wins.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756e12), ("h100", 989e12), ("h200", 989e12), ("a100", 312e12),
    # v6e and v5e may report 'TPU v6 lite' / 'TPU v5 lite'; v5p reports 'TPU v5'.
    ("tpu v6 lite", 918e12), ("tpu v6e", 918e12), ("tpu v5 lite", 197e12), ("tpu v5e", 197e12),
    ("tpu v5p", 459e12), ("tpu v5", 459e12), ("tpu v4", 275e12),
)

CATEGORIES = ("compile", "input", "compute", "checkpoint", "evaluation")
"""The measured parts of the wall time; the rest is reported as ``other``."""

_COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})
_compile_lock = threading.Lock()
_compile_total = [0.0]
_listening = [False]
_noticed: set[str] = set()  # device kinds whose unknown peak was logged


def _on_duration(event: str, duration: float, **kwargs: Any) -> None:
    if event in _COMPILE_EVENTS:
        with _compile_lock:
            _compile_total[0] += duration


def compile_seconds() -> float:
    """Seconds spent tracing, lowering and compiling JAX programs since the first call."""
    with _compile_lock:
        if not _listening[0]:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening[0] = True
        return _compile_total[0]


def peak_flops(device: jax.Device | str | None = None) -> float | None:
    """Peak dense bf16 flop/s of a device or device kind (default: the first device), or
    None when unknown: ``peak_flops('NVIDIA H100 80GB HBM3') == 9.89e14``."""
    device = jax.devices()[0] if device is None else device
    kind = (device if isinstance(device, str) else device.device_kind).lower()
    return next((flops for name, flops in PEAK_FLOPS if name in kind), None)


def resolved_peak(peak: float | None = None,
                  device: jax.Device | str | None = None) -> float | None:
    """`peak` when given, else `peak_flops(device)` (None, logged once per kind, if unknown)."""
    if peak is not None:
        return float(peak)
    kind = device if isinstance(device, str) else (device or jax.devices()[0]).device_kind
    found = peak_flops(kind)
    if found is None and kind not in _noticed:
        _noticed.add(kind)
        log.warning("No peak flop/s known for device kind %r, so MFU is not reported; give it "
                    "as StatLoop(peak_flops_per_device=...).", kind)
    return found


def mfu(flops_per_sec_per_device: float, device: jax.Device | str | None = None,
        peak: float | None = None) -> float | None:
    """Achieved flop/s per device over `peak` or the device's peak (None when unknown)."""
    peak = peak if peak is not None else peak_flops(device)
    return None if peak is None else flops_per_sec_per_device / peak


def _split(start: tuple, end: tuple) -> dict[str, float]:
    """The time between two `Recorder` snapshots per category, with ``other`` and ``wall``."""
    (t0, c0, before), (t1, c1, after) = start, end
    out = {c: after[c] - before[c] for c in CATEGORIES} | {"compile": c1 - c0, "wall": t1 - t0}
    out["other"] = out["wall"] - sum(out[c] for c in CATEGORIES)
    return out


class Recorder:
    """Accumulates where the wall time goes: compile time from JAX's events, input and
    compute from the train loop, the rest from `span` actions (less their compile time)."""

    def __init__(self) -> None:
        self._totals = dict.fromkeys(CATEGORIES, 0.0)
        self._open: dict[str, tuple] = {}
        self._created = self._window = self._snapshot()

    def _snapshot(self) -> tuple[float, float, dict[str, float]]:
        return time.perf_counter(), compile_seconds(), dict(self._totals)

    def add(self, category: str, seconds: float) -> None:
        """Adds `seconds` of wall time to `category` (one of `CATEGORIES`, not compile)."""
        if category not in CATEGORIES or category == "compile":
            raise ValueError(f"category must be one of {CATEGORIES[1:]}, got {category!r}")
        self._totals[category] += seconds

    @contextlib.contextmanager
    def measure(self, category: str) -> Iterator[None]:
        """Times a block as `category`, less any compilation inside it."""
        self.start(category)
        try:
            yield
        finally:
            self.stop(category)

    def start(self, category: str) -> None:
        """Opens a timed span, closed by `stop`."""
        self._open[category] = self._snapshot()

    def stop(self, category: str) -> None:
        """Closes the span opened by `start`; does nothing if none is open."""
        opened = self._open.pop(category, None)
        if opened is not None:
            split = _split(opened, self._snapshot())
            self.add(category, max(0.0, split["wall"] - split["compile"]))

    def span(self, category: str, interval: int = 1) -> tuple[Any, Any]:
        """Two actions, (start, stop), that time what runs between them (around a checkpoint)."""

        class _Mark(Action):
            def __init__(self, mark: Callable[[str], None]):
                super().__init__(interval)
                self._mark = mark

            def __call__(self, state: Any, outputs: Any, **kwargs: Any) -> None:
                self._mark(category)

        return _Mark(self.start), _Mark(self.stop)

    def window(self) -> dict[str, float]:
        """Seconds per category (and ``other``, ``wall``) since the last call; starts a new one."""
        start, self._window = self._window, self._snapshot()
        return _split(start, self._window)

    def totals(self) -> dict[str, float]:
        """The split of the wall time since the recorder was created (like `window`)."""
        return _split(self._created, self._snapshot())

    def train_loop(self, seconds: float, input_seconds: float, compile_secs: float) -> None:
        """Records a train loop's compute: `seconds` less input waits and compiling."""
        self.add("compute", max(0.0, seconds - input_seconds - compile_secs))
