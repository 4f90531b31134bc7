"""Tests for jaxloop.stop_handler: improvement rule, patience, modes, baseline, state dicts."""

import json
import math
import pickle

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import data, eval_loop, outer_loop, train_loop
from jaxloop.action_loop import ActionLoop
from jaxloop.actions import EarlyStoppingAction
from jaxloop.stop_handler import (
    MetricMonitoringStopHandler,
    StopTrainingError,
    infer_mode,
)
from jaxloop.types import TrainState

NAN = float("nan")
INF = float("inf")


def first_stop_index(handler, values):
    """Feeds values (step = index) and returns the index after which should_stop is True."""
    for i, v in enumerate(values):
        handler.update_state(v, i)
        if handler.should_stop():
            return i
    return None


# --- patience --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("patience", "values", "expected_stop"),
    [
        # patience=0 (like 1): the first non-improving update stops.
        (0, [1.0, 0.9, 0.8, 0.85, 0.7], 3),
        (0, [1.0, 1.0], 1),
        # patience=1: the first non-improving update stops (the reference's countdown).
        (1, [1.0, 0.9, 0.95, 0.8, 0.85, 0.9, 0.1], 2),
        (1, [1.0, 0.9, 0.8, 0.7], None),
        # patience=2: two consecutive non-improving updates.
        (2, [1.0, 0.9, 0.95, 0.8, 0.85, 0.9, 0.1], 5),
        (2, [1.0, 1.1, 0.9, 1.2, 0.8], None),
        # patience=3: three consecutive non-improving updates; an improvement resets the count.
        (3, [1.0, 2.0, 2.0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.1], 6),
        (3, [5.0, 4.0, 3.0, 2.0, 1.0], None),
    ],
)
def test_patience_stop_index(patience, values, expected_stop):
    handler = MetricMonitoringStopHandler("loss", patience=patience)
    assert first_stop_index(handler, values) == expected_stop


def test_wait_counts_and_stop_persists():
    handler = MetricMonitoringStopHandler("loss", patience=2)
    improved = [handler.update_state(v, i) for i, v in enumerate([3.0, 3.0, 2.0, 2.5, 2.5, 2.5])]
    assert improved == [True, False, True, False, False, False]
    assert handler.wait == 3
    assert handler.should_stop()
    handler.update_state(9.0, 6)
    assert handler.wait == 4 and handler.should_stop()
    # A late improvement clears the stop signal.
    assert handler.update_state(1.0, 7)
    assert handler.wait == 0 and not handler.should_stop()


def test_not_stopped_before_any_update():
    handler = MetricMonitoringStopHandler("loss", patience=0)
    assert not handler.should_stop()
    assert handler.wait == 0


# --- modes -----------------------------------------------------------------------------------


def test_min_mode():
    handler = MetricMonitoringStopHandler("whatever", mode="min")
    assert handler.mode == "min"
    assert handler.update_state(2.0, 0)
    assert handler.update_state(1.0, 1)
    assert not handler.update_state(1.5, 2)
    assert handler.get_best_info() == (1.0, 1)


def test_max_mode():
    handler = MetricMonitoringStopHandler("loss", mode="max")  # explicit mode beats the name
    assert handler.mode == "max"
    assert handler.update_state(1.0, 0)
    assert handler.update_state(2.0, 1)
    assert not handler.update_state(1.5, 2)
    assert handler.get_best_info() == (2.0, 1)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("loss", "min"),
        ("eval/accuracy", "max"),
        ("val_acc", "max"),
        ("top_5_error", "min"),
        ("f1", "max"),
        ("eval/loss", "min"),
        ("perplexity", "min"),
        ("Eval/AUC", "max"),
        ("mAP", "max"),
        ("val.iou", "max"),
        ("test-precision", "max"),
        ("train/recall_macro", "max"),
        ("bleu_score", "max"),
        # Tokens, not substrings: these contain 'acc'/'map' but are not accuracy/mAP.
        ("accumulated_loss", "min"),
        ("heatmap_loss", "min"),
        ("f1loss", "min"),
    ],
)
def test_auto_mode_inference(name, expected):
    assert infer_mode(name) == expected
    assert MetricMonitoringStopHandler(name).mode == expected


