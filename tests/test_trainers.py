"""jaxloop.trainers: SimpleTrainer, SimpleStep, TransformerStep, data loaders, preprocessors.

Each test drives the public API the way a google/jaxloop user would, and several check the
reference's bugs stay fixed: resuming, evaluating, shared defaults, the eval step's
partitioner, unknown keywords, per-step dropout keys, BatchNorm statistics and eval steps
that advance the step.
"""

from __future__ import annotations

import re

import clu.metrics as clu_metrics
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from jaxloop import actions, outer_loop, partition
from jaxloop import train_loop as train_loop_lib
from jaxloop.trainers import (
    PADDING_TOKEN,
    CheckpointingConfig,
    DataPreprocessor,
    DataPreprocessorBuilder,
    SimpleDataLoader,
    SimpleStep,
    SimpleTrainer,
    SummaryConfig,
    TrainerDataLoader,
    TransformerDataLoader,
    TransformerStep,
)

pytestmark = pytest.mark.timeout(120)

SPEC = {"input_features": [8, 3], "output_features": [8, 1]}


class MLP(nn.Module):
    """Three small dense layers, optionally with dropout (the reference test's model)."""

    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = True):
        for _ in range(2):
            x = nn.relu(nn.Dense(16)(x))
            if self.dropout:
                x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(1)(x)


