"""Loop, StatLoop, ActionLoop, TrainLoop, EvalLoop and OuterLoop behaviour."""

import os
import threading
import time

import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxloop import actions, loop, outer_loop, stat_loop
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import train_loop as train_loop_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.metrics import writers

DATA = toy_data(256)
BATCHES = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 256, 16)]


def forever():
    while True:
        yield from BATCHES


def steps():
    train = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    return train, ClassifierStep(jax.random.key(0), LinenMLP())


class Recorder(actions.Action):
    def __init__(self, interval=1):
        super().__init__(interval)
        self.calls = []

    def __call__(self, state, outputs, **kwargs):
        self.calls.append((int(state.step), kwargs["loop_count"], outputs))


def test_loop_runs_dataset_length_and_num_steps():
    train, _ = steps()
    state = train.initialize_model([1, 16])
    base = loop.Loop(train)
    state, outputs = base(state, BATCHES)  # an iterable runs to its end
    assert int(state.step) == len(BATCHES) and base.dataset_exhausted
    assert set(outputs) == {"loss", "accuracy", "logits"}
    assert len(outputs["loss"]) == len(BATCHES)
    assert all(isinstance(x, jax.Array) for x in outputs["loss"])  # stays on device
    state, outputs = base(state, forever(), num_steps=5)
    assert int(state.step) == len(BATCHES) + 5 and len(outputs["loss"]) == 5
    assert not base.dataset_exhausted


def test_loop_continues_from_step_5_and_drops_state_in_eval():
    train, evaluate = steps()
    state = train.initialize_model([1, 16])
    state, _ = train_loop_lib.TrainLoop(train)(state, forever(), num_steps=5)
    assert int(state.step) == 5
    state, _ = train_loop_lib.TrainLoop(train)(state, forever(), num_steps=3)
    assert int(state.step) == 8
    params = jax.device_get(state.params)
    same, outputs = eval_loop_lib.EvalLoop(evaluate)(state, BATCHES, num_steps=4)
    assert same is state and len(outputs["loss"]) == 4
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(same.params), params)


def test_bounded_steps_in_flight_and_errors():
    train, _ = steps()
    state = train.initialize_model([1, 16])
    lp = loop.Loop(train, max_steps_in_flight=1)
    state, outputs = lp(state, forever(), num_steps=4)
    assert len(outputs["loss"]) == 4
    with pytest.raises(ValueError, match="max_steps_in_flight"):
        loop.Loop(train, max_steps_in_flight=0)
    with pytest.raises(TypeError, match="iterator or iterable"):
        lp(state, 42)
    with pytest.raises(ValueError, match="num_steps"):
        lp(state, forever(), num_steps=-1)


def test_stat_loop_reports_stats():
    train, _ = steps()
    state = train.initialize_model([1, 16])
    sl = stat_loop.StatLoop(train, stat_names=list(stat_loop.ALL_STATS), global_batch_size=16)
    _, outputs = sl(state, forever(), num_steps=6)
    assert outputs[stat_loop.STAT_STEPS_PER_SEC] > 0
    assert outputs[stat_loop.STAT_EXAMPLES_PER_SEC] == pytest.approx(
        16 * outputs[stat_loop.STAT_STEPS_PER_SEC])
    assert outputs[stat_loop.STAT_NUM_STEPS] == 6
    assert outputs[stat_loop.STAT_NUM_PARAMS] == train.num_params
    assert outputs[stat_loop.STAT_NUM_FLOPS] > 0
    with pytest.raises(ValueError, match="Unknown stat"):
        stat_loop.StatLoop(train, stat_names=["jaxloop/nope"])


def test_actions_fire_on_the_right_loops():
    train, _ = steps()
    recorders = {i: Recorder(i) for i in (1, 2, 5)}
    begin = Recorder(2)
    tl = train_loop_lib.TrainLoop(train, begin_actions=[begin],
                                  end_actions=list(recorders.values()))
    state = train.initialize_model([1, 16])
    for _ in range(10):
        state, _ = tl(state, forever(), num_steps=2)
    assert tl.loop_count == 10
    for interval, rec in recorders.items():
        assert [c[1] for c in rec.calls] == list(range(interval, 11, interval))
        assert [c[0] for c in rec.calls] == [2 * n for n in range(interval, 11, interval)]
    assert [c[1] for c in begin.calls] == [2, 4, 6, 8, 10]
    assert begin.calls[0][0] == 2  # begin actions see the state before the loop's steps
    with pytest.raises(ValueError, match="positive"):
        actions.Action(interval=0)
    with pytest.raises(ValueError, match="train=True"):
        train_loop_lib.TrainLoop(steps()[1])


