"""Behaviours a google/jaxloop user relies on (issue 11 part 1) and checkpoint/outer-loop
robustness (issue 13: continuous eval, early-stopping resume, orbax step naming)."""

import logging
import pathlib
import shutil
import threading
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from models import ClassifierStep, LinenMLP, PlacingClassifierStep, toy_data

from jaxloop import actions, data, outer_loop, partition
from jaxloop import eval_loop as eval_loop_lib
from jaxloop import train_loop as train_loop_lib
from jaxloop import types as types_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.metrics import writers

DATA = toy_data(256)
BATCHES = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 256, 16)]
STOP = outer_loop.STOP_LOOP


def forever():
    while True:
        yield from BATCHES


def train_step(model=None, **kwargs):
    return ClassifierStep(jax.random.key(0), model or LinenMLP(), optimizer=optax.adam(1e-2),
                          train=True, **kwargs)


def eval_step(model=None, **kwargs):
    return ClassifierStep(jax.random.key(0), model or LinenMLP(), **kwargs)


def leaves_equal(a, b):
    a, b = jax.device_get(a), jax.device_get(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


class Recorder(actions.Action):
    def __init__(self, interval=1):
        super().__init__(interval)
        self.calls = []

    def __call__(self, state, outputs, **kwargs):
        self.calls.append((int(state.step), outputs))


# --- 11.1 what OuterLoop returns -------------------------------------------------------------


def test_data_running_out_at_a_loop_boundary_returns_the_last_training_loops_lists():
    step = train_step()
    outer = outer_loop.OuterLoop(train_loop=train_loop_lib.TrainLoop(step))
    # 10 batches, loops of 5: the third loop reads nothing and must not replace the outputs.
    state, outputs = outer(step.initialize_model([1, 16]), BATCHES[:10], train_total_steps=100,
                           train_loop_steps=5)
    assert int(state.step) == 10
    assert len(outputs["loss"]) == 5 and len(outputs["accuracy"]) == 5
    assert outputs[STOP] is False


class StopAt(actions.Action):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def __call__(self, state, outputs, **kwargs):
        if int(state.step) >= self.step:
            outputs[STOP] = True


def test_stop_loop_of_an_eval_loop_shows_in_what_outer_loop_returns():
    step = train_step()
    outer = outer_loop.OuterLoop(
        train_loop=train_loop_lib.TrainLoop(step),
        eval_loops=[eval_loop_lib.EvalLoop(eval_step(), end_actions=[StopAt(6)])])
    state, outputs = outer(step.initialize_model([1, 16]), forever(), train_total_steps=30,
                           train_loop_steps=3, eval_specs=[outer_loop.EvalSpec(BATCHES[:1])])
    assert int(state.step) == 6 and outputs[STOP] is True
    assert len(outputs["loss"]) == 3  # the train loop's per-step lists

    outer = outer_loop.OuterLoop(train_loop=train_loop_lib.TrainLoop(step, end_actions=[StopAt(3)]))
    state, outputs = outer(step.initialize_model([1, 16]), forever(), train_total_steps=30,
                           train_loop_steps=3)
    assert int(state.step) == 3 and outputs[STOP] is True


def test_early_stopping_sets_stop_loop():
    class Worsening(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            outputs["fake_loss"] = [float(state.step)]

    step = train_step()
    handler = actions.MetricMonitoringStopHandler("fake_loss", patience=1)
    outer = outer_loop.OuterLoop(
        train_loop=train_loop_lib.TrainLoop(step),
        eval_loops=[eval_loop_lib.EvalLoop(
            eval_step(), end_actions=[Worsening(), actions.EarlyStoppingAction(handler)])])
    state, outputs = outer(step.initialize_model([1, 16]), forever(), train_total_steps=30,
                           train_loop_steps=2, eval_specs=[outer_loop.EvalSpec(BATCHES[:1])])
    assert int(state.step) == 4 and outputs[STOP] is True and len(outputs["loss"]) == 2


# --- 11.2 CheckpointSpec: iterate_stop_fn() and transforms ---------------------------------


def write_checkpoints(directory, total=6, loop_steps=2, model=None, **manager_options):
    step = train_step(model)
    manager = checkpoint.make_manager(directory, max_to_keep=None, **manager_options)
    outer = outer_loop.OuterLoop(train_loop=train_loop_lib.TrainLoop(
        step, end_actions=[actions.CheckpointAction(manager)]))
    state, _ = outer(step.initialize_model([1, 16]), forever(), train_total_steps=total,
                     train_loop_steps=loop_steps)
    manager.close()
    return state


def test_iterate_stop_fn_lambda_true_evaluates_once_and_stops(tmp_path):
    trained = write_checkpoints(tmp_path)
    rec = Recorder()
    evaluator = outer_loop.OuterLoop(
        eval_loops=[eval_loop_lib.EvalLoop(eval_step(), end_actions=[rec])],
        checkpoint_spec=outer_loop.CheckpointSpec(tmp_path, iterate_stop_fn=lambda: True))
    state, outputs = evaluator(eval_step().initialize_model([1, 16]),
                               eval_specs=[outer_loop.EvalSpec(BATCHES[:2])])
    assert [s for s, _ in rec.calls] == [2, 4, 6]  # each checkpoint once, no waiting
    leaves_equal(state.params, trained.params)
    assert len(outputs["loss"]) == 2


def test_transforms_start_a_new_head_from_the_given_state(tmp_path):
    trained = write_checkpoints(tmp_path)
    # Fine-tuning to 5 classes: the trained hidden layer, a fresh head.
    step = eval_step(LinenMLP(out=5))
    fresh = step.initialize_model([1, 16])
    with pytest.raises(ValueError, match=r"leaf params/dense2/\S+ has shape"):
        step.restore_model(fresh, tmp_path)
    transforms = {r"params/dense2/.*": ocp.Transform(use_fallback=True)}
    restored = step.restore_model(fresh, tmp_path, transforms=transforms)
    assert int(restored.step) == 6
    leaves_equal(restored.params["dense1"], trained.params["dense1"])
    leaves_equal(restored.params["dense2"], fresh.params["dense2"])

    # The same through CheckpointSpec in continuous eval.
    rec = Recorder()
    evaluator = outer_loop.OuterLoop(
        eval_loops=[eval_loop_lib.EvalLoop(step, end_actions=[rec])],
        checkpoint_spec=outer_loop.CheckpointSpec(tmp_path, iterate_stop_fn=lambda: True,
                                                  transforms=transforms))
    state, _ = evaluator(fresh, eval_specs=[outer_loop.EvalSpec(
        [{"x": DATA["x"][:8], "y": DATA["y"][:8] % 5}])])
    assert [s for s, _ in rec.calls] == [2, 4, 6]
    leaves_equal(state.params["dense1"], trained.params["dense1"])


# --- 11.3 checkpoints written the guide's way ----------------------------------------------


def guide_manager(directory):
    return ocp.CheckpointManager(
        directory, ocp.Checkpointer(ocp.PyTreeCheckpointHandler()),
        ocp.CheckpointManagerOptions(max_to_keep=3))


def test_a_whole_train_state_saved_the_guide_way_resumes(tmp_path):
    step = train_step()
    state, _ = train_loop_lib.TrainLoop(step)(step.initialize_model([1, 16]), forever(),
                                              num_steps=4)
    manager = guide_manager(tmp_path / "user")
    manager.save(4, args=ocp.args.PyTreeSave(state))  # a user, or google/jaxloop's action
    manager.wait_until_finished()
    manager.close()
    assert isinstance(state.opt_state, tuple)  # optax.adam: tuples, stored as lists
    saved = jax.device_get(state)  # (training below donates `state`'s buffers)

    restored = train_step().restore_model(train_step().initialize_model([1, 16]), tmp_path / "user")
    assert int(restored.step) == 4
    leaves_equal(restored.params, saved.params)
    leaves_equal(restored.opt_state, saved.opt_state)
    assert type(restored.opt_state) is type(saved.opt_state)

    # Resuming through CheckpointSpec continues exactly like an uninterrupted run.
    uninterrupted, _ = train_loop_lib.TrainLoop(step)(state, iter(BATCHES[4:8]), num_steps=4)
    outer = outer_loop.OuterLoop(train_loop=train_loop_lib.TrainLoop(train_step()),
                                 checkpoint_spec=outer_loop.CheckpointSpec(tmp_path / "user"))
    resumed, outputs = outer(train_step().initialize_model([1, 16]), iter(BATCHES[4:8]),
                             train_total_steps=8, train_loop_steps=4)
    assert int(resumed.step) == 8 and len(outputs["loss"]) == 4
    leaves_equal(resumed.params, uninterrupted.params)

    # Our CheckpointAction on the guide's manager writes the same layout; it restores too.
    manager = guide_manager(tmp_path / "ours")
    actions.CheckpointAction(manager)(restored, {"loss": [np.float32(1.0)]})
    manager.wait_until_finished()
    leaves_equal(train_step().restore_model(train_step().initialize_model([1, 16]),
                                            tmp_path / "ours").opt_state, saved.opt_state)

    # A real mismatch still names the leaf.
    other = train_step(LinenMLP(hidden=8))
    with pytest.raises(ValueError, match=r"leaf opt_state/0/mu/dense1/\S+ has shape"):
        other.restore_model(other.initialize_model([1, 16]), tmp_path / "user")


# --- 11.4 custom loops see the user's iterator -----------------------------------------------


class CountingIterator:
    def __init__(self, batches):
        self._it = iter(batches)
        self.served = 0
        self.threads = set()  # the threads that read it

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._it)
        self.served += 1
        self.threads.add(threading.current_thread().name)
        return batch

    def describe(self):
        return "counting"


def test_custom_train_loop_receives_the_users_iterator_while_prefetch_works():
    seen = {"run": [], "get": [], "plain": 0}

    class CustomLoop(train_loop_lib.TrainLoop):
        def run(self, state, dataset, num_steps=None, **kwargs):
            seen["run"].append(dataset)
            return super().run(state, dataset, num_steps, **kwargs)

        def _get_next_batch(self, dataset):
            seen["get"].append(dataset)
            assert dataset.describe() == "counting"  # the user's methods work
            batch = super()._get_next_batch(dataset)
            seen["plain"] += type(batch) is dict  # the batch itself, not a wrapper
            return batch

    user_iterator = CountingIterator(BATCHES)
    # A step that places its own batches, so they are prefetched in the background (batches
    # the compiled call places itself are read as needed: see test_loops).
    step = PlacingClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                                 train=True)
    outer = outer_loop.OuterLoop(train_loop=CustomLoop(step), prefetch=2)
    state, _ = outer(step.initialize_model([1, 16]), user_iterator, train_total_steps=8,
                     train_loop_steps=4)
    assert int(state.step) == 8
    assert all(d is user_iterator for d in seen["run"] + seen["get"])
    assert len(seen["get"]) == 8
    assert seen["plain"] == 8
    assert user_iterator.threads == {"jaxloop-device-prefetch"}  # every batch read ahead
    assert user_iterator.served >= 8

    plain = train_step()
    unprefetched, _ = outer_loop.OuterLoop(train_loop=train_loop_lib.TrainLoop(plain), prefetch=0)(
        plain.initialize_model([1, 16]), iter(BATCHES), train_total_steps=8, train_loop_steps=4)
    leaves_equal(state.params, unprefetched.params)


