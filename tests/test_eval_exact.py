"""Exact-epoch eval: padded batches + mask on 8 devices report numpy's metrics over N examples."""

import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from models import LinenMLP, toy_data

from jaxloop import data, eval_loop, partition, step

GLOBAL_BATCH = 16


class MaskedEvalStep(step.Step):
    def run(self, state, batch):
        logits = state.apply_fn({"params": state.params}, batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return state, {
            "accuracy": clu_metrics.Accuracy.from_model_output(
                logits=logits, labels=batch["y"], mask=batch["mask"]),
            "loss": clu_metrics.Average.from_model_output(losses, mask=batch["mask"]),
        }


@pytest.fixture(scope="module")
def setup():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    evaluate = MaskedEvalStep(jax.random.key(0), LinenMLP(),
                              partitioner=partition.DataParallelPartitioner(mesh, "data"))
    return evaluate, evaluate.initialize_model([1, 16])


@pytest.mark.parametrize("n", [1, GLOBAL_BATCH - 1, GLOBAL_BATCH + 1, 37])
def test_padded_eval_matches_numpy(setup, n):
    evaluate, state = setup
    examples = toy_data(n, seed=n)
    eval_ds = data.pad_to_global_batches(data.ArraySource(examples), GLOBAL_BATCH)
    _, outputs = eval_loop.EvalLoop(evaluate)(state, eval_ds)
    assert len(eval_ds) == -(-n // GLOBAL_BATCH)
    logits = np.asarray(state.apply_fn({"params": state.params}, examples["x"]))
    expected_accuracy = np.mean(np.argmax(logits, -1) == examples["y"])
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected_loss = -np.mean(log_probs[np.arange(n), examples["y"]])
    assert float(outputs["accuracy"].compute()) == pytest.approx(expected_accuracy, abs=1e-7)
    assert float(outputs["loss"].compute()) == pytest.approx(expected_loss, rel=1e-5)


def test_importing_jaxloop_does_not_import_tensorflow():
    code = ("import sys, jaxloop, jaxloop.data, jaxloop.examples.digits; "
            "assert 'tensorflow' not in sys.modules, 'TensorFlow imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
