"""Performance features: fused multi-step execution (steps_per_execution), one compiled
program per step kind, no hidden per-step host sync, and the profile hook."""

import contextlib
import gc
import glob
import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import eval_loop as eval_loop_lib
from jaxloop import loop, outer_loop, partition
from jaxloop import train_loop as train_loop_lib
from jaxloop.diagnostics import profiling
from jaxloop.engine import staging
from jaxloop.launch import preemption

DATA = toy_data(256)
BATCHES = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 256, 16)]


def forever():
    while True:
        yield from BATCHES


def make_partitioner(kind):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    if kind == "single":
        return partition.SingleDevicePartitioner()
    if kind == "dp":
        return partition.DataParallelPartitioner(mesh, "data")
    return partition.FSDPPartitioner(mesh, "data", min_weight_size=64)


def make_step(kind="single", train=True, step_cls=ClassifierStep, **kwargs):
    optimizer = optax.adam(1e-2) if train else optax.identity()
    return step_cls(jax.random.key(0), LinenMLP(), optimizer=optimizer,
                    partitioner=make_partitioner(kind), train=train, **kwargs)


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_same_outputs(a, b, keys=("loss", "accuracy", "logits")):
    for key in keys:
        assert len(a[key]) == len(b[key])
        np.testing.assert_array_equal(np.stack(host(a[key])), np.stack(host(b[key])))