def test_auto_mode_behaviour_on_accuracy():
    handler = MetricMonitoringStopHandler("eval/accuracy", patience=0)
    assert handler.update_state(0.5, 0)
    assert handler.update_state(0.6, 1)
    assert not handler.update_state(0.55, 2)
    assert handler.should_stop()
    assert handler.get_best_info() == (0.6, 1)


# --- min_delta -------------------------------------------------------------------------------


def test_min_delta_min_mode():
    handler = MetricMonitoringStopHandler("loss", min_delta=0.1, patience=5)
    assert handler.update_state(1.0, 0)
    assert not handler.update_state(0.95, 1)  # better, but by less than min_delta
    assert not handler.update_state(0.9, 2)  # exactly min_delta is not *more than* min_delta
    assert handler.update_state(0.85, 3)
    assert handler.get_best_info() == (0.85, 3)
    assert handler.wait == 0


def test_min_delta_max_mode():
    handler = MetricMonitoringStopHandler("acc", min_delta=0.01, patience=0)
    assert handler.update_state(0.5, 0)
    assert not handler.update_state(0.505, 1)
    assert handler.should_stop()
    assert handler.get_best_info() == (0.5, 0)


def test_min_delta_tiny_improvements_stop():
    handler = MetricMonitoringStopHandler("loss", min_delta=1e-3, patience=2)
    values = [1.0, 0.9999, 0.9998, 0.9997, 0.5]
    assert first_stop_index(handler, values) == 2


# --- baseline --------------------------------------------------------------------------------


@pytest.mark.parametrize("patience", [0, 1, 3])
def test_baseline_never_beaten_stops_after_patience(patience):
    handler = MetricMonitoringStopHandler("loss", patience=patience, baseline=0.5)
    values = [0.9, 0.8, 0.7, 0.6, 0.55, 0.51]
    assert first_stop_index(handler, values) == max(patience, 1) - 1
    # As in the reference: the baseline is the best until beaten, at step 0.
    assert handler.get_best_info() == (0.5, 0)
    assert handler.best == 0.5 and handler.best_step == 0


def test_baseline_first_value_not_beating_by_min_delta_counts():
    handler = MetricMonitoringStopHandler("acc", min_delta=0.05, patience=1, baseline=0.8)
    assert not handler.update_state(0.82, 0)  # beats baseline, but not by min_delta
    assert handler.wait == 1 and handler.patience_left == 0
    assert handler.should_stop()
    assert handler.update_state(0.9, 1)
    assert handler.get_best_info() == (0.9, 1)
    assert handler.wait == 0


def test_baseline_beaten_is_improvement():
    handler = MetricMonitoringStopHandler("loss", patience=0, baseline=0.5)
    assert handler.update_state(0.4, 10)
    assert not handler.should_stop()
    assert handler.get_best_info() == (0.4, 10)
    # From now on the best value, not the baseline, is the reference.
    assert not handler.update_state(0.45, 11)
    assert handler.should_stop()


def test_baseline_equal_is_not_improvement():
    handler = MetricMonitoringStopHandler("acc", patience=0, baseline=0.7)
    assert not handler.update_state(0.7, 0)
    assert handler.should_stop()


# --- NaN and inf -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["min", "max"])
def test_nan_never_improves(mode):
    handler = MetricMonitoringStopHandler("m", mode=mode, patience=2)
    assert not handler.update_state(NAN, 0)  # not even as the first value
    assert handler.get_best_info() == ((INF if mode == "min" else -INF), 0)
    assert handler.update_state(1.0, 1)
    assert not handler.update_state(NAN, 2)
    assert not handler.update_state(NAN, 3)
    assert handler.should_stop()
    assert handler.get_best_info() == (1.0, 1)


