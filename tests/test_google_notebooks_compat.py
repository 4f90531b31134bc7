"""What google/jaxloop's Colab notebooks write themselves, run against this package.

Jaxloop_Transformer_Training_Solution fine-tunes a pretrained LM with model parallelism:
a `SimpleTrainer` subclass whose ``__init__`` is google's own (it builds the parts through
the ``_build_actions`` and ``_setup`` hooks and sets ``_eval_loop`` and ``_outer_loop``), a
`TransformerStep` subclass that places the pretrained parameters on the 'model' axis itself
and builds its state with flax's ``TrainState.create`` (the step a Python int), and a
patched ``partition.SPMDPartitioner.shard_batch``. Here a tiny LM stands in for Gemma.
"""

from __future__ import annotations

import types as pytypes
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxloop import action_loop as action_loop_lib
from jaxloop import outer_loop, partition, types
from jaxloop import train_loop as train_loop_lib
from jaxloop.trainers import data_loader, simple_trainer, transformer_step

SEQ_LEN = 8
VOCAB = 16
BATCH_SIZE = 8  # 4 data shards x 2 rows


class TinyLM(nn.Module):
    """Called as gemma's models are (``tokens=``, ``cache=``), returning ``.logits``."""

    @nn.compact
    def __call__(self, tokens, cache=None):
        x = nn.Embed(VOCAB, 16)(tokens)
        x = nn.relu(nn.Dense(32)(x))
        return pytypes.SimpleNamespace(logits=nn.Dense(VOCAB)(x))


def pretrained_params():
    return TinyLM().init(jax.random.key(0), tokens=jnp.zeros((1, SEQ_LEN), jnp.int32))["params"]


def counting_samples(n=32):
    """Sequences where the next token is the current one plus one (mod VOCAB)."""
    return [np.arange(s, s + SEQ_LEN, dtype=np.int32) % VOCAB for s in range(n)]


def notebook_mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