class DropoutProbe(nn.Module):
    """Returns its dropout mask (scaled) on a ones input: shows which key a step used."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        scale = self.param("scale", nn.initializers.ones, (1,))
        return nn.Dropout(0.5, deterministic=not train)(jnp.ones_like(x)) * scale


class BatchNormModel(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        return nn.Dense(1)(x)


def regression_batches(n_batches, batch_size=8, seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    w = np.array([[1.0], [-2.0], [0.5]], np.float32)
    out = []
    for _ in range(n_batches):
        x = rng.normal(size=(batch_size, 3)).astype(np.float32) + offset
        out.append({"input_features": x, "output_features": (x @ w).astype(np.float32)})
    return out


def params_close(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.allclose(x, y), a, b)))


# -- SimpleTrainer ---------------------------------------------------------------------------


def test_trains_epochs_times_steps_and_returns_last_loop_outputs():
    batches = regression_batches(12)
    trainer = SimpleTrainer(MLP(), epochs=4, steps_per_epoch=3, batch_spec=SPEC,
                            optimizer=optax.adam(3e-2))

    def eval_loss():
        return float(np.mean([
            trainer.eval_step(trainer.model_state, b)[1]["loss"].compute() for b in batches
        ]))

    initial = eval_loss()
    outputs = trainer.train(batches)
    assert int(trainer.model_state.step) == 12
    assert eval_loss() < 0.5 * initial
    assert len(outputs["output_features_pred"]) == 3
    assert outputs["output_features_pred"][0].shape == (8, 1)


def test_train_outputs_hold_one_loss_per_step_of_the_last_epoch():
    # google/jaxloop users call len() on outputs['loss'] and index it: one clu Average per
    # step of the last train loop.
    trainer = SimpleTrainer(MLP(), epochs=2, steps_per_epoch=3, batch_spec=SPEC,
                            optimizer=optax.adam(3e-2))
    outputs = trainer.train(regression_batches(6))
    assert len(outputs["loss"]) == 3
    assert all(isinstance(loss, clu_metrics.Average) for loss in outputs["loss"])
    assert [int(loss.count) for loss in outputs["loss"]] == [1, 1, 1]
    assert np.isfinite(outputs["loss"][-1].compute())


def test_initializes_from_the_input_features_only():
    # The output spec's shape is irrelevant to the parameters.
    trainer = SimpleTrainer(MLP(), epochs=1, steps_per_epoch=1,
                            batch_spec={"input_features": [2, 5], "output_features": [7, 9]})
    kernel = trainer.model_state.params["Dense_0"]["kernel"]
    assert kernel.shape == (5, 16)
    # Model init keyword arguments (flax linen) are passed on by SimpleStep.
    step = SimpleStep(jax.random.key(0), MLP(dropout=0.5), train=True)
    state = step.initialize_model(SPEC, train=False)  # no dropout key needed at init
    assert state.params["Dense_0"]["kernel"].shape == (3, 16)


def test_eval_specs_evaluate_without_advancing_the_step(tmp_path):
    train = regression_batches(6)
    evals = regression_batches(2, seed=1)
    trainer = SimpleTrainer(MLP(), epochs=2, steps_per_epoch=3, batch_spec=SPEC,
                            summary_config=SummaryConfig(tmp_path / "tb"))  # asynchronous
    trainer.train(train, eval_specs=[outer_loop.EvalSpec(dataset=evals)])
    assert int(trainer.model_state.step) == 6
    trainer.close()  # waits for the writer threads
    eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = eam.EventAccumulator(str(tmp_path / "tb" / "eval"), size_guidance={eam.SCALARS: 0})
    acc.Reload()
    eval_losses = acc.Scalars("loss")
    assert [e.step for e in eval_losses] == [3, 6]  # after each epoch, at the train step
    # The logged eval loss is the mean over the eval batches with the state at that step.
    expected = np.mean([
        trainer.eval_step(trainer.model_state, b)[1]["loss"].compute() for b in evals
    ])
    assert eval_losses[-1].value == pytest.approx(float(expected), rel=1e-5)
    train_acc = eam.EventAccumulator(str(tmp_path / "tb" / "train"),
                                     size_guidance={eam.SCALARS: 0})
    train_acc.Reload()
    assert [e.step for e in train_acc.Scalars("loss")] == [3, 6]


def test_eval_step_never_changes_the_state():
    step = SimpleStep(jax.random.key(0), MLP(), train=False)
    state = step.initialize_model(SPEC)
    new_state, outputs = step(state, regression_batches(1)[0])
    assert int(new_state.step) == int(state.step) == 0
    assert params_close(new_state.params, state.params)
    assert outputs["output_features_pred"].shape == (8, 1)


def test_step_with_an_optimizer_and_no_train_argument_trains():
    # google/jaxloop's test_step_with_prng_list: a dict of keys, an optimizer, no train=.
    step = SimpleStep({"params": jax.random.key(0), "others": jax.random.key(1)}, MLP(),
                      optimizer=optax.adam(3e-2))
    assert step.train
    state = step.initialize_model(SPEC)
    batch = regression_batches(1)[0]
    state, first = step(state, batch)
    assert int(state.step) == 1
    for _ in range(3):
        state, outputs = step(state, batch)
    assert int(state.step) == 4
    assert outputs["loss"].compute() < first["loss"].compute()
    # Without an optimizer the step still evaluates (and leaves the state as it is).
    assert not SimpleStep(jax.random.key(0), MLP()).train


def test_second_trainer_on_the_same_directory_resumes(tmp_path):
    batches = regression_batches(3)

    def make(epochs, directory):
        return SimpleTrainer(
            MLP(), epochs=epochs, steps_per_epoch=3, batch_spec=SPEC,
            optimizer=optax.adam(1e-2),
            checkpointing_config=CheckpointingConfig(directory, max_checkpoints=2),
        )

    first = make(1, tmp_path / "run")
    first.train(batches)
    first.close()
    assert int(first.model_state.step) == 3
    # A new trainer (a restarted job) with two epochs and only one epoch of data: it
    # resumes at step 3, so one epoch of data brings it to step 6.
    second = make(2, tmp_path / "run")
    assert int(second.model_state.step) == 0
    second.train(batches)
    second.close()
    assert int(second.model_state.step) == 6
    # Same result as one uninterrupted run over the same six batches (optimizer state too).
    straight = make(2, tmp_path / "straight")
    straight.train(batches + batches)
    straight.close()
    assert params_close(second.model_state.params, straight.model_state.params)
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.isdigit()) == ["3", "6"]


def test_no_shared_mutable_defaults():
    extra_end = [actions.StepNumberAction(_ListWriter())]
    t1 = SimpleTrainer(MLP(), epochs=1, steps_per_epoch=1, batch_spec=SPEC,
                       additional_end_actions=extra_end,
                       checkpointing_config=None)
    t2 = SimpleTrainer(MLP(), epochs=1, steps_per_epoch=1, batch_spec=SPEC)
    assert len(extra_end) == 1  # the user's list is not appended to
    assert t1.train_loop.end_actions == extra_end
    assert t2.train_loop.end_actions == []  # nothing leaked from t1
    assert t1.train_step.optimizer is not t2.train_step.optimizer
    assert t1.train_step.partitioner is not t2.train_step.partitioner


class _ListWriter:
    def __init__(self):
        self.steps = []

    def write(self, step_number):
        self.steps.append(step_number)


def test_eval_step_gets_the_trainers_partitioner():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    dp = partition.DataParallelPartitioner(mesh, "data")
    trainer = SimpleTrainer(MLP(), epochs=1, steps_per_epoch=2, batch_spec=SPEC, partitioner=dp)
    assert trainer.train_step.partitioner is dp
    assert trainer.eval_step.partitioner is dp
    outputs = trainer.train(regression_batches(2),
                            eval_specs=[outer_loop.EvalSpec(dataset=regression_batches(1))])
    assert int(trainer.model_state.step) == 2
    assert outputs["output_features_pred"][0].sharding.mesh.shape == {"data": 8}
    # google/jaxloop spells the argument `partioner`; that works too.
    other = SimpleTrainer(MLP(), epochs=1, steps_per_epoch=1, batch_spec=SPEC, partioner=dp)
    assert other.eval_step.partitioner is dp


def test_keyword_arguments_are_routed_by_name_and_unknown_ones_raise():
    trainer = SimpleTrainer(MLP(), epochs=2, steps_per_epoch=4, batch_spec=SPEC,
                            steps_per_execution=2, progress=False, global_batch_size=8)
    assert trainer.train_loop.steps_per_execution == 2
    trainer.train(regression_batches(8))
    assert int(trainer.model_state.step) == 8
    assert "jaxloop/examples_per_sec" in trainer.train_loop.stats  # global_batch_size reached it
    with pytest.raises(TypeError, match="'learning_rate'"):
        SimpleTrainer(MLP(), epochs=1, steps_per_epoch=1, batch_spec=SPEC, learning_rate=0.1)
    with pytest.raises(TypeError, match="additional_end_actions"):
        SimpleTrainer(MLP(), epochs=1, steps_per_epoch=1, batch_spec=SPEC, end_actions=[])
    with pytest.raises(TypeError, match="'train'"):
        SimpleTrainer(MLP(), epochs=1, steps_per_epoch=1, batch_spec=SPEC, train=False)
    with pytest.raises(ValueError, match="epochs"):
        SimpleTrainer(MLP(), epochs=0, steps_per_epoch=1, batch_spec=SPEC)
    with pytest.raises(TypeError, match="step_class"):
        SimpleTrainer(MLP(), epochs=1, steps_per_epoch=1, batch_spec=SPEC, step_class=dict)


class CountingTrainLoop(train_loop_lib.TrainLoop):
    def __init__(self, step, *args, label="", **kwargs):
        super().__init__(step, *args, **kwargs)
        self.label = label
        self.ends = 0

    def end(self, state, outputs):
        self.ends += 1
        return super().end(state, outputs)


class ScaledLossStep(SimpleStep):
    def __init__(self, *args, loss_scale: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_scale = loss_scale

    def loss_fn(self, pred, target):
        return self.loss_scale * super().loss_fn(pred, target)


def test_custom_step_and_loop_classes_get_their_keywords():
    trainer = SimpleTrainer(MLP(), epochs=2, steps_per_epoch=2, batch_spec=SPEC,
                            step_class=ScaledLossStep, train_loop_class=CountingTrainLoop,
                            loss_scale=0.0, label="mine")
    assert trainer.train_step.loss_scale == trainer.eval_step.loss_scale == 0.0
    assert trainer.train_loop.label == "mine"
    before = jax.device_get(trainer.model_state.params)  # training donates the state
    trainer.train(regression_batches(4))
    assert trainer.train_loop.ends == 2
    # A zero loss has zero gradients: adam leaves the parameters where they were.
    assert params_close(trainer.model_state.params, before)


class EpochEnds(actions.Action):
    def __init__(self):
        super().__init__(interval=1)
        self.steps = []

    def __call__(self, state, outputs, **kwargs):
        self.steps.append(int(state.step))


class CountingOuterLoop(outer_loop.OuterLoop):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)


def test_subclass_hooks_and_attributes_are_googles():
    # google/jaxloop's SimpleTrainer builds its parts through `_build_actions` and `_setup`
    # and trains by calling `_outer_loop`; its notebooks' subclasses rely on that.
    ends = EpochEnds()
    warm = jax.device_get(SimpleTrainer(MLP(), epochs=1, steps_per_epoch=1,
                                        batch_spec=SPEC).model_state.params)
    warm = jax.tree.map(lambda x: x + 0.5, warm)  # "pretrained" parameters

    class WarmStartTrainer(SimpleTrainer):
        def _build_actions(self, additional_begin_actions, additional_end_actions):
            begin, end = super()._build_actions(additional_begin_actions,
                                                additional_end_actions)
            return begin, [*end, ends]

        def _setup(self, **kwargs):
            super()._setup(**kwargs)
            self._model_state = self._model_state.replace(params=warm)

    trainer = WarmStartTrainer(MLP(), epochs=4, steps_per_epoch=2, batch_spec=SPEC,
                               optimizer=optax.adam(1e-2))
    assert params_close(trainer.model_state.params, warm)
    assert trainer._train_loop is trainer.train_loop
    assert trainer.train_loop.end_actions == [ends]
    # `_eval_loop` is the eval loop on the eval step (an attribute, as google's).
    assert trainer._eval_loop.step is trainer.eval_step
    # `train` runs `_outer_loop`: one the subclass swapped in is the one that trains (here
    # until the data runs out, half way).
    trainer._outer_loop = CountingOuterLoop(trainer._train_loop)
    trainer.train(regression_batches(4))
    assert trainer._outer_loop.calls == 1
    assert ends.steps[:2] == [2, 4]
    # The next cell goes on from there; its EvalSpec runs on `_eval_loop`.
    trainer.train(regression_batches(4, seed=1),
                  eval_specs=[outer_loop.EvalSpec(dataset=regression_batches(1, seed=2))])
    assert int(trainer.model_state.step) == 8
    assert ends.steps[-2:] == [6, 8]
    assert trainer.eval_loops == [trainer._eval_loop]
    assert trainer._eval_loop.num_steps_run == 1  # the last evaluation's one batch


def test_dropout_keys_differ_per_step_and_are_reproducible():
    def masks(seed):
        step = SimpleStep({"params": jax.random.key(0), "dropout": jax.random.key(seed)},
                          DropoutProbe(), optimizer=optax.sgd(0.0), train=True)
        state = step.initialize_model(SPEC)
        out = []
        for batch in regression_batches(3):
            batch = {**batch, "output_features": np.zeros((8, 3), np.float32)}
            state, outputs = step(state, batch)
            out.append(np.asarray(outputs["output_features_pred"]))
        return out

    a, b = masks(1), masks(1)
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(a[1], a[2])
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)  # a pure function of (key, step)
    assert not np.array_equal(masks(2)[0], a[0])
    # Evaluation is deterministic: no dropout.
    eval_step = SimpleStep(jax.random.key(0), DropoutProbe(), train=False)
    state = eval_step.initialize_model(SPEC)
    batch = {**regression_batches(1)[0], "output_features": np.zeros((8, 3), np.float32)}
    _, outputs = eval_step(state, batch)
    np.testing.assert_array_equal(outputs["output_features_pred"], np.ones((8, 3)))


def test_batch_norm_statistics_are_carried_in_training_and_used_in_eval():
    batches = regression_batches(4, offset=5.0)  # inputs centred near 5
    trainer = SimpleTrainer(BatchNormModel(), epochs=1, steps_per_epoch=4, batch_spec=SPEC)
    stats0 = trainer.model_state.batch_stats["BatchNorm_0"]["mean"]
    np.testing.assert_array_equal(stats0, np.zeros(3))
    trainer.train(batches)
    mean = np.asarray(trainer.model_state.batch_stats["BatchNorm_0"]["mean"])
    # momentum 0.5 over 4 batches: the running mean went 15/16 of the way to ~5.
    assert np.all(mean > 4.0), mean
    state = trainer.model_state
    new_state, _ = trainer.eval_step(state, batches[0])
    np.testing.assert_array_equal(new_state.batch_stats["BatchNorm_0"]["mean"], mean)


def test_with_simple_data_loader():
    loader = SimpleDataLoader(iter(regression_batches(6)), validate_batches=True)
    spec = loader.get_batch_spec()
    assert spec["input_features"] == ((8, 3), np.dtype("float32"))
    trainer = SimpleTrainer(MLP(), epochs=2, steps_per_epoch=3, batch_spec=spec)
    outputs = trainer.train(loader)
    assert int(trainer.model_state.step) == 6  # the peeked first batch was trained on too
    assert len(outputs["loss"]) == 3
    with pytest.raises(StopIteration):
        next(loader)


# -- data loaders ----------------------------------------------------------------------------


def test_simple_data_loader_peeks_validates_and_reports_empty():
    batches = regression_batches(2)
    loader = SimpleDataLoader(batches)  # an iterable works too
    assert isinstance(loader, TrainerDataLoader)
    loader.get_batch_spec()
    assert next(loader) is batches[0]
    assert next(loader) is batches[1]
    with pytest.raises(ValueError, match="empty"):
        SimpleDataLoader(iter([])).get_batch_spec()
    bad = regression_batches(1) + [{"input_features": np.zeros((4, 3), np.float32),
                                    "output_features": np.zeros((8, 1), np.float32)}]
    checked = SimpleDataLoader(iter(bad), validate_batches=True)
    next(checked)
    with pytest.raises(TypeError, match=r"\['input_features'\].*\(8, 3\).*\(4, 3\)"):
        next(checked)
    with pytest.raises(TypeError, match=r"batch\['x'\].*not an array"):
        SimpleDataLoader(iter([{"x": "text"}])).get_batch_spec()
    unchecked = SimpleDataLoader(iter(bad))  # no validation: batches pass through
    assert len(list(unchecked)) == 2


def test_transformer_data_loader_collates_for_causal_lm():
    samples = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    loader = TransformerDataLoader(iter(samples), batch_size=3)
    first = next(loader)
    np.testing.assert_array_equal(first["input_features"]["input_ids"],
                                  [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    np.testing.assert_array_equal(first["input_features"]["attention_mask"],
                                  [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(first["output_features"]["labels"],
                                  [[1, 2, 3, -100], [4, 5, -100, -100], [6, 7, 8, 9]])
    assert PADDING_TOKEN == -100
    last = next(loader)  # the short last batch
    np.testing.assert_array_equal(last["input_features"]["input_ids"], [[10]])
    with pytest.raises(StopIteration):
        next(loader)
    custom = TransformerDataLoader(samples, batch_size=2, collate_fn=len)
    assert list(custom) == [2, 2]
    with pytest.raises(ValueError, match="sample 1"):
        next(TransformerDataLoader(iter([[1], [[2, 3]]]), batch_size=2))


def test_transformer_data_loader_argument_errors_are_the_references():
    samples = [[1, 2], [3]]
    missing = re.escape("`dataset` and `batch_size` must be provided.")
    with pytest.raises(ValueError, match=missing):
        TransformerDataLoader(dataset=None, batch_size=2)
    with pytest.raises(ValueError, match=missing):
        TransformerDataLoader(dataset=iter(samples), batch_size=None)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="`batch_size` must be positive."):
            TransformerDataLoader(dataset=iter(samples), batch_size=bad)


def test_data_preprocessor_runs_stages_in_order_and_builds_are_independent():
    builder = DataPreprocessorBuilder().add_stage(lambda b: b + [1]).add_stage(lambda b: b * 2)
    first = builder.build()
    assert first([0]) == [0, 1, 0, 1]
    second = builder.add_stage(len).build()
    assert second([0]) == 4
    assert first([0]) == [0, 1, 0, 1]  # a later stage did not change the first pipeline
    assert len(first.stages) == 2 and len(second.stages) == 3
    assert DataPreprocessor([])("unchanged") == "unchanged"
    with pytest.raises(TypeError, match="stages\\[1\\]"):
        DataPreprocessor([len, "not callable"])
    with pytest.raises(TypeError, match="stage 0"):
        DataPreprocessorBuilder().add_stage(3)


def test_configs_validate():
    config = CheckpointingConfig("/tmp/somewhere", max_checkpoints=2, checkpoint_interval=3)
    assert str(config.checkpoint_spec.checkpoint_dir) == "/tmp/somewhere/checkpoints"
    assert (config.max_checkpoints, config.checkpoint_interval) == (2, 3)
    with pytest.raises(ValueError, match="max_checkpoints"):
        CheckpointingConfig("/tmp/x", max_checkpoints=0)
    with pytest.raises(ValueError, match="interval"):
        SummaryConfig("/tmp/x", interval=0)
    assert SummaryConfig("/tmp/x").asynchronous is True


# -- TransformerStep -------------------------------------------------------------------------


class TinyLM(nn.Module):
    vocab: int = 12

    @nn.compact
    def __call__(self, features, train: bool = True):
        ids = features["input_ids"]
        x = nn.Embed(self.vocab, 16)(ids)
        # Causal: position t sees tokens <= t (a running mean of embeddings).
        x = jnp.cumsum(x, axis=1) / jnp.arange(1, ids.shape[1] + 1)[None, :, None]
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(self.vocab)(x)


def test_transformer_step_loss_is_masked_next_token_cross_entropy():
    step = TransformerStep(jax.random.key(0), TinyLM(), train=False)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 12)).astype(np.float32)
    labels = np.array([[1, 2, 3, -100], [4, 5, 6, 7]], np.int32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.int32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    # Position t predicts label t + 1, over real targets: 2 in row 0 and 3 in row 1.
    terms = [-logp[0, 0, 2], -logp[0, 1, 3], -logp[1, 0, 5], -logp[1, 1, 6], -logp[1, 2, 7]]
    loss = step.loss_fn(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask))
    assert float(loss) == pytest.approx(float(np.mean(terms)), rel=1e-5)
    assert float(step.loss_fn(jnp.asarray(logits), jnp.asarray(labels),
                              jnp.zeros_like(mask))) == 0.0


def test_transformer_step_validates_the_batch_layout():
    step = TransformerStep(jax.random.key(0), TinyLM(), train=False)
    spec = {"input_features": {"input_ids": ([2, 4], "int32"),
                               "attention_mask": ([2, 4], "int32")}}
    state = step.initialize_model(spec)
    ids = np.ones((2, 4), np.int32)
    with pytest.raises(ValueError, match="attention_mask"):
        step(state, {"input_features": {"input_ids": ids},
                     "output_features": {"labels": ids}})
    with pytest.raises(ValueError, match="labels"):
        step(state, {"input_features": {"input_ids": ids, "attention_mask": ids},
                     "output_features": {"targets": ids}})
    with pytest.raises(ValueError, match="output_features"):
        step(state, {"input_features": {"input_ids": ids, "attention_mask": ids}})


def test_simple_trainer_trains_a_causal_lm_with_transformer_step():
    # Counting sequences: the next token is always the current one plus one.
    samples = [list(range(s, s + n)) for s, n in [(0, 6), (2, 5), (1, 8), (3, 4)] * 8]
    spec = {"input_features": {"input_ids": ([4, 8], "int32"),
                               "attention_mask": ([4, 8], "int32")}}
    trainer = SimpleTrainer(TinyLM(), epochs=4, steps_per_epoch=2, batch_spec=spec,
                            step_class=TransformerStep, optimizer=optax.adam(3e-2))
    held_out = next(TransformerDataLoader(iter(samples[:4]), batch_size=4))

    def eval_loss():
        return float(trainer.eval_step(trainer.model_state, held_out)[1]["loss"].compute())

    initial = eval_loss()
    outputs = trainer.train(TransformerDataLoader(iter(samples), batch_size=4))
    assert int(trainer.model_state.step) == 8
    assert outputs["output_features_pred"][0].shape == (4, 8, 12)
    assert eval_loss() < 0.5 * initial


def test_module_names_are_the_references():
    import jaxloop
    from jaxloop.step_number_writer import local_file_step_number_writer, step_number_writer
    from jaxloop.trainers import (
        data_loader,
        data_preprocessor,
        simple_step,
        simple_trainer,
        trainer_utils,
        transformer_step,
    )

    assert simple_trainer.SimpleTrainer is SimpleTrainer
    assert simple_step.SimpleStep is SimpleStep and transformer_step.TransformerStep
    assert data_loader.SimpleDataLoader is SimpleDataLoader
    assert data_preprocessor.DataPreprocessorBuilder is DataPreprocessorBuilder
    assert trainer_utils.CheckpointingConfig is CheckpointingConfig
    assert step_number_writer.StepNumberWriter
    assert local_file_step_number_writer.LocalFileStepNumberWriter
    assert jaxloop.trainers.SimpleTrainer is SimpleTrainer
    assert jaxloop.async_action_context.get_async_action_context()