def test_a_shared_eval_iterator_loses_no_batch_to_prefetch():
    shared = CountingIterator(BATCHES)
    step = train_step()
    outer = outer_loop.OuterLoop(train_loop=train_loop_lib.TrainLoop(step),
                                 eval_loops=[eval_loop_lib.EvalLoop(eval_step())], prefetch=2)
    outer(step.initialize_model([1, 16]), forever(), train_total_steps=4, train_loop_steps=2,
          eval_specs=[outer_loop.EvalSpec(dataset_iterator=shared, num_steps=2)])
    assert shared.served == 4  # two evaluations of two batches, none read ahead


# --- 11.6 and 11.7 log messages ---------------------------------------------------------------


def test_restore_without_checkpoint_logs_the_references_words(tmp_path, caplog):
    step = train_step()
    state = step.initialize_model([1, 16])
    with caplog.at_level(logging.INFO, logger="jaxloop"):
        assert step.restore_model(state, tmp_path / "empty") is state
    assert f"No checkpoint found in {tmp_path / 'empty'}" in caplog.text


def test_early_stopping_action_logs_the_references_messages(caplog):
    state = train_step().initialize_model([1, 16]).replace(step=100)
    action = actions.EarlyStoppingAction(actions.MetricMonitoringStopHandler("val_loss"))
    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        assert action(state, {"other_metric": 1.0}) == {"other_metric": 1.0}
        assert action(state, None) is None
    assert caplog.text.count("not available in the outputs dictionary") == 2
    with caplog.at_level(logging.ERROR, logger="jaxloop"), pytest.raises(
            actions.StopTrainingError, match="Metric 'val_loss' was NaN") as err:
        action(state, {"val_loss": np.float32("nan")})
    assert "Metric 'val_loss' is NaN at step 100" in caplog.text
    assert (err.value.best_metric, err.value.best_step) == (float("inf"), 0)
    str(err.value)  # formats without raising
    action = actions.EarlyStoppingAction(
        actions.MetricMonitoringStopHandler("val_loss", patience=1))
    action(state, {"val_loss": [1.0]})
    with pytest.raises(actions.StopTrainingError,
                       match="Early stopping triggered for metric 'val_loss'"):
        action(state.replace(step=200), {"val_loss": [2.0]})