# -- steps_per_execution ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["single", "dp", "fsdp"])
@pytest.mark.parametrize("k", [3, 4])
def test_fused_steps_are_bit_identical(kind, k):
    results = {}
    for spe in (1, k):
        step = make_step(kind)
        state = step.initialize_model([1, 16])
        tl = train_loop_lib.TrainLoop(step, steps_per_execution=spe)
        state, outputs = tl(state, forever(), num_steps=10)  # k=4: 4+4+2; k=3: 3+3+3+1
        results[spe] = (state, outputs)
    (state1, out1), (state_k, out_k) = results[1], results[k]
    assert int(state_k.step) == 10 and len(out_k["loss"]) == 10
    jax.tree.map(np.testing.assert_array_equal, host(state1.params), host(state_k.params))
    jax.tree.map(np.testing.assert_array_equal, host(state1.opt_state), host(state_k.opt_state))
    assert_same_outputs(out1, out_k)
    # Per-step outputs keep their per-step shape and the batch's placement.
    assert out_k["loss"][0].shape == () and out_k["logits"][0].shape == (16, 10)
    n_data = 1 if kind == "single" else 8
    assert {s.data.shape for s in out_k["logits"][-1].addressable_shards} == {(16 // n_data, 10)}
    for a, b in zip(jax.tree.leaves(state1.params), jax.tree.leaves(state_k.params), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


@pytest.mark.parametrize("kind", ["single", "fsdp"])
def test_fused_eval_loop_and_dataset_end(kind):
    train = make_step(kind)
    state = train.initialize_model([1, 16])
    evaluate = make_step(kind, train=False)
    _, plain = eval_loop_lib.EvalLoop(evaluate)(state, BATCHES)
    el = eval_loop_lib.EvalLoop(evaluate, steps_per_execution=5)
    same, fused = el(state, BATCHES)  # 5+5+5, then one batch left: the same program
    assert same is state and el.dataset_exhausted and el.num_steps_run == 16
    assert_same_outputs(plain, fused)
    tl = train_loop_lib.TrainLoop(train, steps_per_execution=4)
    state, outputs = tl(state, BATCHES[:7])  # 4, then the 3 batches left
    assert int(state.step) == 7 and len(outputs["loss"]) == 7 and tl.dataset_exhausted


def test_unrolled_conv_steps_are_bit_identical():
    # XLA:CPU compiles convolutions inside a loop body to another kernel (slower, other
    # rounding); unrolled, the fused steps compile like single steps.
    from test_partition import GuideCNN

    rng = np.random.default_rng(0)
    batches = [{"x": rng.random((8, 28, 28, 1), np.float32),
                "y": rng.integers(0, 10, 8).astype(np.int32)} for _ in range(6)]
    results = {}
    for spe in (1, 4):
        step = ClassifierStep(jax.random.key(0), GuideCNN(), optimizer=optax.sgd(0.005, 0.9),
                              partitioner=make_partitioner("dp"), train=True)
        tl = train_loop_lib.TrainLoop(step, steps_per_execution=spe, unroll=True)
        results[spe] = tl(step.initialize_model([1, 28, 28, 1]), batches)  # 4+2
    jax.tree.map(np.testing.assert_array_equal, host(results[1][0].params),
                 host(results[4][0].params))
    assert_same_outputs(results[1][1], results[4][1])


@pytest.mark.parametrize("on_device", [False, True])
def test_fused_steps_without_batch_sharding(on_device):
    batches = [jax.device_put(b) if on_device else b for b in BATCHES[:8]]
    params = []
    for spe in (1, 4):
        step = make_step(should_shard_batch=False)
        state, _ = train_loop_lib.TrainLoop(step, steps_per_execution=spe)(
            step.initialize_model([1, 16]), batches)
        params.append(host(state.params))
    jax.tree.map(np.testing.assert_array_equal, *params)


def test_fused_steps_with_ragged_last_batch():
    step = make_step()
    state = step.initialize_model([1, 16])
    batches = BATCHES[:5] + [{k: v[:8] for k, v in BATCHES[5].items()}]
    state, outputs = train_loop_lib.TrainLoop(step, steps_per_execution=3)(state, batches)
    assert int(state.step) == 6 and outputs["logits"][-1].shape == (8, 10)
    with pytest.raises(staging.BatchLayoutError, match="share one layout"):
        step.call_steps(state, batches[4:])


class Record:
    """A step action that records the step numbers and host values it sees."""

    def __init__(self, interval):
        self.interval = interval
        self.calls = []

    def __call__(self, state, outputs, per_loop_step_number, batch=None, **kwargs):
        seen = batch["x"] if batch is not None else outputs["loss"]
        self.calls.append((per_loop_step_number, int(state.step), np.asarray(seen)))


def test_step_actions_fire_exactly_with_fused_steps():
    runs = {}
    for spe in (1, 4):
        begin, end = Record(5), Record(3)
        step = make_step(begin_actions=[begin], end_actions=[end])
        state = step.initialize_model([1, 16])
        state, outputs = train_loop_lib.TrainLoop(step, steps_per_execution=spe)(
            state, forever(), num_steps=12)
        runs[spe] = (begin, end, state, outputs)
    begin, end, state, outputs = runs[4]
    assert [c[:2] for c in begin.calls] == [(5, 4), (10, 9)]
    np.testing.assert_array_equal(begin.calls[0][2], BATCHES[4]["x"])  # that step's batch
    assert [c[:2] for c in end.calls] == [(3, 3), (6, 6), (9, 9), (12, 12)]
    for fused, plain in zip(end.calls, runs[1][1].calls, strict=True):
        np.testing.assert_array_equal(fused[2], plain[2])  # that step's loss
    jax.tree.map(np.testing.assert_array_equal, host(runs[1][2].params), host(state.params))
    assert_same_outputs(runs[1][3], outputs)
    # Called directly, call_steps refuses an action that would fire inside the execution.
    with pytest.raises(ValueError, match="fires on step 3, inside an execution of steps 1..4"):
        step.call_steps(state, BATCHES[:4], per_loop_step_number=1)


@contextlib.contextmanager
def counting_compiles():
    """Counts XLA compilations (jax's backend-compile events) inside the block."""
    names = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_one_train_and_one_eval_program_for_any_loop_length():
    # Loops of 200 (12 x 16 + 8), 37, 5 and 1 steps with k=16: every execution, remainders
    # included, runs through the one k-step program of its kind (training: one that
    # consumes the state and one for the first execution of a call, which keeps the
    # caller's).
    train, evaluate = make_step(), make_step(train=False)
    state = train.initialize_model([1, 16])
    tl = train_loop_lib.TrainLoop(train, steps_per_execution=16)
    el = eval_loop_lib.EvalLoop(evaluate, steps_per_execution=16)
    data = forever()
    with counting_compiles() as names:
        for num_steps in (200, 37, 5, 1):
            state, outputs = tl(state, data, num_steps=num_steps)
            _, evaluated = el(state, data, num_steps=num_steps)
            assert len(outputs["loss"]) == len(evaluated["loss"]) == num_steps
    assert int(state.step) == 243
    assert [n for n in names if n == "jit(run)"] == ["jit(run)"] * 3, names


def test_fused_runs_equal_single_steps_and_compile_nothing_after_the_first_loop():
    results = {}
    for spe in (1, 16):
        step = make_step()
        state = step.initialize_model([1, 16])
        tl = train_loop_lib.TrainLoop(step, steps_per_execution=spe)
        data = forever()
        with counting_compiles() as first:
            state, outputs = tl(state, data, num_steps=192)  # a multiple of 16, then others
            assert len(list(outputs["loss"])) == 192  # read, as the later loops' are
        losses = []
        with counting_compiles() as later:
            for num_steps in (200, 200, 37, 5, 16, 1):
                state, outputs = tl(state, data, num_steps=num_steps)
                losses += outputs["loss"]
        # After the first loop nothing compiles, small helper programs included: a partial
        # group is padded on the host and placed by the program's own jit.
        assert first and later == [], (spe, later)
        results[spe] = (host(state), np.stack(host(losses)))
    assert int(results[16][0].step) == 651
    jax.tree.map(np.testing.assert_array_equal, results[1][0].params, results[16][0].params)
    jax.tree.map(np.testing.assert_array_equal, results[1][0].opt_state,
                 results[16][0].opt_state)
    np.testing.assert_array_equal(results[1][1], results[16][1])


def test_prefetching_compiles_the_step_once():
    step = make_step()
    state = step.initialize_model([1, 16])
    outer = outer_loop.OuterLoop(train_loop=train_loop_lib.TrainLoop(step), prefetch=2,
                                 progress=False)
    with counting_compiles() as names:
        state, _ = outer(state, forever(), train_total_steps=20, train_loop_steps=10)
    assert int(state.step) == 20
    # Besides the step (its first step keeps the caller's state: a second program),
    # programs made once per process, whichever test made them first: the history's
    # stacking of per-step scalars.
    once = ("jit(_stack)",)
    assert [n for n in names if n not in once] == ["jit(run)"] * 2, names


def test_the_compiled_step_keeps_no_state_alive():
    # A state the user drops is freed with its device buffers: the program holds shardings,
    # never a state.
    step = make_step()
    state, _ = train_loop_lib.TrainLoop(step)(step.initialize_model([1, 16]), forever(),
                                              num_steps=3)
    assert int(state.step) == 3
    ref = weakref.ref(state)
    del state
    gc.collect()
    assert ref() is None


def test_fused_clu_metrics_are_merged():
    class MetricStep(ClassifierStep):
        def run(self, state, batch):
            state, out = super().run(state, batch)
            return state, {"loss": out["loss"],
                           "mean_loss": clu_metrics.Average.from_model_output(out["loss"])}

    means = {}
    for spe in (1, 4):
        step = make_step(step_cls=MetricStep)
        state = step.initialize_model([1, 16])
        _, outputs = train_loop_lib.TrainLoop(step, steps_per_execution=spe)(
            state, forever(), num_steps=10)
        means[spe] = float(outputs["mean_loss"].compute())
        np.testing.assert_allclose(means[spe], np.mean(host(outputs["loss"])), rtol=1e-6)
    np.testing.assert_allclose(means[4], means[1], rtol=1e-6)


def test_fused_steps_in_outer_loop_with_prefetch():
    params = {}
    for spe, prefetch in ((1, 0), (4, 0), (4, 2)):
        step = make_step("dp")
        outer = outer_loop.OuterLoop(
            train_loop=train_loop_lib.TrainLoop(step, steps_per_execution=spe),
            prefetch=prefetch)
        state, outputs = outer(step.initialize_model([1, 16]), forever(), train_total_steps=10,
                               train_loop_steps=5)  # loops of 4+1 fused steps
        assert int(state.step) == 10 and len(outputs["loss"]) == 5
        params[(spe, prefetch)] = host(state.params)
    for key in ((4, 0), (4, 2)):
        jax.tree.map(np.testing.assert_array_equal, params[(1, 0)], params[key])


def test_preemption_stops_at_the_end_of_an_execution():
    step = make_step()
    state = step.initialize_model([1, 16])
    for spe, expected in ((1, 1), (4, 4)):
        lp = loop.Loop(step, steps_per_execution=spe)
        with preemption.handling_preemption():
            preemption.request()
            state, _ = lp(state, forever(), num_steps=10)
        assert lp.preempted and lp.num_steps_run == expected


def test_default_steps_in_flight_come_from_the_partitioner():
    # Several CPU devices: 2 (deeper queues of collectives deadlocked XLA:CPU); else 8.
    assert loop.Loop(make_step("dp")).max_steps_in_flight == 2
    assert train_loop_lib.TrainLoop(make_step()).max_steps_in_flight == 8
    assert loop.Loop(make_step(), max_steps_in_flight=3).max_steps_in_flight == 3


def test_steps_per_execution_must_be_positive():
    with pytest.raises(ValueError, match="steps_per_execution"):
        train_loop_lib.TrainLoop(make_step(), steps_per_execution=0)
    with pytest.raises(ValueError, match="at least one batch"):
        make_step().call_steps(None, [])


def test_a_bad_unroll_is_refused_when_the_loop_is_built():
    # With one step per call no fused program is ever made to refuse it later.
    with pytest.raises(TypeError, match="unroll must be True or False, got 'yes'"):
        train_loop_lib.TrainLoop(make_step(), unroll="yes")


# -- batch placement -----------------------------------------------------------------------


def test_a_bad_batch_is_a_clear_error_each_time():
    part = make_partitioner("dp")
    first = part.shard_batch(BATCHES[0])
    np.testing.assert_array_equal(np.asarray(first["x"]), BATCHES[0]["x"])
    for _ in range(2):
        with pytest.raises(ValueError, match=r"\['x'\] has shape \(12, 16\).*8 local devices"):
            part.shard_batch(toy_data(12))


@pytest.mark.parametrize("kind", ["single", "dp", "fsdp"])
def test_one_program_for_states_of_one_policy_and_an_error_for_another_placement(kind):
    step = make_step(kind)
    state = step.initialize_model([1, 16])
    with counting_compiles() as names:
        state, _ = step(state, BATCHES[0])
        # Placed alike through another mesh object, as another partitioner instance of the
        # same policy places it.
        state = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(
            Mesh(x.sharding.mesh.devices, x.sharding.mesh.axis_names), x.sharding.spec)),
            state)
        state, _ = step(state, BATCHES[1])
    assert names == ["jit(run)"], names
    if kind == "dp":
        # The same arrays split along the data axis: jax's own check names both shardings.
        split_rows = jax.sharding.NamedSharding(step.partitioner.mesh, P("data"))
        split = jax.tree.map(
            lambda x: jax.device_put(x, split_rows) if x.ndim and x.shape[0] % 8 == 0 else x,
            state)
        with pytest.raises(ValueError, match="does not match the sharding"):
            step(split, BATCHES[2])


def test_stacked_batches_are_placed_like_their_steps():
    part = make_partitioner("dp")
    stacked_host = {k: np.stack([b[k] for b in BATCHES[:4]]) for k in BATCHES[0]}
    stacked = part.shard_stacked_batch(stacked_host)
    assert stacked["x"].sharding.spec == P(None, "data")
    assert {s.data.shape for s in stacked["x"].addressable_shards} == {(4, 2, 16)}
    on_device = staging.stack([part.shard_batch(b) for b in BATCHES[:3]], 4, part)
    for key in stacked:
        assert on_device[key].sharding.is_equivalent_to(stacked[key].sharding, stacked[key].ndim)
        padded = np.concatenate([stacked_host[key][:3], stacked_host[key][2:3]])
        np.testing.assert_array_equal(np.asarray(on_device[key]), padded)
    bad = {"x": np.zeros((4, 12, 16), np.float32)}
    with pytest.raises(ValueError, match=r"\['x'\] has shape \(4, 12, 16\) \(4 stacked"):
        part.shard_stacked_batch(bad)


class MovedBytes(partition.DataParallelPartitioner):
    """Counts the batch bytes each compiled call moves to the devices: host leaves given to
    the program (jit copies each, a repeat too) and each distinct placed array (placed once),
    through the partitioner's `partition` hook; and the rows `shard_stacked_batch` places."""

    def __init__(self):
        super().__init__(Mesh(np.array(jax.devices()), ("data",)), "data")
        self.moved, self.stacked_rows = [], 0

    def partition(self, fn, **jit_kwargs):
        jitted = super().partition(fn, **jit_kwargs)

        def measured(state, batches, *args):
            leaves = jax.tree.leaves(batches)
            placed = {id(x): x for x in leaves if isinstance(x, jax.Array)}
            self.moved.append(sum(x.nbytes for x in leaves if isinstance(x, np.ndarray))
                              + sum(x.nbytes for x in placed.values()))
            return jitted(state, batches, *args)

        return measured

    def shard_stacked_batch(self, batch):
        self.stacked_rows += len(jax.tree.leaves(batch)[0])
        return super().shard_stacked_batch(batch)


class StackedBeginStep(ClassifierStep):
    """A step with its own `begin`, which sees an execution's batches stacked."""

    def begin(self, state, batch):
        return state, batch


@pytest.mark.parametrize("step_cls", [ClassifierStep, StackedBeginStep])
def test_a_partial_execution_moves_only_its_own_batches(step_cls):
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(BATCHES[0]))
    results = {}
    for spe in (1, 16):
        part = MovedBytes()
        step = step_cls(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                        partitioner=part, train=True)
        tl = train_loop_lib.TrainLoop(step, steps_per_execution=spe)
        # 16 + 3 steps: a full execution, then one of 3 that the program runs as 16.
        results[spe] = tl(step.initialize_model([1, 16]), forever(), num_steps=19)
    if step_cls is ClassifierStep:
        assert part.moved == [16 * batch_bytes, 3 * batch_bytes]
    else:  # stacked on the host and placed for the full one; the 3 placed as they are
        assert part.stacked_rows == 16
    (state1, out1), (state16, out16) = results[1], results[16]
    jax.tree.map(np.testing.assert_array_equal, host(state1.params), host(state16.params))
    assert_same_outputs(out1, out16)


