"""PipelineLoop: an EvalLoop whose step outputs go through a real ml_metrics pipeline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clu import metrics as clu_metrics
from ml_metrics import chainable
from ml_metrics.metrics import rolling_stats
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, pipeline_loop


class LabelledStep(ClassifierStep):
    """Also returns the batch's labels, so the pipeline can score the logits, and a clu
    metric, which stays beside the pipeline's result."""

    def run(self, state, batch):
        state, outputs = super().run(state, batch)
        correct = jnp.argmax(outputs["logits"], -1) == batch["y"]
        return state, {**outputs, "labels": batch["y"],
                       "clu_accuracy": clu_metrics.Average.from_model_output(correct)}


class Record(actions.Action):
    def __call__(self, state, outputs, **kwargs):
        self.outputs = outputs


@pytest.fixture(scope="module")
def setup():
    step = LabelledStep(jax.random.key(0), LinenMLP())
    examples = toy_data(20)
    batches = [{k: v[i:i + 8] for k, v in examples.items()} for i in range(0, 20, 8)]
    return step, step.initialize_model([1, 16]), examples, batches  # batches of 8, 8, 4


def accuracy_pipeline():
    return (
        chainable.Pipeline.new()
        .assign("correct", fn=lambda logits, y: np.argmax(logits, -1) == y,
                input_keys=("logits", "labels"))
        .aggregate(input_keys="correct", fn=rolling_stats.MeanAndVarianceAggFn(),
                   output_keys="accuracy")
        .add_aggregate(input_keys="loss", fn=rolling_stats.MeanAndVarianceAggFn(),
                       output_keys="step_loss")
    )


def test_pipeline_aggregates_every_example_and_end_actions_see_it(setup):
    step, state, examples, batches = setup
    record = Record()
    loop = pipeline_loop.PipelineLoop(step, pipeline=accuracy_pipeline(), end_actions=[record])
    returned, outputs = loop(state, iter(batches))
    assert returned is state
    logits = np.asarray(state.apply_fn({"params": state.params}, examples["x"]))
    expected = np.mean(np.argmax(logits, -1) == examples["y"])  # over 20, not per-batch means
    assert outputs["accuracy"].count == 20
    assert outputs["accuracy"].mean == pytest.approx(expected)
    assert outputs["step_loss"].count == 3  # one scalar per step
    assert "loss" not in outputs  # the pipeline's result replaces the per-step lists
    assert float(outputs["clu_accuracy"].compute()) == pytest.approx(expected)
    assert record.outputs is outputs


def test_make_pipeline_builds_from_the_state(setup):
    step, state, _, batches = setup

    class PerStateLoop(pipeline_loop.PipelineLoop):
        def make_pipeline(self, state):
            self.seen = state
            return accuracy_pipeline()

    loop = PerStateLoop(step)
    _, outputs = loop(state, iter(batches), num_steps=2)
    assert loop.seen is state and outputs["accuracy"].count == 16


def test_without_a_pipeline_it_is_an_eval_loop(setup):
    step, state, _, batches = setup
    loop = pipeline_loop.PipelineLoop(step)
    _, outputs = loop(state, iter(batches))
    assert len(outputs["loss"]) == 3 and loop.example_counts == [8, 8, 4]
    assert not any(k.startswith("jaxloop/example") for k in outputs)  # beside, not in


def test_the_pipeline_gets_each_steps_example_count(setup):
    step, state, _, batches = setup
    counted = (
        chainable.Pipeline.new()
        .assign("n", fn=lambda n: np.array([n], np.float64),
                input_keys=pipeline_loop.EXAMPLE_COUNT)
        .aggregate(input_keys="n", fn=rolling_stats.MeanAndVarianceAggFn(), output_keys="examples")
    )
    _, outputs = pipeline_loop.PipelineLoop(step, pipeline=counted)(state, iter(batches))
    assert outputs["examples"].count == 3 and outputs["examples"].mean == pytest.approx(20 / 3)


def test_bad_pipelines_are_named(setup):
    step, state, _, batches = setup
    with pytest.raises(TypeError, match="ml_metrics.chainable.Pipeline, got function"):
        pipeline_loop.PipelineLoop(step, pipeline=accuracy_pipeline)
    no_aggregate = chainable.Pipeline.new().select(("loss",))
    with pytest.raises(TypeError, match="result must be a mapping.*got list"):
        pipeline_loop.PipelineLoop(step, pipeline=no_aggregate)(state, iter(batches))