# --- 13.6 continuous eval that survives reality ------------------------------------------------


def test_continuous_eval_polls_in_seconds_by_default():
    spec = outer_loop.CheckpointSpec("/tmp/x")
    assert spec.iterate_interval_secs == outer_loop.DEFAULT_ITERATE_INTERVAL_SECS >= 1
    with pytest.raises(ValueError, match="iterate_interval_secs must be >= 0"):
        outer_loop.CheckpointSpec("/tmp/x", iterate_interval_secs=-1)


def test_a_checkpoint_deleted_before_it_is_read_is_skipped_with_a_warning(tmp_path, caplog):
    write_checkpoints(tmp_path)

    class DeleteNext(actions.Action):
        """What the trainer's max_to_keep does between the evaluator's listing and read."""

        def __call__(self, state, outputs, **kwargs):
            if int(state.step) == 2:
                shutil.rmtree(tmp_path / "4")

    rec = Recorder()
    evaluator = outer_loop.OuterLoop(
        eval_loops=[eval_loop_lib.EvalLoop(eval_step(), end_actions=[DeleteNext(), rec])],
        checkpoint_spec=outer_loop.CheckpointSpec(tmp_path, iterate_stop_fn=lambda: True))
    with caplog.at_level(logging.WARNING, logger="jaxloop"):
        evaluator(eval_step().initialize_model([1, 16]),
                  eval_specs=[outer_loop.EvalSpec(BATCHES[:1])])
    assert [s for s, _ in rec.calls] == [2, 6]
    assert "Checkpoint step 4" in caplog.text and "skipping" in caplog.text