def test_fused_outputs_stay_stacked_until_read():
    step = make_step()
    state = step.initialize_model([1, 16])
    _, plain = train_loop_lib.TrainLoop(make_step(), steps_per_execution=1)(
        state, forever(), num_steps=37)
    tl = train_loop_lib.TrainLoop(step, steps_per_execution=16)
    gc.collect()
    before = len(jax.live_arrays())
    state, outputs = tl(state, forever(), num_steps=37)  # executions of 16, 16 and 5
    gc.collect()
    # Three stacked arrays per key, not 37 per-step ones, plus the state's.
    assert len(jax.live_arrays()) - before < 3 * len(outputs) + len(jax.tree.leaves(state))
    losses = outputs["loss"]
    assert len(losses) == 37 and isinstance(losses, list)
    np.testing.assert_array_equal(np.asarray(losses[36]), np.asarray(plain["loss"][36]))
    np.testing.assert_array_equal(np.asarray(losses[-20]), np.asarray(plain["loss"][17]))
    with pytest.raises(IndexError):
        losses[37]
    assert [float(x) for x in losses] == [float(x) for x in plain["loss"]]
    assert_same_outputs(outputs, plain)
    assert float(np.mean(outputs["accuracy"])) == float(np.mean(plain["accuracy"]))
    host_lists = jax.device_get(outputs)
    assert isinstance(host_lists["loss"][0], np.ndarray) and len(host_lists["loss"]) == 37