def make_outer(eval_specs_count=1, end_actions=(), eval_end_actions=(), **kwargs):
    train, evaluate = steps()
    tl = train_loop_lib.TrainLoop(train, end_actions=list(end_actions))
    evals = [eval_loop_lib.EvalLoop(evaluate, end_actions=list(eval_end_actions))
             for _ in range(eval_specs_count)]
    return train, outer_loop.OuterLoop(train_loop=tl, eval_loops=evals, **kwargs), evals


def test_outer_loop_train_and_multiple_evals():
    counts = {"a": [], "b": [], "c": []}

    class Count(actions.Action):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def __call__(self, state, outputs, **kwargs):
            counts[self.name].append(int(state.step))

    train, evaluate = steps()
    tl = train_loop_lib.TrainLoop(train)
    evals = [eval_loop_lib.EvalLoop(evaluate, end_actions=[Count(n)]) for n in "abc"]
    outer = outer_loop.OuterLoop(train_loop=tl, eval_loops=evals)
    state, outputs = outer(
        train.initialize_model([1, 16]), forever(), train_total_steps=20, train_loop_steps=4,
        eval_specs=[
            outer_loop.EvalSpec(BATCHES, num_steps=2),
            outer_loop.EvalSpec(BATCHES, num_steps=2, eval_loop_interval=2),
            outer_loop.EvalSpec(BATCHES, should_eval_fn=lambda ctx: ctx.step_num >= 16),
        ],
    )
    assert int(state.step) == 20 and len(outputs["loss"]) == 4
    assert counts["a"] == [4, 8, 12, 16, 20]
    assert counts["b"] == [8, 16]
    assert counts["c"] == [16, 20]


def test_outer_loop_uneven_total_and_state_already_advanced():
    train, outer, _ = make_outer(0)
    state, _ = outer(train.initialize_model([1, 16]), forever(), train_total_steps=10,
                     train_loop_steps=4)
    assert int(state.step) == 10
    state, outputs = outer(state, forever(), train_total_steps=13, train_loop_steps=4)
    assert int(state.step) == 13 and len(outputs["loss"]) == 3


class StopAt(actions.Action):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def __call__(self, state, outputs, **kwargs):
        if int(state.step) >= self.step:
            outputs[outer_loop.STOP_LOOP] = True


def test_stop_loop_from_train_and_from_eval():
    train, outer, _ = make_outer(0, end_actions=[StopAt(6)])
    state, _ = outer(train.initialize_model([1, 16]), forever(), train_total_steps=50,
                     train_loop_steps=3)
    assert int(state.step) == 6
    train, outer, _ = make_outer(1, eval_end_actions=[StopAt(9)])
    state, _ = outer(train.initialize_model([1, 16]), forever(), train_total_steps=50,
                     train_loop_steps=3, eval_specs=[outer_loop.EvalSpec(BATCHES, num_steps=1)])
    assert int(state.step) == 9


def test_exhausted_train_dataset_ends_with_warning(caplog):
    train, outer, _ = make_outer(0)
    with caplog.at_level("WARNING"):
        state, outputs = outer(train.initialize_model([1, 16]), BATCHES[:7],
                               train_total_steps=100, train_loop_steps=5)
    assert int(state.step) == 7 and len(outputs["loss"]) == 2
    assert "exhausted" in caplog.text


def test_outer_loop_bad_arguments():
    train, outer, _ = make_outer(1)
    state = train.initialize_model([1, 16])
    with pytest.raises(ValueError, match="1 eval loops but was given 0 eval specs"):
        outer(state, forever(), train_total_steps=4, train_loop_steps=2)
    with pytest.raises(ValueError, match="no train_dataset"):
        outer(state, None, train_total_steps=4, eval_specs=[outer_loop.EvalSpec(BATCHES)])
    with pytest.raises(ValueError, match="train_loop_steps must be positive"):
        outer(state, forever(), train_total_steps=4, train_loop_steps=0,
              eval_specs=[outer_loop.EvalSpec(BATCHES)])
    with pytest.raises(ValueError, match="train_total_steps must be positive"):
        outer(state, forever(), train_total_steps=-3, eval_specs=[outer_loop.EvalSpec(BATCHES)])
    with pytest.raises(ValueError, match="needs a dataset"):
        outer_loop.EvalSpec()
    with pytest.raises(ValueError, match="num_steps must be positive"):
        outer_loop.EvalSpec(BATCHES, num_steps=0)
    with pytest.raises(ValueError, match="neither a train loop nor eval loops"):
        outer_loop.OuterLoop()(state)


