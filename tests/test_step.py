"""Step: linen and nnx models, the call order, compilation, flops, batch specs, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import XY, ClassifierStep, LinenMLP, NnxMLP, toy_data

from jaxloop import partition
from jaxloop import step as step_lib
from jaxloop.step import zeros_from_spec


def _train(step, state, data, n=20):
    losses = []
    for _ in range(n):
        state, out = step(state, data)
        losses.append(float(out["loss"]))
    return state, losses


def test_linen_step_lowers_loss():
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    state = step.initialize_model([1, 16])
    _, losses = _train(step, state, toy_data())
    assert losses[-1] < 0.5 * losses[0]
    assert step.num_params == 16 * 32 + 32 + 32 * 10 + 10


def test_nnx_trains_exactly_like_linen():
    linen_step = ClassifierStep(
        jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True
    )
    nnx_step = ClassifierStep(
        jax.random.key(0), NnxMLP, optimizer=optax.sgd(0.1), train=True,
        nnx_model_args=(16, 32, 10),
    )
    linen_state = linen_step.initialize_model([1, 16])
    nnx_state = nnx_step.initialize_model([1, 16])
    # Same starting point: copy linen's parameters into the nnx state (same layout).
    params = jax.tree.map(jnp.array, linen_state.params)
    nnx_state = nnx_state.replace(params=params, opt_state=nnx_step.optimizer.init(params))
    data = toy_data()
    _, linen_losses = _train(linen_step, linen_state, data, 10)
    _, nnx_losses = _train(nnx_step, nnx_state, data, 10)
    np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-6)
    assert linen_losses[-1] < linen_losses[0]


def test_nnx_with_batchnorm_updates_batch_stats():
    class BNNet(nnx.Module):
        def __init__(self, *, rngs):
            self.lin = nnx.Linear(16, 10, rngs=rngs)
            self.bn = nnx.BatchNorm(10, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    class BNStep(step_lib.Step):
        def run(self, state, batch):
            def loss_fn(params):
                logits, updates = state.apply_fn(
                    {"params": params, "batch_stats": state.batch_stats}, batch["x"],
                    mutable=["batch_stats"],
                )
                loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
                return loss.mean(), updates

            (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
            return state, {"loss": loss}

    step = BNStep(jax.random.key(1), BNNet, optimizer=optax.adam(1e-2), train=True,
                  nnx_model_args=())
    state = step.initialize_model([1, 16])
    before = np.asarray(state.batch_stats["bn"]["mean"])
    state, losses = _train(step, state, toy_data(), 15)
    assert losses[-1] < losses[0]
    assert not np.allclose(before, state.batch_stats["bn"]["mean"])


def test_begin_run_end_order_and_actions():
    calls = []

    class Recorder:
        interval = 1

        def __init__(self, name):
            self.name = name

        def __call__(self, state, outputs, **kwargs):
            calls.append(self.name)

    class OrderStep(ClassifierStep):
        def preprocess_batch(self, batch):
            calls.append("preprocess")
            assert isinstance(batch["x"], np.ndarray)
            return batch

        def begin(self, state, batch):
            calls.append("begin")
            assert isinstance(batch["x"], jax.Array)  # sharded before begin
            return state, batch

        def run(self, state, batch):
            calls.append("run(trace)")
            return super().run(state, batch)

        def end(self, state, outputs):
            calls.append("end")
            return state, outputs

    step = OrderStep(jax.random.key(0), LinenMLP(), train=True,
                     begin_actions=[Recorder("begin_action")],
                     end_actions=[Recorder("end_action")])
    state = step.initialize_model([1, 16])
    state, _ = step(state, toy_data(8), 1)
    state, _ = step(state, toy_data(8), 2)
    one = ["preprocess", "begin_action", "begin", "run(trace)", "end", "end_action"]
    assert calls == one + [c for c in one if c != "run(trace)"]  # compiled once


def test_compile_flags_and_flops():
    step = ClassifierStep(jax.random.key(0), LinenMLP(), train=False)
    step.compile(keep_unused=True)
    state = step.initialize_model([1, 16])
    _, out = step(state, toy_data(8), log_num_flops=True)
    assert step.num_flops > 0
    assert out["logits"].shape == (8, 10)
    with pytest.raises(TypeError):
        step.compile(not_a_jit_flag=True)


def test_prng_key_is_deterministic_per_step():
    step = ClassifierStep(jax.random.key(3), LinenMLP())
    k5, k5b, k6 = step.prng_key(5), step.prng_key(5), step.prng_key(6)
    assert jnp.array_equal(jax.random.key_data(k5), jax.random.key_data(k5b))
    assert not jnp.array_equal(jax.random.key_data(k5), jax.random.key_data(k6))
    multi = ClassifierStep({"dropout": jax.random.key(1), "noise": jax.random.key(2)},
                           LinenMLP())
    keys = multi.prng_key(7)
    assert set(keys) == {"dropout", "noise"}
    again = multi.prng_key(7)
    assert jnp.array_equal(jax.random.key_data(keys["noise"]),
                           jax.random.key_data(again["noise"]))


def test_mixed_dtype_specs_namedtuples_and_nested_dicts():
    spec = {
        "a": ([2, 3], "float16"),
        "b": {"c": ([2], jnp.bfloat16), "d": [2, 4]},
        "e": XY(x=[2, 1], y=([2], np.int32)),
    }
    zeros = zeros_from_spec(spec)
    assert zeros["a"].dtype == np.float16 and zeros["a"].shape == (2, 3)
    assert zeros["b"]["c"].dtype == jnp.bfloat16
    assert zeros["b"]["d"].dtype == np.float32
    assert isinstance(zeros["e"], XY) and zeros["e"].y.dtype == np.int32

    class MixedStep(step_lib.Step):
        def run(self, state, batch):
            x = batch.x.astype(jnp.float32)
            logits = state.apply_fn({"params": state.params}, x)
            total = logits.sum() + batch.y.astype(jnp.float32).sum()
            return state, {"total": total, "y": batch.y}

    step = MixedStep(jax.random.key(0), LinenMLP())
    state = step.initialize_model(([1, 16], "bfloat16"))
    batch = XY(x=np.ones((4, 16), jnp.bfloat16), y=np.ones((4,), np.float16))
    _, out = step(state, batch)
    assert out["y"].dtype == np.float16 and np.isfinite(float(out["total"]))


@pytest.mark.parametrize("spec, match", [
    ("not a spec", "is 'not a spec'"),
    ({"image": [1, -2]}, r"spec\['image'\]"),
    ([[1, 2], "not_a_dtype"], "not a dtype"),
    ({"a": [[1, 2], "float32"], "b": 3.5}, r"spec\['b'\] is 3.5"),
])
def test_malformed_spec_is_a_clear_error(spec, match):
    step = ClassifierStep(jax.random.key(0), LinenMLP())
    with pytest.raises(ValueError, match=match):
        step.initialize_model(spec)


def test_nnx_and_linen_argument_mistakes():
    with pytest.raises(ValueError, match="nnx_model_args"):
        ClassifierStep(jax.random.key(0), NnxMLP)
    with pytest.raises(ValueError, match="only for nnx module classes"):
        ClassifierStep(jax.random.key(0), LinenMLP(), nnx_model_args=(1,))
    with pytest.raises(ValueError, match="only for nnx module classes"):
        ClassifierStep(jax.random.key(0), LinenMLP(), hidden=3)
    with pytest.raises(TypeError, match="model must be"):
        ClassifierStep(jax.random.key(0), LinenMLP)


def test_non_divisible_batch_names_leaf_shape_and_devices():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    step = ClassifierStep(jax.random.key(0), LinenMLP(),
                          partitioner=partition.DataParallelPartitioner(mesh, "data"))
    state = step.initialize_model([1, 16])
    with pytest.raises(ValueError, match=r"\['x'\] has shape \(12, 16\).*8 local devices"):
        step(state, toy_data(12))


def test_restore_model_without_checkpoint_returns_state(tmp_path, caplog):
    step = ClassifierStep(jax.random.key(0), LinenMLP())
    state = step.initialize_model([1, 16])
    with caplog.at_level("INFO"):
        restored = step.restore_model(state, tmp_path / "none")
    assert restored is state
    assert "No checkpoint" in caplog.text


def test_restore_model_round_trip_and_shape_mismatch(tmp_path):
    from jaxloop.checkpointing import checkpoint

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.FSDPPartitioner(mesh, "data", min_weight_size=64)
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          partitioner=part, train=True)
    state = step.initialize_model([1, 16])
    state, _ = step(state, toy_data(16))
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    checkpoint.save(manager, int(state.step), state, dataset_state={"next_batch": 1})
    manager.wait_until_finished()
    fresh = step.initialize_model([1, 16])
    restored = step.restore_model(fresh, tmp_path / "ckpt")
    assert int(restored.step) == 1
    assert checkpoint.read_meta(tmp_path / "ckpt", 1)["dataset_state"] == {"next_batch": 1}
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    wider = ClassifierStep(jax.random.key(0), LinenMLP(hidden=48), optimizer=optax.adam(1e-2),
                           partitioner=part)
    mismatch = r"dense1/\S+ has shape \((16, )?32,?\), but the state expects \((16, )?48,?\)"
    with pytest.raises(ValueError, match=mismatch):
        wider.restore_model(wider.initialize_model([1, 16]), tmp_path / "ckpt")


class _CompileCounter:
    """Counts XLA compilations (jax.monitoring's backend-compile events) while active."""

    active: "_CompileCounter | None" = None
    registered = False

    def __init__(self):
        self.count = 0

    def __enter__(self):
        if not _CompileCounter.registered:
            jax.monitoring.register_event_duration_secs_listener(_CompileCounter._listen)
            _CompileCounter.registered = True
        _CompileCounter.active = self
        return self

    def __exit__(self, *exc):
        _CompileCounter.active = None

    @staticmethod
    def _listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and _CompileCounter.active:
            _CompileCounter.active.count += 1


@pytest.mark.parametrize("devices", [8, 1])
def test_begin_actions_and_flops_compile_one_program(devices):
    # On one device the steps without a firing action hand the program the host batch
    # (jit copies it), the others a placed one: still one program.
    seen = []

    class EveryOther:
        interval = 2

        def __call__(self, state, outputs, batch=None, **kwargs):
            seen.append(type(batch["x"]).__name__)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          partitioner=partition.DataParallelPartitioner(mesh, "data"),
                          train=True, begin_actions=[EveryOther()])
    state = step.initialize_model([1, 16])
    data = toy_data(16)
    step.prepare_batch(data)  # on one device placing compiles an identity: not counted
    with _CompileCounter() as compiles:
        for n in range(1, 5):
            state, out = step(state, data, n, log_num_flops=n == 1)
        jax.block_until_ready(out)
    assert compiles.count == 1
    assert seen == ["ArrayImpl", "ArrayImpl"]  # actions got the batch on the devices
    assert step.num_flops > 0


