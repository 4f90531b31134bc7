"""jaxloop against hand-written loops on a device-bound step: does the host keep the device busy?

The step's device time is a sleep inside the compiled program, so the "device" works beside
the host without taking its cores, as an accelerator does. Each variant is a ratio to its
hand-written reference, timed side by side:

  loops of L, outputs      ``OuterLoop(TrainLoop(step), progress=False)`` with its defaults,
                           ``train_loop_steps=L``, the step returning ``{'loss': ...}``;
                           ÷ ``train = jax.jit(step_fn, donate_argnums=0)`` called over the
                           batches, outputs kept in a list, never waiting (goal >= 0.98)
  loops of L, no outputs   the same with a step returning ``(state, None)``; ÷ the
                           hand-written loop of that step (goal >= 0.98)
  loops of L, summary      a `SummaryAction` at every loop (a writer that keeps what it is
                           given); ÷ a hand-written loop that reads the same values at the
                           same steps: at every L steps one ``jax.device_get`` of that
                           loop's losses, written at their steps (goal >= 0.97)
  loops of L, progress bar the outputs variant with the progress bar shown (as in a
                           notebook); ÷ the hand-written loop that never waits (goal >= 0.98)
  loops of L, summary each loop  the summary variant ÷ the hand-written loop that never
                           waits (goal >= 0.98)

A window is one ``OuterLoop`` call (or one pass of the hand-written loop) over --steps
steps, then one ``jax.block_until_ready`` of the state. Each variant trains one state
throughout; a round times one window of every variant, in an order that rotates from round
to round, and each ratio is taken within a round. The median ratio over --rounds rounds is
printed with its spread (min-max).

How the device sleeps. On a GPU or TPU: ``jax.experimental.io_callback`` (unordered), whose
program runs on the device's stream while the host goes on. On CPU that does not work:
jaxlib executes a program holding a jax host callback synchronously in the calling thread
("to avoid deadlocks with reentrant callbacks"), so dispatch would return only once the
step is done (``--device-sleep io_callback`` shows it). There the sleep is an XLA FFI
custom call registered through ctypes (``jax.ffi.register_ffi_target``, ``jax.ffi.pycapsule``),
which XLA runs on its own threads like any other op; it takes the GIL only to call
``time.sleep``. XLA:CPU also runs a program inline when its arithmetic is under 1000 flops;
this step's (a 16-16 dense layer on 32 examples, forward and backward) is above that.
``sys.setswitchinterval(1e-4)`` keeps the sleeping thread from waiting long for the GIL.

Beside the ratios, which the machine's load moves by a few percent, it prints where the
device waited: the median time from the end of one step's sleep to the start of the next,
for steps inside a loop and for those across a loop's end. A loop that drains the device
at its end shows there, whatever the noise. And it counts the host's waits in one more
window of each variant: ``block_until_ready`` (``jax.block_until_ready`` and the array
method; the steps-in-flight bound makes one a step once it is reached, most of them
instant) and device-to-host reads (``jax.device_get``, ``float()``/``int()``/``bool()``/
``.item()``/``.tolist()``/numpy conversion of an array), by wrapping those public entry
points while it counts.

    python benchmarks/async_device.py                 # about 2 minutes on 2 cores
    python benchmarks/async_device.py --rounds 21 --sleep-ms 5
    python benchmarks/async_device.py --quick         # a few seconds (the test's setting)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

from jaxloop import actions, eval_loop, outer_loop, step, train_loop

# -- the device's sleep ----------------------------------------------------------------------


class _Extension(ctypes.Structure):  # XLA_FFI_Extension_Base (xla/ffi/api/c_api.h)
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                ("next", ctypes.c_void_p)]


class _ApiVersion(ctypes.Structure):  # XLA_FFI_Api_Version
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major", ctypes.c_int), ("minor", ctypes.c_int)]


class _Metadata(ctypes.Structure):  # XLA_FFI_Metadata, up to its traits
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _ApiVersion),
                ("traits", ctypes.c_uint32)]


class _MetadataExtension(ctypes.Structure):  # XLA_FFI_Metadata_Extension
    _fields_ = [("base", _Extension), ("metadata", ctypes.POINTER(_Metadata))]


class _List(ctypes.Structure):  # XLA_FFI_Args / XLA_FFI_Rets
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.c_void_p),
                ("items", ctypes.POINTER(ctypes.c_void_p))]


class _Buffer(ctypes.Structure):  # XLA_FFI_Buffer
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("dtype", ctypes.c_int), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dims", ctypes.c_void_p)]


class _CallFrame(ctypes.Structure):  # XLA_FFI_CallFrame, up to its results
    _fields_ = [("struct_size", ctypes.c_size_t),
                ("extension_start", ctypes.POINTER(_Extension)), ("api", ctypes.c_void_p),
                ("ctx", ctypes.c_void_p), ("stage", ctypes.c_int), ("args", _List),
                ("rets", _List)]


_METADATA_EXTENSION = 1  # XLA_FFI_Extension_Metadata
_FFI_VERSION = (0, 1)  # the FFI version whose structures this handler reads
_handlers: dict[str, Any] = {}  # registered handlers, kept alive for XLA


# While a list: each device sleep's (start, end), to find the device's idle time between
# steps.
device_trace: list[tuple[float, float]] | None = None


def _sleep(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    trace = device_trace
    if trace is not None:
        trace.append((start, time.perf_counter()))


def ffi_sleep(seconds: float) -> Callable[[jax.Array], jax.Array]:
    """A function of one array returning float32 0 after `seconds` of sleep inside the
    compiled program: an XLA FFI custom call (CPU) that XLA runs on its own threads.

    Example::

        zero = ffi_sleep(0.003)(loss)  # the program takes 3 ms more, on no core
    """
    name = f"jaxloop_bench_sleep_{round(seconds * 1e6)}us"
    if name not in _handlers:
        @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))
        def handler(frame_pointer):
            frame = frame_pointer.contents
            extension = frame.extension_start
            if extension and extension.contents.type == _METADATA_EXTENSION:
                # XLA asks which FFI version the handler speaks (once, at registration).
                metadata = ctypes.cast(extension, ctypes.POINTER(_MetadataExtension))
                metadata = metadata.contents.metadata.contents
                metadata.api_version = _ApiVersion(ctypes.sizeof(_ApiVersion), None,
                                                   *_FFI_VERSION)
                metadata.traits = 0
                return None
            _sleep(seconds)
            result = ctypes.cast(frame.rets.items[0], ctypes.POINTER(_Buffer)).contents
            ctypes.c_float.from_address(result.data).value = 0.0
            return None  # no error

        jax.ffi.register_ffi_target(
            name, jax.ffi.pycapsule(ctypes.cast(handler, ctypes.c_void_p).value),
            platform="cpu")
        _handlers[name] = handler
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((), jnp.float32), has_side_effect=True)
    return lambda x: call(x)


def callback_sleep(seconds: float) -> Callable[[jax.Array], jax.Array]:
    """As `ffi_sleep`, by ``jax.experimental.io_callback`` (asynchronous on GPUs and TPUs;
    on CPU jaxlib runs such a program synchronously)."""

    def sleep(_: Any) -> np.float32:
        _sleep(seconds)
        return np.float32(0)

    return lambda x: io_callback(sleep, jax.ShapeDtypeStruct((), np.float32), x, ordered=False)


# -- the step ----------------------------------------------------------------------------------


def make_step_fn(device_sleep: Callable[[jax.Array], jax.Array], with_outputs: bool
                 ) -> Callable[[Any, dict], tuple[Any, Any]]:
    """A training step whose device time is `device_sleep`: the sleep takes the step's loss
    (so it follows the previous step's update) and its zero is added to the gradients and
    the loss (so XLA keeps it, and the new state is ready only after it)."""

    def step_fn(state: Any, batch: dict) -> tuple[Any, Any]:
        def loss_fn(params: Any) -> jax.Array:
            y = state.apply_fn({"params": params}, batch["x"])
            return jnp.mean((y - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        zero = device_sleep(loss)
        state = state.apply_gradients(grads=jax.tree.map(lambda g: g + zero, grads))
        return state, ({"loss": loss + zero} if with_outputs else None)

    return step_fn


class SleepStep(step.Step):
    """A jaxloop Step running `step_fn`."""

    def __init__(self, step_fn: Callable[[Any, dict], tuple[Any, Any]]):
        super().__init__(jax.random.key(0), nn.Dense(16), optimizer=optax.sgd(1e-3), train=True)
        self._step_fn = step_fn

    def run(self, state: Any, batch: dict) -> tuple[Any, Any]:
        return self._step_fn(state, batch)


def make_batches(count: int = 16) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(32, 16)).astype(np.float32),
             "y": rng.normal(size=(32, 16)).astype(np.float32)} for _ in range(count)]


def cycle(batches: list[dict], n: int) -> Iterator[dict]:
    for i in range(n):
        yield batches[i % len(batches)]


class RecordingWriter:
    """A summary writer that keeps the scalars it is given (SummaryAction takes any object
    with clu's MetricWriter methods)."""

    def __init__(self) -> None:
        self.scalars: list[tuple[int, dict[str, float]]] = []

    def write_scalars(self, step: int, scalars: dict[str, Any]) -> None:
        self.scalars.append((int(step), {k: float(v) for k, v in scalars.items()}))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


# -- the host's waits --------------------------------------------------------------------------


class HostWaits:
    """Counts the host's waits on the device while `counting()` is open: block_until_ready
    (``jax.block_until_ready`` and the array method) and device-to-host reads
    (``jax.device_get`` and an array's conversions to host values). Only public names are
    wrapped; a call made inside another counted one is not counted again."""

    READS = ("__float__", "__int__", "__bool__", "__index__", "item", "tolist", "__array__")

    def __init__(self) -> None:
        self.blocks = 0
        self.reads = 0
        self._depth = threading.local()

    def _counted(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                if kind == "block":
                    self.blocks += 1
                else:
                    self.reads += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    @contextlib.contextmanager
    def counting(self) -> Iterator[HostWaits]:
        array_type = type(jnp.zeros(()))
        targets = [(jax, "block_until_ready", "block"), (jax, "device_get", "read"),
                   (array_type, "block_until_ready", "block")]
        targets += [(array_type, name, "read") for name in self.READS]
        undo = []
        try:
            for owner, name, kind in targets:
                own = name in vars(owner)
                original = getattr(owner, name)
                setattr(owner, name, self._counted(original, kind))
                undo.append((owner, name, original if own else None))
            yield self
        finally:
            for owner, name, original in reversed(undo):
                if original is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)


# -- the variants ------------------------------------------------------------------------------

Window = Callable[[Any, int, int], Any]  # (state, its step, steps) -> state


def hand_written(step_fn: Callable, batches: list[dict], read_every: int | None = None
                 ) -> Window:
    """``train = jax.jit(step_fn, donate_argnums=0)`` over the batches, outputs kept in a
    list; with `read_every`, every `read_every` steps one ``jax.device_get`` of those steps'
    losses, written to a `RecordingWriter` at their steps."""
    train = jax.jit(step_fn, donate_argnums=0)
    writer = RecordingWriter()

    def run(state: Any, first: int, n: int) -> Any:
        kept = []
        for i, batch in enumerate(cycle(batches, n)):
            state, out = train(state, batch)
            if out is not None:
                kept.append(out["loss"])
            if read_every and (i + 1) % read_every == 0:
                values = jax.device_get(kept[-read_every:])
                start = first + i + 2 - read_every
                for j, value in enumerate(values):
                    writer.write_scalars(start + j, {"loss": value})
        return state

    return run


def with_jaxloop(jaxloop_step: step.Step, batches: list[dict], loop_steps: int,
                 summary: bool = False, progress: bool = False) -> Window:
    """``OuterLoop(TrainLoop(step), progress=False)`` with its defaults, one call per window
    in loops of `loop_steps`; with `summary`, a `SummaryAction` at every loop; with
    `progress`, the progress bar shown (as in a notebook)."""
    end_actions = [actions.SummaryAction(RecordingWriter())] if summary else []
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(jaxloop_step, end_actions=end_actions),
                                 progress=progress)

    def run(state: Any, first: int, n: int) -> Any:
        # train_total_steps is absolute: the state goes on from `first`.
        state, _ = outer(state, cycle(batches, n), train_total_steps=first + n,
                         train_loop_steps=loop_steps, log_train_total_steps=False)
        return state

    return run


def eval_fn_of(device_sleep: Callable[[jax.Array], jax.Array]) -> Callable[[Any, dict], Any]:
    """An evaluation step whose device time is `device_sleep`; a batch's `mask` (where it
    has one) weights the loss."""

    def eval_fn(state: Any, batch: dict) -> tuple[Any, dict]:
        errors = jnp.mean((state.apply_fn({"params": state.params}, batch["x"])
                           - batch["y"]) ** 2, axis=-1)
        mask = batch.get("mask", jnp.ones_like(errors))
        loss = jnp.sum(errors * mask) / jnp.sum(mask)
        return state, {"loss": loss + device_sleep(loss)}

    return eval_fn


class SleepEvalStep(step.Step):
    """A jaxloop evaluation Step running `eval_fn`."""

    def __init__(self, eval_fn: Callable[[Any, dict], Any]):
        super().__init__(jax.random.key(0), nn.Dense(16))
        self._eval_fn = eval_fn

    def run(self, state: Any, batch: dict) -> tuple[Any, Any]:
        return self._eval_fn(state, batch)


def add_alternating_eval(windows: dict[str, Window], pairs: dict[str, tuple[str, float]],
                         loops: dict[str, int], device_sleep: Callable, batches: list[dict],
                         length: int) -> None:
    """An evaluation of `length` batches at a time, alternating a dataset whose batches carry
    a `mask` with one whose batches do not: ``EvalLoop(step)(state, batches, num_steps=
    length)`` ÷ ``jax.jit(eval_fn)`` called over the same batches, outputs kept. Each window
    ends waiting for its last loss (an evaluation leaves the state as it is)."""
    masked = [dict(b, mask=np.ones(len(b["x"]), np.float32)) for b in batches]
    datasets = (batches, masked)
    eval_fn = eval_fn_of(device_sleep)
    evaluate = jax.jit(eval_fn)
    loop = eval_loop.EvalLoop(SleepEvalStep(eval_fn))

    def hand(state: Any, first: int, n: int) -> Any:
        kept = []
        for i in range(0, n, length):
            for batch in cycle(datasets[i // length % 2], min(length, n - i)):
                kept.append(evaluate(state, batch)[1])
        jax.block_until_ready(kept[-1])
        return state

    def jaxloop_eval(state: Any, first: int, n: int) -> Any:
        for i in range(0, n, length):
            _, outputs = loop(state, cycle(datasets[i // length % 2], min(length, n - i)))
        jax.block_until_ready(outputs["loss"][-1])
        return state

    windows["hand-written eval"] = hand
    name = f"eval of {length}, two structures"
    windows[name] = jaxloop_eval
    pairs[name] = ("hand-written eval", 0.98)
    loops[name] = loops["hand-written eval"] = length


def add_fused_with_step_action(windows: dict[str, Window], pairs: dict[str, tuple[str, float]],
                               loops: dict[str, int], step_fn: Callable, batches: list[dict],
                               length: int) -> None:
    """``OuterLoop(TrainLoop(step, steps_per_execution=16), progress=False)`` in loops of
    `length`, the step with an end action every 5 steps (it keeps the outputs it is given,
    reading nothing): executions of 5 steps. ÷ the hand-written loop with outputs."""

    class KeepOutputs:
        interval = 5

        def __call__(self, state: Any, outputs: Any, **kwargs: Any) -> None:
            self.outputs = outputs

    fused = SleepStep(step_fn)
    fused.end_actions.append(KeepOutputs())
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(fused, steps_per_execution=16),
                                 progress=False)

    def run(state: Any, first: int, n: int) -> Any:
        state, _ = outer(state, cycle(batches, n), train_total_steps=first + n,
                         train_loop_steps=length, log_train_total_steps=False)
        return state

    name = f"k=16, step action every 5, loops of {length}"
    windows[name] = run
    pairs[name] = ("hand-written, outputs", 0.98)
    loops[name] = length


def add_display_cases(windows: dict[str, Window], pairs: dict[str, tuple[str, float]],
                      loops: dict[str, int], jaxloop_step: step.Step, batches: list[dict],
                      length: int) -> None:
    """The progress bar on, and a SummaryAction every loop, each ÷ the hand-written loop
    that never waits (goal >= 0.98): a loop end neither needs waits for nothing."""
    for display in ("progress bar", "summary each loop"):
        name = f"loops of {length}, {display}"
        bar = display == "progress bar"
        windows[name] = with_jaxloop(jaxloop_step, batches, length, summary=not bar,
                                     progress=bar)
        pairs[name] = ("hand-written, outputs", 0.98)
        loops[name] = length


def build(device_sleep: Callable, loop_lengths: list[int]
          ) -> tuple[dict[str, Window], dict[str, tuple[str, float]], dict[str, int],
                     Callable[[], Any]]:
    """The windows by name, each jaxloop variant's (reference, goal), the loop length of
    each window that has loops (or reads every so many steps), and a fresh state."""
    batches = make_batches()
    with_out = make_step_fn(device_sleep, True)
    without = make_step_fn(device_sleep, False)
    steps = {True: SleepStep(with_out), False: SleepStep(without)}
    windows: dict[str, Window] = {
        "hand-written, outputs": hand_written(with_out, batches),
        "hand-written, no outputs": hand_written(without, batches),
    }
    pairs: dict[str, tuple[str, float]] = {}
    loops: dict[str, int] = {}
    for length in loop_lengths:
        for outputs in (True, False):
            name = f"loops of {length}, {'outputs' if outputs else 'no outputs'}"
            windows[name] = with_jaxloop(steps[outputs], batches, length)
            pairs[name] = (f"hand-written, {'outputs' if outputs else 'no outputs'}", 0.98)
            loops[name] = length
        reference = f"hand-written, reads every {length}"
        windows[reference] = hand_written(with_out, batches, read_every=length)
        name = f"loops of {length}, summary"
        windows[name] = with_jaxloop(steps[True], batches, length, summary=True)
        pairs[name] = (reference, 0.97)
        loops[name] = loops[reference] = length
        add_display_cases(windows, pairs, loops, steps[True], batches, length)

    add_alternating_eval(windows, pairs, loops, device_sleep, batches, loop_lengths[0])
    add_fused_with_step_action(windows, pairs, loops, with_out, batches, loop_lengths[-1])
    first = steps[True].initialize_model([1, 16])

    def fresh_state() -> Any:
        # A copy per variant (each window donates its state), built once.
        return jax.block_until_ready(jax.tree.map(jnp.copy, first))

    return windows, pairs, loops, fresh_state


def dispatch_check(step_fn: Callable, state: Any, n: int = 8) -> tuple[float, float, int]:
    """Whether the device runs beside the host: the seconds `n` chained steps took to
    dispatch and to finish, and how many were done when dispatch returned."""
    train = jax.jit(step_fn)  # no donation: `state` stays the caller's
    batch = make_batches(1)[0]
    jax.block_until_ready(train(state, batch))
    start = time.perf_counter()
    outs = []
    for _ in range(n):
        state, out = train(state, batch)
        outs.append(state.step)
    dispatched = time.perf_counter() - start
    done = sum(x.is_ready() for x in outs)
    jax.block_until_ready(state)
    return dispatched, time.perf_counter() - start, done


def measure(windows: dict[str, Window], loops: dict[str, int], fresh_state: Callable[[], Any],
            steps: int, rounds: int) -> tuple[dict, dict, dict]:
    """By window: its steps/s in every round (order rotating from round to round); the
    device's idle time between two steps, those inside a loop and those across a loop's end
    (`loops`: every so many steps); the host's waits (blocks, reads) in one more window."""
    states = {name: fresh_state() for name in windows}
    done = dict.fromkeys(windows, 0)

    def run(name: str) -> None:
        states[name] = jax.block_until_ready(windows[name](states[name], done[name], steps))
        done[name] += steps

    for name in windows:  # compiles what each window uses
        run(name)
    global device_trace
    rates: dict[str, list[float]] = {name: [] for name in windows}
    idle: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in windows}
    names = list(windows)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            device_trace = []
            start = time.perf_counter()
            run(name)
            rates[name].append(steps / (time.perf_counter() - start))
            trace, device_trace = device_trace, None
            # The device's idle time from the end of step i's sleep to the next one's start.
            for i, (a, b) in enumerate(zip(trace, trace[1:], strict=False), start=1):
                idle[name][1 if i % loops.get(name, steps + 1) == 0 else 0].append(b[0] - a[1])
    waits = {}
    for name in names:
        counter = HostWaits()
        with counter.counting():
            run(name)
        waits[name] = (counter.blocks, counter.reads)
    return rates, idle, waits


def report(args: argparse.Namespace, how: str, platform: str,
           check: tuple[float, float, int], pairs: dict[str, tuple[str, float]],
           rates: dict, idle: dict, waits: dict) -> None:
    """Prints the ratios, the dispatch check, the device's idle time and the host's waits."""
    dispatched, finished, done = check
    print(f"-- a step of {args.sleep_ms:g} ms device time ({how} sleep on {platform}, "
          f"{jax.devices()[0].device_kind}), windows of {args.steps} steps, {args.rounds} "
          f"rounds; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    asynchronous = "the device runs beside the host" if done < 8 else "SYNCHRONOUS"
    print(f"    8 steps dispatched in {dispatched * 1e3:.1f} ms, done in {finished * 1e3:.1f} "
          f"ms; {done} of 8 done when dispatch returned ({asynchronous})")
    print(f"    {'variant':30s} {'median':>7s} {'[min-max]':15s} {'goal':7s}  reference")
    for name, (reference, goal) in pairs.items():
        ratios = [a / b for a, b in zip(rates[name], rates[reference], strict=True)]
        mid = statistics.median(ratios)
        print(f"    {name:30s} {mid:7.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
              f">= {goal:.2f} {'met' if mid >= goal else 'BELOW':5s}  {reference}")
    hand = [name for name in rates if name.startswith("hand-written")]
    print("    steps/s (median): " + ", ".join(
        f"{name} {statistics.median(rates[name]):.1f}" for name in hand)
        + f"; the device's bound {1e3 / args.sleep_ms:.1f}")
    print(f"    {'':30s} device idle between steps, median us   host waits in a window")
    print(f"    {'':30s} {'in a loop':>10s} {'at a loop end':>14s} {'mean':>7s}   "
          f"{'blocks':>7s} {'reads':>6s}")
    for name, (blocks, reads) in waits.items():
        inside, at_end = idle[name]
        end = f"{statistics.median(at_end) * 1e6:14.0f}" if at_end else f"{'-':>14s}"
        mean = sum(inside + at_end) / max(1, len(inside + at_end))
        print(f"    {name:30s} {statistics.median(inside) * 1e6:10.0f} {end} {mean * 1e6:7.0f}"
              f"   {blocks:7d} {reads:6d}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11,
                        help="timed windows of each variant, taking turns (default 11)")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps per window: one OuterLoop call (default 200)")
    parser.add_argument("--sleep-ms", type=float, default=3.0,
                        help="the step's device time, a sleep in the program (default 3)")
    parser.add_argument("--loop-steps", default="10,100",
                        help="train_loop_steps of the jaxloop variants, comma-separated")
    parser.add_argument("--device-sleep", choices=("auto", "ffi", "io_callback"),
                        default="auto", help="how the device sleeps: auto is ffi on CPU, "
                        "io_callback elsewhere (see the module docstring)")
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds: 2 rounds of 20 steps of 1 ms, loops of 5 and 10")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.sleep_ms, args.loop_steps = 2, 20, 1.0, "5,10"
    loop_lengths = [int(x) for x in args.loop_steps.split(",")]
    if args.rounds < 1 or args.steps < 1 or args.sleep_ms <= 0 or min(loop_lengths) < 1:
        parser.error("--rounds, --steps, --sleep-ms and --loop-steps must be positive")
    sys.setswitchinterval(1e-4)  # the sleeping thread gets the GIL at once
    platform = jax.default_backend()
    how = args.device_sleep
    if how == "auto":
        how = "ffi" if platform == "cpu" else "io_callback"
    if how == "ffi" and platform != "cpu":
        parser.error("--device-sleep ffi registers a CPU custom call; use io_callback here")
    seconds = args.sleep_ms / 1e3
    device_sleep = ffi_sleep(seconds) if how == "ffi" else callback_sleep(seconds)
    windows, pairs, loops, fresh_state = build(device_sleep, loop_lengths)
    dispatched, finished, done = dispatch_check(make_step_fn(device_sleep, True), fresh_state())
    rates, idle, waits = measure(windows, loops, fresh_state, args.steps, args.rounds)

    report(args, how, platform, (dispatched, finished, done), pairs, rates, idle, waits)
    given = " ".join(argv if argv is not None else sys.argv[1:])
    print(f"command: python benchmarks/async_device.py {given}".rstrip()
          + f"  (= --rounds {args.rounds} --steps {args.steps} --sleep-ms {args.sleep_ms:g} "
          f"--loop-steps {args.loop_steps} --device-sleep {how})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
