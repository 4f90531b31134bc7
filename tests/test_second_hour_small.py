"""The second hour's smaller items (issue #37, 11), each as a user's script meets them: the
initialize_model hint for token batches, NonFiniteError's step numbers, logical constraints
on names missing from the rules, and where disable_jit came from."""

import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from jaxloop import step as step_lib


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
    # The user passes the whole batch's spec, as memory_estimate takes it.
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
