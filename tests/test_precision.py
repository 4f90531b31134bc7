"""Mixed precision: params stay float32, the model computes in bfloat16, outputs are float32,
for linen and nnx models alike, without editing the models."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import ClassifierStep, LinenMLP, NnxMLP, toy_data
from test_digits import run_digits

from jaxloop import partition
from jaxloop import step as step_lib
from jaxloop.recipes import precision

BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)
MATMULS = ("dot_general", "conv_general_dilated")


def _sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, list | tuple) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def matmul_operand_dtypes(jaxpr) -> set:
    """The dtypes of every matmul/convolution operand in a jaxpr (nested ones included)."""
    dtypes = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in MATMULS:
            dtypes.update(v.aval.dtype for v in eqn.invars)
        for sub in _sub_jaxprs(eqn.params):
            dtypes |= matmul_operand_dtypes(sub)
    return dtypes


def _train(step, data, spec, num_steps=30):
    state = step.initialize_model(spec)
    losses = []
    for _ in range(num_steps):
        state, out = step(state, data)
        losses.append(out["loss"])
    return state, out, np.asarray(jax.device_get(losses))


def _models():
    return {
        "linen": (LinenMLP(), {}),
        "nnx": (NnxMLP, {"nnx_model_args": (16, 32, 10)}),
    }


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_bfloat16_trains_with_float32_params_and_bfloat16_matmuls(kind):
    data = toy_data(n=64)
    model, kwargs = _models()[kind]
    runs = {}
    for policy in (None, "bfloat16"):
        step = ClassifierStep(jax.random.key(0), model, optimizer=optax.adam(1e-2), train=True,
                              dtype_policy=policy, **kwargs)
        runs[policy] = state, out, losses = _train(step, data, [1, 16])
        # Parameters and the optimizer's moments stay float32 under either policy.
        assert {x.dtype for x in jax.tree.leaves(state.params)} == {F32}
        assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {F32}
        # Logits (the model's output) and the loss come back float32.
        assert out["logits"].dtype == F32 and out["loss"].dtype == F32
        assert losses[-1] < 0.5 * losses[0]
        jaxpr = jax.make_jaxpr(state.apply_fn)({"params": state.params}, data["x"]).jaxpr
        expected = {F32} if policy is None else {BF16}
        assert matmul_operand_dtypes(jaxpr) == expected
        # Gradients reach the float32 parameters as float32.
        apply_fn = state.apply_fn
        grads = jax.grad(lambda p, f=apply_fn: f({"params": p}, data["x"]).sum())(state.params)
        assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    f32_losses, bf16_losses = runs[None][2], runs["bfloat16"][2]
    np.testing.assert_allclose(bf16_losses, f32_losses, rtol=0.05, atol=0.02)
    assert not np.array_equal(bf16_losses, f32_losses)  # it really computed in bfloat16


def test_no_policy_leaves_the_model_untouched_and_float32_policy_is_bit_identical():
    data = toy_data(n=64)
    model = LinenMLP()
    plain = ClassifierStep(jax.random.key(0), model, optimizer=optax.adam(1e-2), train=True)
    full = ClassifierStep(jax.random.key(0), model, optimizer=optax.adam(1e-2), train=True,
                          dtype_policy=precision.Policy())
    assert plain.dtype_policy is None
    state_plain, _, losses_plain = _train(plain, data, [1, 16], num_steps=5)
    assert state_plain.apply_fn == model.apply  # not wrapped at all
    state_full, _, losses_full = _train(full, data, [1, 16], num_steps=5)
    np.testing.assert_array_equal(losses_plain, losses_full)
    for a, b in zip(jax.tree.leaves(state_plain.params), jax.tree.leaves(state_full.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class LinenBNDropout(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
        return nn.Dense(10)(x)


class NnxBNDropout(nnx.Module):
    def __init__(self, *, rngs):
        self.dense1 = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.dense2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.drop(nnx.relu(self.bn(self.dense1(x)))))


class BNStep(step_lib.Step):
    def run(self, state, batch):
        x, y = batch["x"], batch["y"]

        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, x, train=self.train,
                rngs={"dropout": self.prng_key(state.step)}, mutable=["batch_stats"],
            ) if self.linen else state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, x,
                rngs={"dropout": self.prng_key(state.step)}, mutable=["batch_stats"],
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, (logits, updates)

        (loss, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params)
        state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
        return state, {"loss": loss, "logits": logits}


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_batch_stats_stay_float32_under_bfloat16(kind):
    data = toy_data(n=64)
    if kind == "linen":
        step = BNStep(jax.random.key(0), LinenBNDropout(), optimizer=optax.adam(1e-2),
                      train=True, dtype_policy="bfloat16")
    else:
        step = BNStep(jax.random.key(0), NnxBNDropout, optimizer=optax.adam(1e-2),
                      train=True, dtype_policy="bfloat16", nnx_model_args=())
    step.linen = kind == "linen"
    state, out, losses = _train(step, data, [1, 16], num_steps=20)
    assert {x.dtype for x in jax.tree.leaves(state.batch_stats)} == {F32}
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {F32}
    assert out["logits"].dtype == F32
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    # The running statistics moved away from their initial values (mean 0, var 1).
    assert any(np.abs(np.asarray(x) - x0).max() > 1e-3 for x, x0 in zip(
        jax.tree.leaves(state.batch_stats), (0.0, 1.0), strict=True))


def test_bfloat16_under_fsdp_on_8_devices_keeps_the_sharding():
    data = toy_data(n=64)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    partitioner = partition.FSDPPartitioner(mesh, "data", min_weight_size=2**8)
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                          train=True, partitioner=partitioner, dtype_policy="bfloat16")
    state, out, losses = _train(step, data, [1, 16], num_steps=10)
    kernel = state.params["dense1"]["kernel"]
    assert kernel.dtype == F32
    assert kernel.addressable_shards[0].data.size == kernel.size // 8  # still split 8 ways
    assert out["loss"].dtype == F32 and losses[-1] < losses[0]


def test_integer_inputs_are_not_cast():
    seen = []

    class Embedder(nn.Module):
        @nn.compact
        def __call__(self, tokens, scale=1.0):
            seen.append((tokens.dtype, getattr(scale, "dtype", None)))
            return nn.Embed(20, 8)(tokens) * scale

    step = step_lib.Step(jax.random.key(0), Embedder(), dtype_policy="bfloat16")
    state = step.initialize_model(([2, 3], "int32"))  # (scale's default is only for init)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {F32}
    seen.clear()
    out = state.apply_fn({"params": state.params}, jnp.arange(6).reshape(2, 3),
                         scale=jnp.float32(2.0))
    # Token ids stay integers; floating keyword arguments are cast like inputs.
    assert seen == [(jnp.dtype(jnp.int32), BF16)]
    assert out.dtype == F32 and out.shape == (2, 3, 8)


def test_policies_from_strings_and_clear_errors():
    mixed = precision.Policy(compute_dtype=jnp.bfloat16)
    assert precision.get_policy("bfloat16") == mixed
    assert precision.get_policy("params=float32,compute=bfloat16,output=float32") == mixed
    assert precision.get_policy("float32") == precision.Policy()
    assert precision.get_policy(None) is None
    assert str(mixed) == "params=float32,compute=bfloat16,output=float32"
    # Equal policies wrap one function into equal apply_fns (one state tree structure).
    module = LinenMLP()
    assert mixed.wrap_apply(module.apply) == precision.get_policy("bfloat16").wrap_apply(
        module.apply)
    with pytest.raises(ValueError, match="compute_dtype=int32 is not a floating dtype"):
        precision.Policy(compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match="part 'weights=bfloat16' is not one of"):
        precision.get_policy("weights=bfloat16")
    with pytest.raises(ValueError, match="compute_dtype='bfloat61' is not a dtype"):
        precision.get_policy("bfloat61")
    with pytest.raises(TypeError, match="must be a Policy, a string or None"):
        step_lib.Step(jax.random.key(0), LinenMLP(), dtype_policy=16)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_digits_trains_in_bfloat16_to_the_accuracy_bar(tmp_path):
    # 300 steps (half the default run) reach 0.97 in bfloat16 on the held-out 20%.
    step, accuracy, loss, _ = run_digits(
        tmp_path, "--precision", "bfloat16", "--train-steps", "300")
    assert step == 300
    assert accuracy >= 0.95 and loss < 0.3