def test_inf_values():
    handler = MetricMonitoringStopHandler("loss", patience=0)
    assert handler.update_state(INF, 0)  # first value always improves, even inf
    assert handler.update_state(1e30, 1)
    assert handler.update_state(-INF, 2)
    assert not handler.update_state(-1e30, 3)
    assert handler.get_best_info() == (-INF, 2)


def test_accepts_numpy_scalars():
    handler = MetricMonitoringStopHandler("loss")
    assert handler.update_state(np.float32(0.5), np.int64(3))
    best, step = handler.get_best_info()
    assert best == pytest.approx(0.5) and type(best) is float
    assert step == 3 and type(step) is int


# --- get_best_info and reset -----------------------------------------------------------------


def test_get_best_info():
    handler = MetricMonitoringStopHandler("loss", patience=10)
    assert handler.get_best_info() == (INF, 0)  # the reference's initial values
    assert MetricMonitoringStopHandler("acc").get_best_info() == (-INF, 0)
    for step, v in [(100, 3.0), (200, 2.0), (300, 2.5), (400, 1.5), (500, 1.6)]:
        handler.update_state(v, step)
    assert handler.get_best_info() == (1.5, 400)


def test_reset():
    handler = MetricMonitoringStopHandler("loss", patience=0, min_delta=0.1, baseline=5.0)
    handler.update_state(1.0, 0)
    handler.update_state(2.0, 1)
    assert handler.should_stop()
    handler.reset()
    assert handler.get_best_info() == (5.0, 0)
    assert handler.wait == 0
    assert not handler.should_stop()
    # Configuration survives a reset, including the baseline.
    assert (handler.patience, handler.min_delta, handler.baseline, handler.mode) == (
        0,
        0.1,
        5.0,
        "min",
    )
    assert not handler.update_state(6.0, 2)


def test_properties():
    handler = MetricMonitoringStopHandler(
        "eval/f1", min_delta=0.01, patience=4, mode="auto", baseline=0.3
    )
    assert handler.monitored_metric == "eval/f1"
    assert handler.min_delta == 0.01
    assert handler.patience == 4
    assert handler.mode == "max"
    assert handler.baseline == 0.3
    assert handler.wait == 0
    assert "eval/f1" in repr(handler)


# --- state_dict ------------------------------------------------------------------------------


def _json_round_trip(d):
    # allow_nan=False proves the dict is strict JSON (no NaN/Infinity tokens).
    return json.loads(json.dumps(d, allow_nan=False))


def _continue_both(a, b, values, start_step):
    for i, v in enumerate(values, start=start_step):
        assert a.update_state(v, i) == b.update_state(v, i)
        assert a.should_stop() == b.should_stop()
        assert a.get_best_info() == b.get_best_info()
        assert a.wait == b.wait


def test_state_dict_round_trip_resumes_exactly():
    original = MetricMonitoringStopHandler("loss", patience=3, min_delta=0.01)
    for i, v in enumerate([1.0, 0.8, 0.85, 0.9]):
        original.update_state(v, i)
    state = _json_round_trip(original.state_dict())
    assert state["best"] == 0.8 and state["best_step"] == 1 and state["wait"] == 2

    restored = MetricMonitoringStopHandler("loss", patience=3, min_delta=0.01)
    restored.load_state_dict(state)
    assert restored.get_best_info() == (0.8, 1)
    assert restored.wait == 2
    _continue_both(original, restored, [0.81, 0.795, 0.7, 0.9, 0.9, 0.9, 0.9], start_step=4)
    assert restored.should_stop()