def wait_for(predicate, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_stale_stopped_marker_does_not_end_the_evaluator_of_an_extended_run(tmp_path):
    def run(total, with_spec=True):
        step = train_step()
        manager = checkpoint.make_manager(tmp_path, max_to_keep=None)
        outer = outer_loop.OuterLoop(
            train_loop=train_loop_lib.TrainLoop(
                step, end_actions=[actions.CheckpointAction(manager)]),
            checkpoint_spec=outer_loop.CheckpointSpec(tmp_path) if with_spec else None)
        outer(step.initialize_model([1, 16]), forever(), train_total_steps=total,
              train_loop_steps=2)
        manager.close()

    run(4)
    marker = pathlib.Path(outer_loop.stop_marker_path(tmp_path))  # beside the directory
    assert marker.exists()
    # An extension that does not own the marker (no CheckpointSpec) leaves it stale.
    run(8, with_spec=False)
    assert marker.exists()

    rec = Recorder()
    evaluator = outer_loop.OuterLoop(
        eval_loops=[eval_loop_lib.EvalLoop(eval_step(), end_actions=[rec])],
        checkpoint_spec=outer_loop.CheckpointSpec(tmp_path, iterate_interval_secs=0.05))
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=evaluator(
        eval_step().initialize_model([1, 16]), eval_specs=[outer_loop.EvalSpec(BATCHES[:1])])))
    thread.start()
    wait_for(lambda: len(rec.calls) == 4, "the evaluator to read the 4 checkpoints")
    assert thread.is_alive()  # the marker of step 4 is older than checkpoint 8: ignored
    # The training job restarts (removing the marker first) and finishes at step 8.
    run(8)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert [s for s, _ in rec.calls] == [2, 4, 6, 8]
    assert int(result["out"][0].step) == 8


