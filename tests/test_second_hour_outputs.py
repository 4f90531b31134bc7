"""What a user's loop `end`, its actions and the caller see in a loop's outputs: the keys the
step returned, google/jaxloop's documented ones (`STAT_*`, `STOP_LOOP`), nothing else.

The loops here compute their metrics the way google/jaxloop's own examples do
(``examples/train_resnet.py``): a loop subclass whose `end` merges every output as a clu
metric before handing the result on. Bookkeeping in the outputs (an eval loop's per-step
example counts were a list of ints) breaks that with "'int' object has no attribute 'merge'".
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from models import LinenMLP, toy_data

from jaxloop import actions, eval_loop, outer_loop, stat_loop, train_loop
from jaxloop import step as step_lib
from jaxloop.metrics import writers

USER_KEYS = {"loss", "accuracy"}
# What google/jaxloop's API documents a loop may add: its statistics and the stop marker.
DOCUMENTED = set(stat_loop.ALL_STATS) | {outer_loop.STOP_LOOP}


class MetricsStep(step_lib.Step):
    """Returns clu metrics, one per key, as google/jaxloop's examples' steps do."""

    def run(self, state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return jnp.mean(losses), (logits, losses)

        if self.train:
            (_, (logits, losses)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state.params)
            state = state.apply_gradients(grads=grads)
        else:
            _, (logits, losses) = loss_fn(state.params)
        return state, {
            "loss": clu_metrics.Average.from_model_output(losses),
            "accuracy": clu_metrics.Accuracy.from_model_output(logits=logits,
                                                               labels=batch["y"]),
        }


def compute_metrics(outputs):
    """google/jaxloop's ``examples/train_resnet.py`` helper, as its users write it."""
    if not outputs:
        return outputs
    computed_metrics = {}
    for metric_name, metric_list in outputs.items():
        metric = metric_list[0]
        for metric_item in metric_list[1:]:
            metric = metric.merge(metric_item)
        computed_metrics[metric_name] = metric.compute()
    return computed_metrics


class Seen:
    """Records the keys each call saw (a loop's `end`, an action)."""

    def __init__(self):
        self.keys = []