# -- no hidden per-step host sync ----------------------------------------------------------


@pytest.fixture
def host_reads(monkeypatch):
    """Counts reads of device values on the host while `host_reads.counting` is set.

    On CPU, `jax.transfer_guard_device_to_host` sees no transfer (device memory is host
    memory), so every path that turns a jax.Array into a host value (float(), int(),
    bool(), .item(), .tolist(), jax.device_get) is counted where they all meet:
    `ArrayImpl._value`.
    """
    array_type = type(jnp.zeros(()))
    original = array_type._value

    class Counter:
        counting = False
        count = 0

    def counted(self):
        if Counter.counting:
            Counter.count += 1
        return original.fget(self)

    monkeypatch.setattr(array_type, "_value", property(counted))
    return Counter


def guarded_train_loop(counter, **kwargs):
    """A TrainLoop whose steps run under the D2H transfer guard and the host-read counter.

    Coverage starts when `run` asks for its first batch and ends when `run` returns, so it
    holds every step and everything the loop does between steps. Outside it are the loop's
    boundaries, where the host may read: `begin` (the start step), the start of `run` (the
    host step count for preemption checks, read once) and `end` (stats, actions).
    """

    class Guarded(train_loop_lib.TrainLoop):
        def _get_next_batch(self, dataset):
            if not counter.counting:
                counter.counting = True
                self._guard.enter_context(jax.transfer_guard_device_to_host("disallow"))
            return super()._get_next_batch(dataset)

        def run(self, *args, **kw):
            with contextlib.ExitStack() as self._guard:
                try:
                    return super().run(*args, **kw)
                finally:
                    counter.counting = False

    return Guarded(**kwargs)