class PretrainedLMStep(transformer_step.TransformerStep):
    """The notebook's Gemma3TransformerStep: starts from given parameters, placed on 'model'."""

    def __init__(self, *args, initial_params: Any = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._initial_params = initial_params

    def initialize_model(self, spec, log_num_params=False, **kwargs):
        mesh = self._partitioner.mesh

        def on_model_axis(leaf):
            axes = [None] * leaf.ndim
            axes[-1] = "model"  # the last axis of every parameter
            return NamedSharding(mesh, P(*axes))

        params = jax.device_put(self._initial_params,
                                jax.tree.map(on_model_axis, self._initial_params))
        # flax's TrainState.create: `step` is the Python int 0.
        return types.TrainState.create(apply_fn=self._model.apply, params=params,
                                       tx=self._optimizer)

    def _predict_and_compute_loss(self, state, input_features, output_features):
        self._validate_input_features(input_features)
        self._validate_output_features(output_features)

        def loss_and_logits(params):
            logits = state.apply_fn({"params": params}, tokens=input_features["input_ids"],
                                    cache=None).logits
            loss = self.loss_fn(logits, output_features["labels"],
                                input_features["attention_mask"])
            return loss, logits

        if self._train:
            (loss, logits), grads = jax.value_and_grad(loss_and_logits, has_aux=True)(
                state.params)
            state = state.apply_gradients(grads=grads)
        else:
            loss, logits = loss_and_logits(state.params)
        return state, loss, logits


class NotebookTrainer(simple_trainer.SimpleTrainer):
    """The notebook's ModifiedTrainer: google's SimpleTrainer.__init__, written out, with the
    optimizer and partitioner given to the eval step as well."""

    def __init__(self, model, epochs, steps_per_epoch, batch_spec, checkpointing_config=None,
                 summary_config=None, log_num_params=False, optimizer=None, partitioner=None,
                 step_class=transformer_step.TransformerStep,
                 train_loop_class=train_loop_lib.TrainLoop,
                 eval_loop_class=action_loop_lib.ActionLoop,
                 outer_loop_class=outer_loop.OuterLoop, base_prng=None,
                 additional_begin_actions=(), additional_end_actions=(), **kwargs):
        self._model = model
        self._epochs = epochs
        self._steps_per_epoch = steps_per_epoch
        self._batch_spec = batch_spec
        self._log_num_params = log_num_params
        self._checkpointing_config = checkpointing_config
        self._summary_config = summary_config
        base_prng = base_prng if base_prng is not None else {"params": jax.random.key(0)}
        self._train_step = step_class(model=model, base_prng=base_prng, train=True,
                                      optimizer=optimizer, partitioner=partitioner, **kwargs)
        begin_actions, end_actions = self._build_actions(additional_begin_actions,
                                                         additional_end_actions)
        self._train_loop = train_loop_class(step=self._train_step, begin_actions=begin_actions,
                                            end_actions=end_actions, **kwargs)
        self._eval_step = step_class(model=model, base_prng=base_prng, train=False,
                                     optimizer=optimizer, partitioner=partitioner, **kwargs)
        self._eval_loop = eval_loop_class(step=self._eval_step, **kwargs)
        checkpoint_spec = (checkpointing_config.checkpoint_spec
                           if checkpointing_config is not None else None)
        self._outer_loop = outer_loop_class(self._train_loop, checkpoint_spec=checkpoint_spec,
                                            **kwargs)
        self._setup(**kwargs)


@pytest.mark.slow
def test_the_transformer_notebooks_trainer_subclass_fine_tunes_params_placed_on_model():
    mesh = notebook_mesh()
    partitioner = partition.SPMDPartitioner(mesh=mesh, data_axis="data")
    params = pretrained_params()
    samples = counting_samples()
    batch_spec = jax.tree.map(
        lambda x: (x.shape, x.dtype),
        next(iter(data_loader.TransformerDataLoader(dataset=iter(samples),
                                                    batch_size=BATCH_SIZE))))
    trainer = NotebookTrainer(
        model=TinyLM(), epochs=2, steps_per_epoch=len(samples) // BATCH_SIZE,
        batch_spec=batch_spec,
        step_class=lambda *a, **k: PretrainedLMStep(*a, initial_params=params, **k),
        partitioner=partitioner, optimizer=optax.adam(3e-2),
        base_prng={"params": jax.random.key(42)},
    )
    assert isinstance(trainer.model_state.step, int)  # as TrainState.create left it
    kernel = trainer.model_state.params["Dense_0"]["kernel"]
    assert kernel.sharding.spec == P(None, "model")

    def held_out_loss(state):
        batch = next(iter(data_loader.TransformerDataLoader(dataset=iter(samples),
                                                            batch_size=BATCH_SIZE)))
        return float(trainer._eval_step(state, batch)[1]["loss"].compute())

    initial = held_out_loss(trainer.model_state)
    outer = trainer._outer_loop
    outputs = trainer.train(data_loader.TransformerDataLoader(dataset=iter(samples * 2),
                                                              batch_size=BATCH_SIZE))
    final = trainer.model_state
    assert trainer._outer_loop is outer  # train ran the outer loop the __init__ built
    assert int(final.step) == 8
    assert len(outputs["loss"]) == 4
    # The parameters stayed where the step put them; the rest followed the rule.
    assert final.params["Dense_0"]["kernel"].sharding.spec == P(None, "model")
    assert final.params["Dense_0"]["kernel"].sharding.mesh == mesh
    assert held_out_loss(final) < 0.5 * initial
    # The notebook's next cell gathers the parameters onto one device to evaluate there.
    one = NamedSharding(Mesh([jax.devices()[0]], ("data",)), P())
    gathered = jax.device_put(final.params, one)
    np.testing.assert_array_equal(jax.device_get(gathered["Dense_1"]["bias"]),
                                  jax.device_get(final.params["Dense_1"]["bias"]))


def test_the_notebooks_trainer_subclass_refuses_eval_specs_its_outer_loop_has_no_loop_for():
    # google's __init__ builds an outer loop without eval loops: an EvalSpec has nowhere to
    # run, which is said rather than skipped.
    trainer = NotebookTrainer(
        model=TinyLM(), epochs=1, steps_per_epoch=1,
        batch_spec={"input_features": {"input_ids": ([BATCH_SIZE, SEQ_LEN], "int32"),
                                       "attention_mask": ([BATCH_SIZE, SEQ_LEN], "int32")}},
        step_class=lambda *a, **k: PretrainedLMStep(*a, initial_params=pretrained_params(),
                                                    **k),
        partitioner=partition.SPMDPartitioner(notebook_mesh(), data_axis="data"),
        optimizer=optax.adam(1e-2),
    )
    loader = data_loader.TransformerDataLoader(dataset=iter(counting_samples(8)),
                                               batch_size=BATCH_SIZE)
    with pytest.raises(ValueError, match="0 eval loops but was given 1 eval specs"):
        trainer.train(loader, eval_specs=[outer_loop.EvalSpec(dataset=[])])
    assert int(trainer.model_state.step) == 0


def test_a_patched_spmd_shard_batch_places_the_steps_batches(monkeypatch):
    calls = []

    def notebook_shard_batch(self, batch):
        # The notebook's replacement: every array split on the data axis, built shard by
        # shard with jax.make_array_from_callback.
        calls.append(jax.tree.map(np.shape, batch))
        sharding = NamedSharding(self._mesh, P(self._data_axis))

        def place(x):
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

        return jax.tree.map(place, batch)

    monkeypatch.setattr(partition.SPMDPartitioner, "shard_batch", notebook_shard_batch)
    partitioner = partition.SPMDPartitioner(mesh=notebook_mesh(), data_axis="data")
    step = PretrainedLMStep(jax.random.key(0), TinyLM(), optimizer=optax.adam(1e-2),
                            partitioner=partitioner, train=True,
                            initial_params=pretrained_params())
    state = step.initialize_model(None)
    loop = train_loop_lib.TrainLoop(step)
    state, _ = loop(state, data_loader.TransformerDataLoader(
        dataset=iter(counting_samples(16)), batch_size=BATCH_SIZE), num_steps=2)
    assert int(state.step) == 2
    assert len(calls) == 2  # each batch was placed by the patched method
    assert calls[0]["input_features"]["input_ids"] == (BATCH_SIZE, SEQ_LEN)