# --- 13.7 early-stopping progress survives a resume ------------------------------------------


def test_early_stopping_patience_survives_a_resume(tmp_path):
    scores = {2: 1.0, 4: 0.5, 6: 0.6, 8: 0.7, 10: 0.8, 12: 0.9}

    class Scripted(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            outputs["eval_loss"] = [scores[int(state.step)]]

    def run(total):
        step = train_step()
        manager = checkpoint.make_manager(tmp_path, max_to_keep=None)
        handler = actions.MetricMonitoringStopHandler("eval_loss", patience=3)
        outer = outer_loop.OuterLoop(
            train_loop=train_loop_lib.TrainLoop(
                step, end_actions=[actions.CheckpointAction(manager)]),
            eval_loops=[eval_loop_lib.EvalLoop(
                eval_step(), end_actions=[Scripted(), actions.EarlyStoppingAction(handler)])],
            checkpoint_spec=outer_loop.CheckpointSpec(tmp_path))
        state, outputs = outer(step.initialize_model([1, 16]), forever(),
                               train_total_steps=total, train_loop_steps=2,
                               eval_specs=[outer_loop.EvalSpec(BATCHES[:1])])
        manager.close()
        return state, outputs, handler

    # Uninterrupted: best 0.5 at step 4, then 0.6, 0.7, 0.8 do not improve: stop at 10.
    # Interrupted at step 6 (one non-improving eval seen), the resumed run must stop at 10
    # too, not at 12 (which it would with a fresh handler).
    state, outputs, handler = run(6)
    assert int(state.step) == 6 and handler.wait == 1
    state, outputs, handler = run(20)
    assert int(state.step) == 10 and outputs[STOP] is True
    assert handler.get_best_info() == (0.5, 4)


# --- 13.9 orbax's step naming ----------------------------------------------------------------


def test_restore_honours_the_managers_step_naming(tmp_path):
    trained = write_checkpoints(tmp_path, step_prefix="ckpt", step_format_fixed_length=6)
    assert (tmp_path / "ckpt_000006").exists()
    assert checkpoint.all_steps(tmp_path) == [2, 4, 6]
    restored = train_step().restore_model(train_step().initialize_model([1, 16]), tmp_path,
                                          step=4)
    assert int(restored.step) == 4
    restored = train_step().restore_model(train_step().initialize_model([1, 16]), tmp_path)
    leaves_equal(restored.params, trained.params)
    assert checkpoint.read_meta(tmp_path, 6)["loop_count"] == 3
    # Resuming through OuterLoop, and continuous eval, read the same directory.
    step = train_step()
    manager = checkpoint.make_manager(tmp_path, max_to_keep=None, step_prefix="ckpt",
                                      step_format_fixed_length=6)
    outer = outer_loop.OuterLoop(
        train_loop=train_loop_lib.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)]),
        checkpoint_spec=outer_loop.CheckpointSpec(tmp_path))
    state, _ = outer(step.initialize_model([1, 16]), forever(), train_total_steps=8,
                     train_loop_steps=2)
    manager.close()
    assert int(state.step) == 8 and outer.train_loop.loop_count == 4
    rec = Recorder()
    outer_loop.OuterLoop(
        eval_loops=[eval_loop_lib.EvalLoop(eval_step(), end_actions=[rec])],
        checkpoint_spec=outer_loop.CheckpointSpec(tmp_path))(
            eval_step().initialize_model([1, 16]), eval_specs=[outer_loop.EvalSpec(BATCHES[:1])])
    assert [s for s, _ in rec.calls] == [2, 4, 6, 8]