def test_state_dict_before_any_update():
    handler = MetricMonitoringStopHandler("acc")
    state = _json_round_trip(handler.state_dict())
    assert state["best"] == "-inf" and state["best_step"] == 0 and state["wait"] == 0
    assert state["initialized"] is False
    other = MetricMonitoringStopHandler("acc")
    other.update_state(0.5, 0)
    other.load_state_dict(state)
    assert other.get_best_info() == (-INF, 0)
    assert other.update_state(0.1, 1)  # first value improves again, as after construction


def test_state_dict_after_nan():
    original = MetricMonitoringStopHandler("loss", patience=2)
    original.update_state(NAN, 0)
    original.update_state(1.0, 1)
    original.update_state(NAN, 2)
    state = _json_round_trip(original.state_dict())
    assert state["best"] == 1.0 and state["wait"] == 1

    restored = MetricMonitoringStopHandler("loss", patience=2)
    restored.load_state_dict(state)
    _continue_both(original, restored, [NAN, NAN, 0.5], start_step=3)


def test_state_dict_only_nan_seen():
    original = MetricMonitoringStopHandler("loss", patience=5)
    original.update_state(NAN, 0)
    state = _json_round_trip(original.state_dict())
    assert state["best"] == "inf" and state["wait"] == 1 and not state["initialized"]
    restored = MetricMonitoringStopHandler("loss", patience=5)
    restored.load_state_dict(state)
    _continue_both(original, restored, [NAN, 2.0, 3.0], start_step=1)


@pytest.mark.parametrize(("mode", "value", "encoded"), [("min", -INF, "-inf"), ("max", INF, "inf")])
def test_state_dict_with_inf(mode, value, encoded):
    original = MetricMonitoringStopHandler("m", mode=mode, patience=1)
    original.update_state(value, 7)
    state = _json_round_trip(original.state_dict())
    assert state["best"] == encoded
    restored = MetricMonitoringStopHandler("m", mode=mode, patience=1)
    restored.load_state_dict(state)
    assert restored.get_best_info() == (value, 7)
    _continue_both(original, restored, [0.0, value, 1.0], start_step=8)


def test_load_state_dict_decodes_nan_string():
    # A NaN best cannot arise from update_state, but the encoding must still read back.
    handler = MetricMonitoringStopHandler("loss")
    handler.load_state_dict({"best": "nan", "best_step": 3, "wait": 0})
    best, step = handler.get_best_info()
    assert math.isnan(best) and step == 3
    assert handler.state_dict()["best"] == "nan"


def test_load_state_dict_errors():
    handler = MetricMonitoringStopHandler("loss")
    with pytest.raises(KeyError, match="missing keys.*wait"):
        handler.load_state_dict({"best": 1.0, "best_step": 0})
    with pytest.raises(ValueError, match="monitored_metric='acc'.*'loss'"):
        handler.load_state_dict({"monitored_metric": "acc", "best": 1.0, "best_step": 0, "wait": 0})
    with pytest.raises(ValueError, match="mode='max'"):
        handler.load_state_dict({"mode": "max", "best": 1.0, "best_step": 0, "wait": 0})
    with pytest.raises(ValueError, match=r"state_dict\['wait'\] must be non-negative"):
        handler.load_state_dict({"best": 1.0, "best_step": 0, "wait": -1})
    with pytest.raises(ValueError, match=r"state_dict\['wait'\] must be an int"):
        handler.load_state_dict({"best": 1.0, "best_step": 0, "wait": 1.5})
    with pytest.raises(ValueError, match=r"state_dict\['best_step'\] must be an int"):
        handler.load_state_dict({"best": 1.0, "best_step": "3", "wait": 0})
    with pytest.raises(ValueError, match=r"state_dict\['best'\] must be a number"):
        handler.load_state_dict({"best": "abc", "best_step": 0, "wait": 0})
    # A failed load leaves the handler untouched.
    assert handler.get_best_info() == (INF, 0) and handler.wait == 0
    # A state saved before `initialized` existed: None means nothing seen yet.
    handler.load_state_dict({"best": None, "best_step": None, "wait": 0})
    assert handler.update_state(7.0, 1)


