"""MFU and goodput: how much of the hardware and of the wall time went into training.

* **MFU** (model-flops utilisation): achieved model flops per second per device, divided by
  the device's peak (`PEAK_FLOPS`, dense bf16 figures from the vendors' data sheets, or the
  ``peak_flops_per_device`` you give). `StatLoop(model_flops_per_example=...)` reports
  ``jaxloop/mfu`` from flops you give (e.g. ``6 * num_params * tokens_per_example`` for a
  transformer; or ``model_flops_per_token=6 * num_params`` with ``tokens_key``), or, with
  ``model_flops_per_example='xla'``, ``jaxloop/mfu_xla_cost_analysis`` from XLA's cost
  analysis of the compiled step (which counts what XLA runs, rematerialisation included).
  Beside it, the model TFLOP/s per device (``jaxloop/model_tflops_per_sec_per_device``).
  Where the peak is unknown (CPUs, new chips) MFU is left out and a notice is logged once
  per device kind.
* **Goodput**: a `Recorder` splits the wall time into compile, waiting for input, device
  compute (the training steps as the host sees them), checkpoint blocking and evaluation;
  what is left is ``other`` (summaries, Python). `StatLoop(recorder=...)` reports the split
  for the window since the previous train loop's statistics as ``jaxloop/time/*_secs`` and
  ``jaxloop/goodput`` (compute / wall).

Example::

    recorder = goodput.Recorder()
    ckpt_start, ckpt_stop = recorder.span('checkpoint')
    eval_start, eval_stop = recorder.span('evaluation')
    train = TrainLoop(step, recorder=recorder, model_flops_per_example=3 * 2 * 784 * 256,
                      global_batch_size=128,
                      end_actions=[summary, ckpt_start, checkpoint_action, ckpt_stop])
    evaluate = EvalLoop(eval_step, begin_actions=[eval_start], end_actions=[eval_stop])
    ...
    recorder.totals()   # the whole run: {'compile': ..., 'compute': ..., 'wall': ...}
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

__all__ = [
    "CATEGORIES",
    "PEAK_FLOPS",
    "Recorder",
    "compile_seconds",
    "mfu",
    "peak_flops",
    "resolved_peak",
]

log = logging.getLogger(__name__)

# Dense bf16 peak flop/s per device (chip), without sparsity, from the vendors' data sheets.
# Matched against `jax.Device.device_kind` in this order (the first substring found wins).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756e12),
    ("h100", 989e12),      # SXM, e.g. 'NVIDIA H100 80GB HBM3'
    ("h200", 989e12),
    ("a100", 312e12),
    ("tpu v6 lite", 918e12),  # v6e
    ("tpu v6e", 918e12),
    ("tpu v5 lite", 197e12),  # v5e
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),       # v5p reports 'TPU v5'
    ("tpu v4", 275e12),
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
    """Seconds this process has spent tracing, lowering and compiling JAX programs since the
    first call of this function (JAX's own compile-duration events; cache loads included).
    """
    with _compile_lock:
        if not _listening[0]:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening[0] = True
        return _compile_total[0]


def peak_flops(device: jax.Device | str | None = None) -> float | None:
    """Peak dense bf16 flop/s of a device (default: the first), or None when unknown.

    Example::

        peak_flops('NVIDIA H100 80GB HBM3')  # 9.89e14
        peak_flops('cpu')                   # None
    """
    if device is None:
        device = jax.devices()[0]
    kind = (device if isinstance(device, str) else device.device_kind).lower()
    for name, flops in PEAK_FLOPS:
        if name in kind:
            return flops
    return None


def resolved_peak(peak: float | None = None,
                  device: jax.Device | str | None = None) -> float | None:
    """`peak` when given, else the device's peak from the table (`peak_flops`); when
    neither is known, None, and a notice is logged the first time per device kind.

    Example::

        resolved_peak()            # on CPU: None, and the notice once
        resolved_peak(1e12)        # 1e12: a peak measured or read from a data sheet
    """
    if peak is not None:
        return float(peak)
    found = peak_flops(device)
    if found is None:
        kind = device if isinstance(device, str) else (device or jax.devices()[0]).device_kind
        if kind not in _noticed:
            _noticed.add(kind)
            log.warning(
                "No peak flop/s known for device kind %r, so MFU is not reported; give the "
                "peak as StatLoop(peak_flops_per_device=...). Model TFLOP/s per device is "
                "reported without it.", kind)
    return found


def mfu(flops_per_sec_per_device: float, device: jax.Device | str | None = None,
        peak: float | None = None) -> float | None:
    """Model-flops utilisation: achieved flop/s per device over the device's peak, or over
    `peak` when given (None when neither is known).

    Example::

        mfu(6 * n_params * tokens_per_sec / jax.device_count())
        mfu(2e12, peak=4e12)  # 0.5
    """
    peak = peak if peak is not None else peak_flops(device)
    return None if peak is None else flops_per_sec_per_device / peak


class Recorder:
    """Accumulates where the wall time goes, on the host, beside the training state.

    Compile time comes from JAX's monitoring events; the train loop (`StatLoop` with
    ``recorder=``) measures input waits and its own time; `span` actions time checkpoint
    saves and evaluation. Compilation inside a span or the train loop counts as compile
    time only.
    """

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._compile_start = compile_seconds()
        self._totals = dict.fromkeys(CATEGORIES, 0.0)
        self._window_start = self._started
        self._window_compile = self._compile_start
        self._window = dict.fromkeys(CATEGORIES, 0.0)
        self._open: dict[str, tuple[float, float]] = {}

    def add(self, category: str, seconds: float) -> None:
        """Adds `seconds` of wall time to `category` (one of `CATEGORIES`, not compile)."""
        if category not in CATEGORIES or category == "compile":
            raise ValueError(f"category must be one of {CATEGORIES[1:]}, got {category!r}")
        self._totals[category] += seconds
        self._window[category] += seconds

    @contextlib.contextmanager
    def measure(self, category: str) -> Iterator[None]:
        """Times a block as `category`, less any compilation inside it.

        Example::

            with recorder.measure('checkpoint'):
                manager.wait_until_finished()
        """
        start, compiled = time.perf_counter(), compile_seconds()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.add(category, max(0.0, elapsed - (compile_seconds() - compiled)))

    def start(self, category: str) -> None:
        """Opens a timed span (closed by `stop`), for work that begins and ends in
        different places, such as an eval loop's begin and end actions."""
        self._open[category] = (time.perf_counter(), compile_seconds())

    def stop(self, category: str) -> None:
        """Closes the span opened by `start`; does nothing if none is open."""
        opened = self._open.pop(category, None)
        if opened is not None:
            elapsed = time.perf_counter() - opened[0]
            self.add(category, max(0.0, elapsed - (compile_seconds() - opened[1])))

    def span(self, category: str, interval: int = 1) -> tuple[Any, Any]:
        """Two actions, (start, stop), that time what runs between them.

        Put them around a checkpoint action in a train loop's ``end_actions``, or as an
        eval loop's first begin action and last end action.
        """
        from jaxloop import actions  # noqa: PLC0415 (actions import the loops, which import this)

        recorder = self

        class _Start(actions.Action):
            def __call__(self, state: Any, outputs: Any, **kwargs: Any) -> None:
                recorder.start(category)

        class _Stop(actions.Action):
            def __call__(self, state: Any, outputs: Any, **kwargs: Any) -> None:
                recorder.stop(category)

        return _Start(interval), _Stop(interval)

    def window(self) -> dict[str, float]:
        """The split of the wall time since the last `window` call (or creation), in
        seconds, with ``other`` (unmeasured) and ``wall``; starts a new window."""
        now, compiled = time.perf_counter(), compile_seconds()
        out = dict(self._window)
        out["compile"] = compiled - self._window_compile
        out["wall"] = now - self._window_start
        out["other"] = out["wall"] - sum(out[c] for c in CATEGORIES)
        self._window = dict.fromkeys(CATEGORIES, 0.0)
        self._window_start, self._window_compile = now, compiled
        return out

    def totals(self) -> dict[str, float]:
        """The split of the wall time since the recorder was created (like `window`)."""
        out = dict(self._totals)
        out["compile"] = compile_seconds() - self._compile_start
        out["wall"] = time.perf_counter() - self._started
        out["other"] = out["wall"] - sum(out[c] for c in CATEGORIES)
        return out

    def train_loop(self, seconds: float, input_seconds: float, compile_secs: float) -> None:
        """Records a train loop that took `seconds`, of which `input_seconds` were spent
        waiting for batches (already added) and `compile_secs` compiling."""
        self.add("compute", max(0.0, seconds - input_seconds - compile_secs))