def test_single_shot_eval_returns_the_last_eval_loops_outputs():
    train, evaluate = steps()
    rec = Recorder()
    outer = outer_loop.OuterLoop(eval_loops=[
        eval_loop_lib.EvalLoop(evaluate), eval_loop_lib.EvalLoop(evaluate, end_actions=[rec])])
    state = train.initialize_model([1, 16])
    result, outputs = outer(state, eval_specs=[outer_loop.EvalSpec(BATCHES, num_steps=2),
                                               outer_loop.EvalSpec(BATCHES, num_steps=3)])
    assert result is state
    assert len(rec.calls) == 1 and rec.calls[0][2] is outputs  # the last loop's outputs
    assert len(outputs["loss"]) == 3


def test_continuous_eval_over_checkpoints_written_concurrently(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    train, evaluate = steps()

    class Slow(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            time.sleep(0.3)  # so the evaluator sees checkpoints arrive one by one

    manager = checkpoint.make_manager(ckpt_dir, max_to_keep=None)
    tl = train_loop_lib.TrainLoop(train, end_actions=[actions.CheckpointAction(manager), Slow()])
    trainer = outer_loop.OuterLoop(train_loop=tl,
                                   checkpoint_spec=outer_loop.CheckpointSpec(ckpt_dir))
    init = train.initialize_model([1, 16])
    thread = threading.Thread(
        target=lambda: trainer(init, forever(), train_total_steps=12, train_loop_steps=3))
    thread.start()
    rec = Recorder()
    evaluator = outer_loop.OuterLoop(
        eval_loops=[eval_loop_lib.EvalLoop(evaluate, end_actions=[rec])],
        checkpoint_spec=outer_loop.CheckpointSpec(ckpt_dir, iterate_interval_secs=0.05))
    final, outputs = evaluator(evaluate.initialize_model([1, 16]),
                               eval_specs=[outer_loop.EvalSpec(BATCHES, num_steps=2)])
    thread.join()
    assert [c[0] for c in rec.calls] == [3, 6, 9, 12]  # each checkpoint exactly once
    assert outputs is rec.calls[-1][2] and len(outputs["loss"]) == 2
    assert int(final.step) == 12
    assert outer_loop.stop_marker_path(ckpt_dir).exists()


def test_continuous_eval_stop_fn(tmp_path):
    train, evaluate = steps()
    manager = checkpoint.make_manager(tmp_path, max_to_keep=None)
    tl = train_loop_lib.TrainLoop(train, end_actions=[actions.CheckpointAction(manager)])
    outer_loop.OuterLoop(train_loop=tl)(train.initialize_model([1, 16]), forever(),
                                        train_total_steps=8, train_loop_steps=2)
    manager.wait_until_finished()
    rec = Recorder()
    asked = []
    evaluator = outer_loop.OuterLoop(
        eval_loops=[eval_loop_lib.EvalLoop(evaluate, end_actions=[rec])],
        # As in the reference: no argument, asked once every checkpoint there is was seen.
        checkpoint_spec=outer_loop.CheckpointSpec(tmp_path,
                                                  iterate_stop_fn=lambda: not asked.append(1)))
    state, outputs = evaluator(evaluate.initialize_model([1, 16]),
                               eval_specs=[outer_loop.EvalSpec(BATCHES)])
    assert [c[0] for c in rec.calls] == [2, 4, 6, 8] and len(asked) == 1
    assert int(state.step) == 8 and outputs is rec.calls[-1][2]


def _scalars(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_summary_action_writes_train_lists_per_step_and_eval_means(tmp_path):
    train, evaluate = steps()
    train_writer = writers.SummaryWriter(tmp_path / "train")
    eval_writer = writers.SummaryWriter(tmp_path / "eval")
    tl = train_loop_lib.TrainLoop(train, end_actions=[actions.SummaryAction(train_writer)],
                                  stat_names=[stat_loop.STAT_STEPS_PER_SEC])  # asked for
    el = eval_loop_lib.EvalLoop(evaluate, end_actions=[actions.SummaryAction(eval_writer)])
    outer = outer_loop.OuterLoop(train_loop=tl, eval_loops=[el])
    _, outputs = outer(train.initialize_model([1, 16]), forever(), train_total_steps=12,
                       train_loop_steps=4, eval_specs=[outer_loop.EvalSpec(BATCHES[:3])])
    train_writer.close()
    eval_writer.close()
    train_scalars = _scalars(tmp_path / "train")
    assert [s for s, _ in train_scalars["loss"]] == list(range(1, 13))
    assert [s for s, _ in train_scalars["accuracy"]] == list(range(1, 13))
    np.testing.assert_allclose([v for _, v in train_scalars["loss"][-4:]],
                               [float(x) for x in outputs["loss"]], rtol=1e-6)
    assert "jaxloop/steps_per_sec" in train_scalars
    assert "logits" not in train_scalars  # per-example arrays are not summaries
    eval_scalars = _scalars(tmp_path / "eval")
    assert [s for s, _ in eval_scalars["loss"]] == [4, 8, 12]


def test_summary_action_metric_types(tmp_path):
    from jaxloop.types import MetricType, MetricWithMetadata

    writer = writers.SummaryWriter(tmp_path)
    state = steps()[0].initialize_model([1, 16])
    action = actions.SummaryAction(writer, flush_each_call=True)
    action(state, {
        "image": MetricWithMetadata(np.zeros((4, 4, 3), np.float32), MetricType.IMAGE),
        "hist": [MetricWithMetadata(np.arange(10.0), MetricType.HISTOGRAM)],
        "note": MetricWithMetadata(np.array("hello"), MetricType.TEXT),
        "scalar": jax.numpy.float32(2.5),
    })
    acc = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "histograms": 0,
                                                         "tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    # tensorboardX writes images as image summaries and texts under key/text_summary.
    assert "image" in tags["images"] and "hist" in tags["histograms"]
    assert "note/text_summary" in tags["tensors"] and acc.Scalars("scalar")[0].value == 2.5


def test_checkpoint_action_saves_loop_count_and_metrics(tmp_path):
    train, _ = steps()
    manager = checkpoint.make_manager(tmp_path, max_to_keep=None)
    tl = train_loop_lib.TrainLoop(train, end_actions=[actions.CheckpointAction(manager, 2)])
    outer_loop.OuterLoop(train_loop=tl)(train.initialize_model([1, 16]), forever(),
                                        train_total_steps=12, train_loop_steps=2)
    assert checkpoint.all_steps(tmp_path) == [4, 8, 12]
    _, meta = checkpoint.restore(train.initialize_model([1, 16]), tmp_path)
    assert meta["loop_count"] == 6
    assert os.path.exists(tmp_path / "12" / "state")


@pytest.mark.parametrize("mode, values, stop_at", [
    ("min", [1.0, 0.9, 0.95, 0.96], 3),
    ("max", [0.1, 0.2, 0.2, 0.1], 3),
    ("auto", [0.5, 0.4, 0.45, 0.46], 3),
])
def test_early_stopping_action(mode, values, stop_at):
    handler = actions.MetricMonitoringStopHandler("loss", patience=2, mode=mode)
    action = actions.EarlyStoppingAction(handler)
    state = steps()[0].initialize_model([1, 16])
    with pytest.raises(actions.StopTrainingError) as err:
        for i, v in enumerate(values):
            action(state.replace(step=i), {"loss": [np.float32(v)]})
    assert i == stop_at
    assert err.value.best_step == (1 if mode != "max" else 1)


def test_early_stopping_baseline_and_nan():
    state = steps()[0].initialize_model([1, 16])
    action = actions.EarlyStoppingAction(
        actions.MetricMonitoringStopHandler("loss", patience=2, baseline=0.5))
    action(state, {"loss": [0.6]})
    with pytest.raises(actions.StopTrainingError):
        action(state, {"loss": [0.55]})
    action = actions.EarlyStoppingAction(actions.MetricMonitoringStopHandler("loss", patience=5))
    action(state, {"loss": [1.0]})
    with pytest.raises(actions.StopTrainingError, match="Metric 'loss' was NaN") as err:
        action(state, {"loss": [float("nan")]})
    assert err.value.best_metric == 1.0


def test_early_stopping_ends_outer_loop():
    class Worsening(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            outputs["fake_loss"] = [float(state.step)]  # gets worse every eval

    handler = actions.MetricMonitoringStopHandler("fake_loss", patience=2)
    train, outer, _ = make_outer(
        1, eval_end_actions=[Worsening(), actions.EarlyStoppingAction(handler)])
    state, _ = outer(train.initialize_model([1, 16]), forever(), train_total_steps=100,
                     train_loop_steps=2, eval_specs=[outer_loop.EvalSpec(BATCHES, num_steps=1)])
    assert int(state.step) == 6
    assert handler.get_best_info() == (2.0, 2)


def _train_outer(prefetch, dataset, total=12):
    train, evaluate = steps()
    outer = outer_loop.OuterLoop(
        train_loop=train_loop_lib.TrainLoop(train),
        eval_loops=[eval_loop_lib.EvalLoop(evaluate)], prefetch=prefetch)
    return outer(train.initialize_model([1, 16]), dataset, train_total_steps=total,
                 train_loop_steps=5, eval_specs=[outer_loop.EvalSpec(BATCHES, num_steps=2)])


def test_prefetch_gives_identical_results_and_leaks_no_thread():
    before = set(threading.enumerate())
    plain, _ = _train_outer(0, forever())
    prefetched, outputs = _train_outer(3, forever())
    assert int(prefetched.step) == 12 and len(outputs["loss"]) == 2
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(plain.params),
                 jax.device_get(prefetched.params))
    assert set(threading.enumerate()) <= before


def test_prefetch_places_train_and_eval_batches_ahead_in_a_thread():
    # Eval batches used to be read and placed on the loop's thread: the eval loop wrapped
    # its dataset, so the prefetcher never recognised it.
    readers = {"train": set(), "eval": set()}
    received = {"train": set(), "eval": set()}

    def reading(name, batches):
        for batch in batches:
            readers[name].add(threading.current_thread().name)
            yield batch

    def recording(cls, name):
        class Recording(cls):
            def _get_next_batch(self, dataset):
                batch = super()._get_next_batch(dataset)
                received[name].add(type(batch).__name__)
                return batch
        return Recording

    class EvalData:
        def __iter__(self):
            return reading("eval", BATCHES[:3])

    train = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                           train=True)
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP())
    outer = outer_loop.OuterLoop(
        train_loop=recording(train_loop_lib.TrainLoop, "train")(train),
        eval_loops=[recording(eval_loop_lib.EvalLoop, "eval")(evaluate)], prefetch=2)
    state, _ = outer(train.initialize_model([1, 16]), reading("train", forever()),
                     train_total_steps=8, train_loop_steps=4,
                     eval_specs=[outer_loop.EvalSpec(EvalData())])
    assert int(state.step) == 8
    assert readers == {"train": {"jaxloop-device-prefetch"}, "eval": {"jaxloop-device-prefetch"}}
    # A `_get_next_batch` override sees the batch itself (read ahead), never a wrapper.
    assert received == {"train": {"dict"}, "eval": {"dict"}}


def test_prefetch_surfaces_dataset_errors():
    def broken():
        yield from BATCHES[:7]
        raise OSError("disk on fire")

    before = set(threading.enumerate())
    with pytest.raises(OSError, match="disk on fire"):
        _train_outer(2, broken())
    assert set(threading.enumerate()) <= before
    with pytest.raises(ValueError, match="prefetch"):
        outer_loop.OuterLoop(prefetch=-1)


def test_progress_bar_shows_the_last_step_of_per_step_clu_metrics():
    from clu import metrics as clu_metrics

    losses = loop.MetricList(
        [clu_metrics.Average.from_model_output(jax.numpy.array([v])) for v in (3.0, 1.5)])
    progress = actions.ProgressAction(total_steps=10, enabled=True)
    state = ClassifierStep(jax.random.key(0), LinenMLP()).initialize_model([1, 16])
    progress(state, {"loss": losses, "jaxloop/steps_per_sec": 2.0})
    # The first loop's rate would count its compilation: none is shown yet.
    assert progress._bar.postfix == "loss=1.5"
    progress.close()