# --- argument validation ---------------------------------------------------------------------


def test_bad_mode():
    with pytest.raises(ValueError, match=r"Invalid mode 'minimize'.*'min', 'max', 'auto'"):
        MetricMonitoringStopHandler("loss", mode="minimize")


def test_negative_patience():
    with pytest.raises(ValueError, match="patience must be non-negative, got patience=-1"):
        MetricMonitoringStopHandler("loss", patience=-1)


def test_non_integer_patience():
    with pytest.raises(TypeError, match="patience must be an int"):
        MetricMonitoringStopHandler("loss", patience=1.5)


def test_negative_min_delta_is_taken_as_its_absolute_value():
    assert MetricMonitoringStopHandler("loss", min_delta=-0.1).min_delta == 0.1  # reference


def test_nan_min_delta():
    with pytest.raises(ValueError, match="min_delta must be a number, got min_delta=nan"):
        MetricMonitoringStopHandler("loss", min_delta=NAN)


def test_nan_baseline():
    with pytest.raises(ValueError, match="baseline must not be NaN"):
        MetricMonitoringStopHandler("loss", baseline=NAN)


# --- StopTrainingError -----------------------------------------------------------------------


def test_stop_training_error():
    err = StopTrainingError("eval/loss stopped improving", best_step=400, best_metric=1.5)
    assert err.best_step == 400
    assert err.best_metric == 1.5
    assert "eval/loss stopped improving" in str(err)
    assert "400" in str(err) and "1.5" in str(err)
    with pytest.raises(StopTrainingError, match="stopped improving"):
        raise err


def test_stop_training_error_defaults_and_pickle():
    err = StopTrainingError("stop")
    assert str(err) == "stop"
    assert err.best_step is None and err.best_metric is None
    clone = pickle.loads(pickle.dumps(StopTrainingError("x", best_step=3, best_metric=0.25)))
    assert (str(clone), clone.best_step, clone.best_metric) == (
        "x Training stopped early. Best Step: 3, Best Metric: 0.2500",
        3,
        0.25,
    )


def test_end_to_end_with_stop_training_error():
    handler = MetricMonitoringStopHandler("eval/accuracy", patience=1, min_delta=0.001)
    accuracies = [0.5, 0.6, 0.65, 0.6505, 0.64, 0.9]
    with pytest.raises(StopTrainingError) as info:
        for step, acc in zip(range(100, 700, 100), accuracies, strict=True):
            handler.update_state(acc, step)
            if handler.should_stop():
                best, best_step = handler.get_best_info()
                raise StopTrainingError("accuracy plateaued", best_step, best)
    assert info.value.best_step == 300
    assert info.value.best_metric == 0.65


# --- google/jaxloop's public attributes ------------------------------------------------------


def test_reference_attributes_and_semantics():
    loss = MetricMonitoringStopHandler("val_loss", patience=2)
    assert (loss.monitored_metric, loss.min_delta, loss.patience, loss.baseline) == (
        "val_loss", 1e-8, 2, None)
    assert MetricMonitoringStopHandler("x").patience == 10  # the reference's defaults
    assert loss.monitored_op is jnp.less and loss.monitored_op(1.0, 2.0)
    assert loss.best == INF and loss.best_step == 0
    acc = MetricMonitoringStopHandler("top1acc")  # the reference's suffix rule
    assert acc.monitored_op is jnp.greater and acc.best == -INF
    assert MetricMonitoringStopHandler("x", baseline=0.3, mode="max").best == 0.3
    # The sequence of the reference's own ActionLoop test: 1.0, 0.5, 0.6, 0.7 stops with
    # patience 2 at the fourth value, best 0.5 at step 1.
    for step, value in enumerate([1.0, 0.5, 0.6, 0.7]):
        loss.update_state(value, step)
        assert loss.should_stop() == (step == 3)
    assert (loss.best, loss.best_step, loss.patience_left) == (0.5, 1, 0)
    assert loss.get_best_info() == (0.5, 1)