class MergingEnd:
    """google/jaxloop's ``ResnetTrainLoop`` / ``ResnetEvalLoop`` `end`, recording the keys
    it is given."""

    def __init__(self, *args, seen, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = seen

    def end(self, state, outputs):
        self.seen.keys.append(set(outputs))
        return super().end(state, compute_metrics(outputs))


class MergingEvalLoop(MergingEnd, eval_loop.EvalLoop):
    pass


class MergingTrainLoop(MergingEnd, train_loop.TrainLoop):
    pass


class MergeEverything(actions.Action):
    """A user's action that merges every per-step list it gets as clu metrics."""

    def __init__(self, seen):
        super().__init__(interval=1)
        self.seen = seen
        self.results = []

    def __call__(self, state, outputs, **kwargs):
        self.seen.keys.append(set(outputs))
        lists = {k: v for k, v in outputs.items() if k not in DOCUMENTED}
        self.results.append(compute_metrics(lists))


def exact(state, data):
    logits = state.apply_fn({"params": state.params}, data["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, data["y"])
    return (float(np.mean(np.asarray(losses, np.float64))),
            float(np.mean(np.argmax(logits, -1) == data["y"])))


def split(data, size):
    n = len(data["y"])
    return [{k: v[i:i + size] for k, v in data.items()} for i in range(0, n, size)]


@pytest.fixture
def steps():
    train = MetricsStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    return train, MetricsStep(jax.random.key(0), LinenMLP())


def test_an_eval_loop_whose_end_merges_every_output_as_clu_metrics(steps):
    _, evaluate = steps
    state = evaluate.initialize_model([1, 16])
    data = toy_data(20, seed=3)
    seen_end, seen_action = Seen(), Seen()
    loop = MergingEvalLoop(evaluate, seen=seen_end)
    # Keep the loop and run the cell twice, as a notebook does.
    for _ in range(2):
        _, outputs = loop(state, iter(split(data, 8)))  # batches of 8, 8, 4
    loss, accuracy = exact(state, data)
    assert float(outputs["accuracy"]) == pytest.approx(accuracy, rel=1e-6)
    assert float(outputs["loss"]) == pytest.approx(loss, rel=1e-5)
    assert seen_end.keys == [USER_KEYS, USER_KEYS]  # exactly the step's keys
    assert set(outputs) <= USER_KEYS | DOCUMENTED
    # The counts travel beside the outputs, on the loop.
    assert [int(c) for c in loop.example_counts] == [8, 8, 4]

    # A plain EvalLoop whose end action merges every per-step list it is given.
    merge = MergeEverything(seen_action)
    _, outputs = eval_loop.EvalLoop(evaluate, end_actions=[merge])(state, iter(split(data, 8)))
    assert float(merge.results[-1]["accuracy"]) == pytest.approx(accuracy, rel=1e-6)
    assert USER_KEYS <= seen_action.keys[-1] <= USER_KEYS | DOCUMENTED, seen_action.keys
    assert USER_KEYS <= set(outputs) <= USER_KEYS | DOCUMENTED


def test_merging_loops_inside_an_outer_loop_with_summaries_and_the_history(steps, tmp_path):
    train, evaluate = steps
    data = toy_data(256)
    test = toy_data(20, seed=3)
    seen_train, seen_eval, seen_actions = Seen(), Seen(), Seen()

    class Keys(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            seen_actions.keys.append(set(outputs))

    train_writer = writers.SummaryWriter(str(tmp_path / "train"))
    eval_writer = writers.SummaryWriter(str(tmp_path / "eval"))
    outer = outer_loop.OuterLoop(
        MergingTrainLoop(train, end_actions=[actions.SummaryAction(train_writer), Keys()],
                         seen=seen_train),
        [MergingEvalLoop(evaluate, end_actions=[actions.SummaryAction(eval_writer), Keys()],
                         seen=seen_eval)],
        progress=False)
    state, outputs = outer(train.initialize_model([1, 16]), train_dataset=split(data, 16) * 2,
                           train_total_steps=20, train_loop_steps=10,
                           eval_specs=[outer_loop.EvalSpec(dataset=split(test, 8))])
    assert int(state.step) == 20
    assert seen_train.keys == [USER_KEYS] * 2 and seen_eval.keys == [USER_KEYS] * 2
    assert all(USER_KEYS <= k <= USER_KEYS | DOCUMENTED for k in seen_actions.keys)
    # The caller gets the user's keys, the stop marker and statistics only.
    assert USER_KEYS | {outer_loop.STOP_LOOP} <= set(outputs) <= USER_KEYS | DOCUMENTED
    loss, accuracy = exact(state, test)
    assert outer.history["eval/accuracy"].values[-1] == pytest.approx(accuracy, rel=1e-6)
    assert outer.history["eval/loss"].values[-1] == pytest.approx(loss, rel=1e-5)
    train_writer.close(), eval_writer.close()


class PlainStep(step_lib.Step):
    """Per-step scalar means, the common case: the eval means must weight by examples."""

    def run(self, state, batch):
        logits = state.apply_fn({"params": state.params}, batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return state, {"loss": jnp.mean(losses),
                       "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def test_eval_means_over_examples_without_a_counts_key(steps, tmp_path):
    """The example counts left the outputs; the history, summaries, early stopping and
    `scalar_metrics` still give means over examples (a smaller last batch counts less)."""
    train, _ = steps
    evaluate = PlainStep(jax.random.key(0), LinenMLP())
    test = toy_data(20, seed=3)
    seen = Seen()

    class Keep(actions.Action):
        def __call__(self, state, outputs, loop=None, **kwargs):
            seen.keys.append(set(outputs))
            self.metrics = actions.scalar_metrics(outputs, loop=loop)

    keep = Keep()
    handler = actions.MetricMonitoringStopHandler("loss", patience=10)
    evaluator = eval_loop.EvalLoop(evaluate, end_actions=[keep,
                                                          actions.EarlyStoppingAction(handler)])
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(train), [evaluator], progress=False)
    state, _ = outer(train.initialize_model([1, 16]), train_dataset=split(toy_data(160), 16),
                     train_total_steps=10, train_loop_steps=10,
                     eval_specs=[outer_loop.EvalSpec(dataset=split(test, 8))])
    loss, accuracy = exact(state, test)
    batch_means = np.mean([exact(state, b)[0] for b in split(test, 8)])
    assert abs(batch_means - loss) > 1e-4  # the mean of batch means would differ
    assert outer.history["eval/loss"].values == [pytest.approx(loss, rel=1e-5)]
    assert outer.history["eval/accuracy"].values == [pytest.approx(accuracy, rel=1e-6)]
    assert keep.metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert handler.get_best_info()[0] == pytest.approx(loss, rel=1e-5)
    assert all(k <= {"loss", "accuracy"} | DOCUMENTED for k in seen.keys), seen.keys
