"""The second hour's smaller items (issue #37, 11), each as a user's script meets them: the
initialize_model hint for token batches, NonFiniteError's step numbers, logical constraints
on names missing from the rules, and where disable_jit came from."""

import itertools
import logging
import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, outer_loop, partition, train_loop
from jaxloop import step as step_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.diagnostics import debugging
from jaxloop.recipes import guard


class TokenLM(nn.Module):
    """The smallest language model: token ids in, next-token logits out."""

    vocab: int = 64

    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(self.vocab)(nn.Embed(self.vocab, 16)(tokens))


class LMStep(step_lib.Step):
    def run(self, state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}


def _tokens(n=8, length=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, size=(n, length + 1)).astype(np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_initialize_model_hint_for_a_token_batch_works_when_followed():
    step = LMStep(jax.random.key(0), TokenLM(), optax.adam(1e-3), train=True)
    # The user passes the whole batch's spec, as memory.estimate takes it.
    with pytest.raises(TypeError) as info:
        step.initialize_model({"tokens": ([8, 16], "int32"), "targets": ([8, 16], "int32")})
    hint = re.search(r"for 'tokens': (initialize_model\(.*?\));", str(info.value))
    assert hint, str(info.value)
    assert "int32" in hint.group(1)
    # Following the hint as written builds a state that trains on the token batches.
    state = eval(hint.group(1), {"initialize_model": step.initialize_model})
    state, out = step(state, _tokens())
    assert int(state.step) == 1 and np.isfinite(float(out["loss"]))


def test_initialize_model_bare_shape_for_token_ids_says_how_to_give_the_dtype():
    step = LMStep(jax.random.key(0), TokenLM(), optax.adam(1e-3), train=True)
    with pytest.raises(ValueError) as info:
        step.initialize_model([1, 16])  # float32 zeros into an embedding
    notes = "\n".join(getattr(info.value, "__notes__", []))
    hint = re.search(r"(initialize_model\(\(\[1, 16\], 'int32'\)\))", notes)
    assert hint, notes
    state = eval(hint.group(1), {"initialize_model": step.initialize_model})
    assert state.params["Embed_0"]["embedding"].shape == (64, 16)


class GuardedLMStep(LMStep):
    """The LM step with a `NonFiniteGuard('raise')` deciding each update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard = guard.NonFiniteGuard("raise")

    def run(self, state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["tokens"])
            # batch['scale'] is 1, or NaN in a corrupted batch.
            return batch["scale"][0] * optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state, outs = self.guard.apply_gradients(state, grads, loss)
        return state, {"loss": loss, **outs}


def test_non_finite_error_numbers_the_step_as_history_and_checkpoints_do(tmp_path):
    step = GuardedLMStep(jax.random.key(0), TokenLM(), optax.adam(1e-3), train=True)
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=5)
    tl = train_loop.TrainLoop(step, end_actions=[step.guard.action(),
                                                 actions.CheckpointAction(manager)])
    outer = outer_loop.OuterLoop(train_loop=tl)
    # The 5th batch is corrupted: the run's 5th step, state.step 5 after it.
    batches = [{**_tokens(seed=i), "scale": np.full((8,), np.nan if i == 4 else 1.0,
                                                   np.float32)} for i in range(6)]
    with pytest.raises(guard.NonFiniteError) as err:
        outer(step.initialize_model(([1, 16], "int32")), iter(batches), train_total_steps=6,
              train_loop_steps=2)
    manager.wait_until_finished()
    assert err.value.step == 5 and "training step 5:" in str(err.value)
    assert err.value.leaf == "loss"
    # The history (as TensorBoard) shows the NaN loss at the step the error names.
    losses = outer.history["train/loss"]
    assert [s for s, v in zip(*losses, strict=True) if np.isnan(v)] == [err.value.step]
    # The checkpoints are numbered the same way: after steps 2 and 4, none after the bad one.
    assert checkpoint.all_steps(tmp_path / "ckpt") == [2, 4]
    # Stepping by hand numbers it the same: the state after the bad step says 5 too.
    state = step.initialize_model(([1, 16], "int32"))
    for b in batches[:5]:
        state, out = step(state, b)
    with pytest.raises(guard.NonFiniteError) as by_hand:
        step.guard.check({k: [v] for k, v in out.items()}, int(state.step))
    assert by_hand.value.step == int(state.step) == 5
    manager.close()


RULES = [("batch", "data"), ("embed", None), ("mlp", "model")]


class ConstrainedMLP(nn.Module):
    """A MaxText-style block: the kernel and the activation both named logically."""

    kernel_names: tuple = ("embed", "mlp")
    activation_names: tuple = ("batch", "mlp")

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), self.kernel_names)
        h = nn.relu(nn.Dense(64, kernel_init=init)(x))
        h = partition.with_logical_constraint(h, self.activation_names)
        # Compile time: where the constraint put the activation.
        jax.debug.inspect_array_sharding(h, callback=SEEN.append)
        return nn.Dense(10)(h)


SEEN = []


def _spmd_step(model, rules=RULES):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    part = partition.SPMDPartitioner(mesh, data_axis="data", logical_axis_rules=rules)
    return ClassifierStep(jax.random.key(0), model, optax.adam(1e-2), partitioner=part,
                          train=True)


def test_logical_constraint_on_an_activation_raises_as_on_a_parameter():
    # A parameter named 'hidden', with no rule for it: an error naming it and the rules.
    step = _spmd_step(ConstrainedMLP(kernel_names=("embed", "hidden")))
    with pytest.raises(ValueError, match=r"\['hidden'\].*no logical axis rule") as param:
        step.initialize_model([1, 16])
    assert "('mlp', 'model')" in str(param.value)
    # The same name on an activation: the same kind of error, as the model is first traced.
    step = _spmd_step(ConstrainedMLP(activation_names=("batch", "hidden")))
    with pytest.raises(ValueError, match=r"\['hidden'\].*no logical axis rule") as act:
        step.initialize_model([1, 16])
    assert "('batch', 'hidden')" in str(act.value) and "('mlp', 'model')" in str(act.value)
    # No dtype hint: int32 zeros fail the same way, so that hint would not help.
    assert "int32" not in "".join(getattr(act.value, "__notes__", []))
    # A name the rules have constrains the activation: rows over 'data', units over 'model'.
    SEEN.clear()
    step = _spmd_step(ConstrainedMLP())
    state, out = step(step.initialize_model([1, 16]), toy_data(32))
    assert np.isfinite(float(out["loss"]))
    assert SEEN and SEEN[-1].spec == P("data", "model")


def _train_without_jit(disable_jit):
    step = ClassifierStep(jax.random.key(0), LinenMLP(hidden=8), optax.sgd(0.1), train=True)
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step), progress=False,
                                 disable_jit=disable_jit)
    data = toy_data(16, din=8)
    state, _ = outer(step.initialize_model([1, 8]), itertools.repeat(data),
                     train_total_steps=2, train_loop_steps=2)
    assert int(state.step) == 2


def test_disable_jit_says_where_the_switch_came_from(monkeypatch, caplog):
    def said():
        lines = [r.getMessage() for r in caplog.records if "jit is disabled" in r.getMessage()]
        caplog.clear()
        assert len(lines) == 1, lines
        return lines[0]

    caplog.set_level(logging.WARNING, logger="jaxloop")
    monkeypatch.delenv(debugging.ENV_DISABLE_JIT, raising=False)
    _train_without_jit(disable_jit=True)
    line = said()
    assert "disable_jit=True" in line and debugging.ENV_DISABLE_JIT not in line
    # The environment variable alone: the message names it.
    monkeypatch.setenv(debugging.ENV_DISABLE_JIT, "1")
    _train_without_jit(disable_jit=None)
    assert f"{debugging.ENV_DISABLE_JIT}=1 in the environment" in said()
    # Both: the argument is what decided.
    _train_without_jit(disable_jit=True)
    line = said()
    assert "disable_jit=True" in line and debugging.ENV_DISABLE_JIT not in line