def test_stop_training_error_without_best_metric_formats():
    # The reference formats best_metric with :.4f and raises TypeError when it is None.
    assert str(StopTrainingError("stop", best_step=3)) == (
        "stop Training stopped early. Best Step: 3, Best Metric: None")


def test_code_written_against_the_reference_reads_and_sets_patience_left():
    handler = MetricMonitoringStopHandler("val_loss", patience=3)
    handler.update_state(1.0, 100)
    assert handler._patience_left == 3
    assert not handler.update_state(1.5, 200)
    assert handler._patience_left == 2 and handler.wait == 1
    handler._patience_left = 0  # e.g. forcing a stop
    assert handler.should_stop() and handler.wait == 3
    handler._patience_left = handler.patience
    assert not handler.should_stop() and handler.wait == 0
    assert handler.update_state(0.5, 300) and handler._patience_left == 3


def test_early_stopping_in_an_action_loop_whose_step_is_a_plain_function():
    # google/jaxloop's own ActionLoop test: the step is a function returning a fixed loss
    # sequence; patience 2 stops at the fourth evaluation with the best 0.5 at step 1.
    losses = iter([1.0, 0.5, 0.6, 0.7, 0.8])

    def eval_step(state, batch, *args, **kwargs):
        return state, {"val_loss": jnp.array(next(losses))}

    handler = MetricMonitoringStopHandler("val_loss", patience=2)
    loop = ActionLoop(step=eval_step, end_actions=[EarlyStoppingAction(handler)])
    state = TrainState.create(apply_fn=None, params={}, tx=optax.identity())
    evaluations = 0
    with pytest.raises(StopTrainingError) as info:
        for epoch in range(10):
            evaluations += 1
            loop(state.replace(step=epoch), iter([{"input_features": np.ones((2, 3))}]))
    assert evaluations == 4
    assert (info.value.best_metric, info.value.best_step) == (0.5, 1)


def test_early_stopping_watches_a_member_of_a_clu_collection(caplog):
    # An eval step reporting a clu Collection: scalar_metrics names its members
    # 'metrics/accuracy', and that is the name early stopping watches.
    @flax.struct.dataclass
    class EvalMetrics(clu_metrics.Collection):
        accuracy: clu_metrics.Accuracy
        loss: clu_metrics.Average.from_output("loss")

    class CollectionEvalStep(ClassifierStep):
        def run(self, state, batch):
            logits = state.apply_fn({"params": state.params}, batch["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return state, {"metrics": EvalMetrics.single_from_model_output(
                logits=logits, labels=batch["y"], loss=loss)}

    examples = toy_data(64)
    # A learning rate of 0: the accuracy never improves after the first evaluation.
    train = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.0), train=True)
    stopper = EarlyStoppingAction(
        MetricMonitoringStopHandler("metrics/accuracy", mode="max", patience=2))
    outer = outer_loop.OuterLoop(
        train_loop.TrainLoop(train),
        [eval_loop.EvalLoop(CollectionEvalStep(jax.random.key(0), LinenMLP()),
                            end_actions=[stopper])])
    with caplog.at_level("WARNING", logger="jaxloop"):
        state, outputs = outer(
            train.initialize_model([1, 16]), iter(data.GlobalBatchDataset(examples, 16, seed=0)),
            train_total_steps=40, train_loop_steps=4,
            eval_specs=[outer_loop.EvalSpec([{k: v[:32] for k, v in examples.items()}])])
    assert int(state.step) == 12 and outputs[outer_loop.STOP_LOOP] is True
    assert not [r for r in caplog.records if "not available" in r.getMessage()]
    best, best_step = stopper.handler.get_best_info()
    assert best_step == 4
    assert best == outer.history["eval/metrics/accuracy"].values[0]