@pytest.mark.parametrize("spe, prefetch", [(1, 0), (1, 2), (4, 0), (4, 2)])
def test_no_host_read_while_steps_run(host_reads, spe, prefetch):
    step = make_step("dp")
    tl = guarded_train_loop(host_reads, step=step, steps_per_execution=spe)
    outer = outer_loop.OuterLoop(train_loop=tl, prefetch=prefetch)  # preemption checks on
    state, outputs = outer(step.initialize_model([1, 16]), forever(), train_total_steps=21,
                           train_loop_steps=7)
    assert int(state.step) == 21 and len(outputs["loss"]) == 7
    assert host_reads.count == 0


def test_host_read_counter_catches_a_per_step_sync(host_reads):
    class FloatLoss:
        interval = 1

        def __call__(self, state, outputs, **kwargs):
            float(outputs["loss"])

    step = make_step(end_actions=[FloatLoss()])
    tl = guarded_train_loop(host_reads, step=step)
    tl(step.initialize_model([1, 16]), forever(), num_steps=3)
    assert host_reads.count == 3


class SlowStep(ClassifierStep):
    """A step whose device time (a chain of 512x512 matmuls) dwarfs its dispatch time."""

    def run(self, state, batch):
        state, outputs = super().run(state, batch)
        h = jnp.full((512, 512), 1e-3) * jnp.mean(batch["x"])
        h = jax.lax.fori_loop(0, 60, lambda i, h: jnp.tanh(h @ h + 1e-3), h)
        outputs["loss"] = outputs["loss"] + 1e-30 * jnp.mean(h)
        return state, outputs