def test_no_private_orbax_attributes_or_jax_internals_in_checkpointing_code():
    root = pathlib.Path(__file__).resolve().parents[1] / "jaxloop"
    for name in ("checkpointing/checkpoint.py", "outer_loop.py", "stop_handler.py"):
        source = (root / name).read_text()
        assert "jax._src" not in source and "_default_item" not in source, name


# --- 13.3 (single process part): positions per process -----------------------------------------


def test_data_positions_are_per_process_and_checked_against_the_process_count():
    own = {"next_index": 7}
    meta = {"dataset_states": [{"next_index": 3}, own], "process_count": 2}
    assert checkpoint.dataset_state_for_process(meta, 1, 2) == own
    with pytest.raises(ValueError, match="data positions of 2 process.*this job has 1"):
        checkpoint.dataset_state_for_process(meta, 0, 1)
    it = iter(data.GlobalBatchDataset(data.ArraySource(DATA), 16))
    next(it)
    position = data.iterator_state(it)
    meta = {"dataset_states": [position, position], "process_count": 2}
    assert checkpoint.dataset_state_for_process(meta, 0, 1) == position  # any process count
    assert checkpoint.dataset_state_for_process({"dataset_state": position}, 1, 2) == position
    assert checkpoint.dataset_state_for_process({}, 0, 1) is None