def _flops(partitioner):
    step = ClassifierStep(jax.random.key(0), LinenMLP(hidden=64), optimizer=optax.sgd(0.1),
                          partitioner=partitioner, train=True)
    state = step.initialize_model([1, 16])
    step(state, toy_data(32), log_num_flops=True)
    return step.num_flops


def test_num_flops_are_the_compiled_per_device_figure():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    single = _flops(partition.SingleDevicePartitioner())
    dp = _flops(partition.DataParallelPartitioner(mesh, "data"))
    spmd = _flops(partition.SPMDPartitioner(
        jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model")), "data"))
    # Forward and backward of a 16-64-10 MLP on 32 examples: 4 to 6 flops per weight per
    # example (2 forward, 2 for weight gradients, 2 for the hidden layer's input gradient).
    weights = 16 * 64 + 64 * 10
    assert 4 * weights * 32 <= single < 2 * 6 * weights * 32
    # One device's share: the batch split 8 (data parallel) or 4 ways (the 4x2 mesh's data
    # axis), plus each device's copy of the optimizer update.
    assert single / 8 <= dp < single / 8 + 4 * weights
    assert single / 8 <= spmd < single / 4 + 4 * weights


class TracedStep(ClassifierStep):
    """Counts how often `run` is traced (once per compile)."""

    traces = 0

    def run(self, state, batch):
        TracedStep.traces += 1
        state, outputs = super().run(state, {"x": batch["x"], "y": batch["y"]})
        if "mask" in batch:
            outputs["masked"] = jnp.sum(batch["mask"])
        return state, outputs


def test_alternating_batch_structures_compile_once_each():
    from jaxloop import eval_loop

    step = TracedStep(jax.random.key(0), LinenMLP())
    state = step.initialize_model([1, 16])
    data = toy_data(8)
    masked = dict(data, mask=np.ones(8, np.float32))
    loop = eval_loop.EvalLoop(step)
    TracedStep.traces = 0
    for i in range(6):  # an eval alternating two datasets, one with a mask
        _, outputs = loop(state, iter([masked if i % 2 else data] * 2))
        assert ("masked" in outputs) == bool(i % 2)
    assert TracedStep.traces == 2