@pytest.mark.parametrize("spe", [1, 3])
def test_loop_returns_before_its_first_step_finishes(spe):
    """The strongest form: while `Loop.run` dispatches every step, the device is still on
    the first one, so the host waited for no step result of any kind (no read, no block)."""
    step = make_step(step_cls=SlowStep)
    state = step.initialize_model([1, 16])
    lp = loop.Loop(step, max_steps_in_flight=100, steps_per_execution=spe)
    # Compiles outside the run: the first execution's program (it keeps the caller's
    # state) and the one that consumes the loop's own.
    jax.block_until_ready(lp(state, forever(), num_steps=spe + 1))
    state = jax.block_until_ready(step.initialize_model([1, 16]))
    with preemption.handling_preemption():
        state, outputs = lp.run(state, forever(), num_steps=6)
        first_done = outputs["loss"][0].is_ready()
    jax.block_until_ready((state, outputs))
    assert not first_done
    assert int(state.step) == 6 and len(outputs["loss"]) == 6


# -- profiling -----------------------------------------------------------------------------


@pytest.mark.parametrize("spe", [1, 4])
def test_profile_action_writes_a_trace(tmp_path, spe):
    profile = profiling.ProfileAction(tmp_path, start_step=3, num_steps=2)
    step = make_step(begin_actions=[profile], end_actions=[profile])
    tl = train_loop_lib.TrainLoop(step, steps_per_execution=spe)
    state, _ = tl(step.initialize_model([1, 16]), forever(), num_steps=8)
    assert profile.done and int(state.step) == 8
    traces = glob.glob(os.path.join(tmp_path, "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
    tl(state, forever(), num_steps=8)  # traced once only
    assert len(glob.glob(os.path.join(tmp_path, "plugins", "profile", "*"))) == 1


def test_profile_action_cuts_fused_executions_at_its_range(tmp_path):
    profile = profiling.ProfileAction(tmp_path, start_step=3, num_steps=6)
    step = make_step(begin_actions=[profile], end_actions=[profile])
    lp = loop.Loop(step, steps_per_execution=4)
    sizes = []
    call_steps = step.call_steps
    step.call_steps = lambda state, batches, *a, **k: (
        sizes.append(len(batches)) or call_steps(state, batches, *a, **k))
    lp(step.initialize_model([1, 16]), forever(), num_steps=12)
    # Executions cut at the traced range 3-8: steps 1-2, 3-6, 7-8, 9-12.
    assert sizes == [2, 4, 2, 4]
    with pytest.raises(ValueError, match="start_step"):
        profiling.ProfileAction(tmp_path, start_step=0)