class _Calls:
    """A writer that keeps each call: (method, step, values)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if not name.startswith("write_"):
            raise AttributeError(name)
        return lambda step, values, **kw: self.calls.append((name, step, dict(values)))

    def flush(self):
        self.calls.append(("flush", None, {}))


class _AtStep:
    step = 7


def test_summary_action_writes_each_metric_type_in_one_call_as_the_reference():
    writer = _Calls()
    hist = types_lib.MetricType.HISTOGRAM
    outputs = {
        "h1": actions.MetricWithMetadata(np.arange(3.0), type=hist),
        "h2": actions.MetricWithMetadata(np.arange(4.0), type=hist),
        "pair": jax.numpy.array([5.0, 6.0]),  # the reference's bare usage: handed on as is
        "logits": [jax.numpy.ones((4, 10))] * 2,  # a per-step list of these is skipped
        "typed": actions.MetricWithMetadata(2.5, type=types_lib.MetricType.SCALAR),
        "loss": 0.25,
    }
    actions.SummaryAction(writer, flush_each_call=True)(_AtStep(), outputs)
    names = [c[0] for c in writer.calls]
    assert names.count("write_histograms") == 1 and names.count("write_scalars") == 1
    (_, step, hists), = [c for c in writer.calls if c[0] == "write_histograms"]
    assert step == 7 and sorted(hists) == ["h1", "h2"]
    (_, _, scalars), = [c for c in writer.calls if c[0] == "write_scalars"]
    pair = scalars.pop("pair")
    assert scalars == {"typed": 2.5, "loss": 0.25}
    np.testing.assert_array_equal(pair, [5.0, 6.0])
    assert names[-1] == "flush"


def test_a_bare_per_example_array_reaches_the_writer_which_names_key_and_shape(tmp_path):
    writer = writers.SummaryWriter(tmp_path)
    with pytest.raises(ValueError, match=r"'logits' must be a scalar .* shape \(4, 10\)"):
        actions.SummaryAction(writer)(_AtStep(), {"loss": 0.5, "logits": np.ones((4, 10))})
    writer.close()


def test_summary_action_refuses_audio_before_writing_anything():
    writer = _Calls()
    outputs = {
        "loss": 0.5,
        "clip": actions.MetricWithMetadata(np.zeros(8), type=types_lib.MetricType.AUDIO),
    }
    with pytest.raises(ValueError, match="'clip' has metric type .*AUDIO"):
        actions.SummaryAction(writer)(_AtStep(), outputs)
    assert writer.calls == []


def test_checkpoint_action_save_writes_one_pytree_a_plain_manager_restores(tmp_path):
    with ocp.CheckpointManager(tmp_path / "plain") as manager:
        assert actions.CheckpointAction(manager).save(step=0, state={"a": 0}, outputs=None)
        manager.wait_until_finished()
        assert manager.restore(0) == {"a": 0}


def test_a_subclass_overriding_save_is_what_checkpoint_action_calls(tmp_path):
    saved = []

    class Recording(actions.CheckpointAction):
        def save(self, step, state, outputs=None):
            saved.append(step)
            return super().save(step, {"step": step}, outputs)

    state = train_step().initialize_model([1, 16]).replace(step=3)
    with ocp.CheckpointManager(tmp_path / "sub") as manager:
        Recording(manager)(state, {"loss": [0.5]})
        manager.wait_until_finished()
        assert saved == [3] and manager.restore(3) == {"step": 3}


def test_a_step_places_batches_with_its_own_shard_batch_when_it_overrides_it():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.DataParallelPartitioner(mesh, "data")
    placed = []

    class Placing(ClassifierStep):
        def shard_batch(self, batch):
            placed.append(batch)
            return super().shard_batch(batch)

    step = Placing(jax.random.key(0), LinenMLP(), partitioner=part)
    state = step.initialize_model([1, 16])
    batch = BATCHES[0]
    _, outputs = step(state, batch)
    assert len(placed) == 1 and placed[0]["x"] is batch["x"]
    # The plain step's shard_batch is the partitioner's: leading axis split over the mesh.
    sharded = ClassifierStep(jax.random.key(0), LinenMLP(), partitioner=part).shard_batch(batch)
    assert sharded["x"].sharding.spec == jax.sharding.PartitionSpec("data")
    np.testing.assert_allclose(
        outputs["loss"], ClassifierStep(jax.random.key(0), LinenMLP(), partitioner=part)(
            state, batch)[1]["loss"], rtol=1e-6)


def test_batch_preprocessed_skips_preprocess_batch_and_reaches_run_as_the_reference():
    seen = {}

    class Preprocessing(ClassifierStep):
        def preprocess_batch(self, batch):
            raise AssertionError("preprocessed again")

        def run(self, state, batch, **kwargs):
            seen.update(kwargs)
            return super().run(state, batch)

    step = Preprocessing(jax.random.key(0), LinenMLP())
    _, outputs = step(step.initialize_model([1, 16]), BATCHES[0], batch_preprocessed=True)
    assert np.isfinite(float(outputs["loss"])) and "batch_preprocessed" in seen
