"""Nothing the user keeps or feeds is lost, written as a notebook user's cells would be.

An action that keeps the state (keep-best, snapshots) keeps usable arrays; any exception
leaves a live state the continue cell trains on with a consistent history; read-ahead takes
no batch the run does not train on; an interrupted evaluation is no result; an early stop
saves where it stopped whatever the order of the actions.
"""

import os
import signal

import grain
import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, eval_loop, outer_loop, partition, stop_handler, train_loop
from jaxloop.checkpointing import checkpoint
from jaxloop.launch import preemption

SPEC = [1, 16]


def batches(n, seed=0, rows=16):
    data = toy_data(n * rows, seed=seed)
    return [{**{k: v[i * rows:(i + 1) * rows] for k, v in data.items()},
             "i": np.full((rows,), i, np.int32)} for i in range(n)]


class IndexStep(ClassifierStep):
    """Outputs which batch it trained on (its "i")."""

    traces = 0

    def run(self, state, batch):
        type(self).traces += 1
        state, out = super().run(state, batch)
        return state, {"loss": out["loss"], "i": batch["i"][0]}


def steps(partitioner=None, cls=IndexStep, **kwargs):
    train = cls(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2),
                partitioner=partitioner, train=True, **kwargs)
    evaluate = ClassifierStep(jax.random.key(0), LinenMLP(), partitioner=partitioner)
    return train, evaluate


def trained_indices(outer):
    history = outer.history["train/i"]
    return [int(v) for v in history.values], list(history.steps)


class KeepBest(actions.Action):
    """The guide's use case: keep the best model (here every one) and snapshot params."""

    def __init__(self):
        super().__init__(interval=1)
        self.states, self.params = [], []

    def __call__(self, state, outputs, **kwargs):
        self.states.append(state)
        self.params.append(state.params)


def test_states_and_params_kept_by_actions_of_both_loops_stay_usable():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    train, evaluate = steps(partition.DataParallelPartitioner(mesh, "data"))
    keep_train, keep_eval = KeepBest(), KeepBest()
    outer = outer_loop.OuterLoop(
        train_loop=train_loop.TrainLoop(train, end_actions=[keep_train]),
        eval_loops=[eval_loop.EvalLoop(evaluate, end_actions=[keep_eval])])
    data = batches(8)
    IndexStep.traces = 0
    outer(train.initialize_model(SPEC), train_dataset=data * 3, train_total_steps=5,
          train_loop_steps=5, eval_specs=[outer_loop.EvalSpec(dataset=data[:2])])
    traces_after_first_loop = IndexStep.traces
    state, _ = outer(outer.state, train_dataset=data * 3, train_total_steps=20,
                     train_loop_steps=5, eval_specs=[outer_loop.EvalSpec(dataset=data[:2])])
    assert IndexStep.traces == traces_after_first_loop  # no compile after the first loop
    assert len(keep_train.states) == 4 and len(keep_eval.states) == 4
    kernels = [np.asarray(s.params["dense1"]["kernel"]) for s in keep_train.states]
    kernels += [np.asarray(p["dense1"]["kernel"]) for p in keep_train.params]
    kernels += [np.asarray(s.params["dense1"]["kernel"]) for s in keep_eval.states]
    assert [int(s.step) for s in keep_train.states] == [5, 10, 15, 20]
    assert not np.allclose(kernels[0], kernels[3])  # they are the states of their steps
    np.testing.assert_array_equal(kernels[3], np.asarray(state.params["dense1"]["kernel"]))


def test_a_hand_written_loop_keeps_every_state_a_list_holds():
    train, _ = steps()
    loop = train_loop.TrainLoop(train)
    kept = [train.initialize_model(SPEC)]
    it = iter(batches(12))
    for _ in range(3):                       # the cell: state, _ = loop(state, it, n)
        state, _ = loop(kept[-1], it, num_steps=4)
        kept.append(state)
    assert [int(s.step) for s in kept] == [0, 4, 8, 12]
    for s in kept:
        np.asarray(s.params["dense1"]["kernel"])  # none deleted


class Failing:
    """A generator of batches that raises at batch `at` (0-based)."""

    def __init__(self, data, at):
        self.data, self.at = data, at

    def __iter__(self):
        for i, batch in enumerate(self.data):
            if i == self.at:
                raise OSError(f"bad record in shard 3 at batch {i}")
            yield batch


class FailingAction(actions.Action):
    def __init__(self, at_call):
        super().__init__(interval=1)
        self.calls, self.at_call = 0, at_call

    def __call__(self, state, outputs, **kwargs):
        self.calls += 1
        if self.calls == self.at_call:
            raise RuntimeError("writer disk full")


@pytest.mark.parametrize("where", ["input", "train action", "eval action", "trace"])
def test_the_live_state_survives_an_exception_and_the_continue_cell_trains_on(where):
    train, evaluate = steps()
    data = batches(30)
    train_actions, eval_actions = [], []
    dataset = iter(data)
    if where == "input":
        dataset = iter(Failing(data, at=14))
    elif where == "train action":
        train_actions.append(FailingAction(at_call=2))
    elif where == "eval action":
        eval_actions.append(FailingAction(at_call=2))
    else:  # a batch of another feature size: the step fails when traced for it
        dataset = iter(data[:14] + [{**data[14], "x": data[14]["x"][:, :3]}] + data[15:])
    loop = train_loop.TrainLoop(train, end_actions=train_actions)
    evals = eval_loop.EvalLoop(evaluate, end_actions=eval_actions)
    outer = outer_loop.OuterLoop(train_loop=loop, eval_loops=[evals])
    specs = [outer_loop.EvalSpec(dataset=data[:2])]
    expected = {"input": (OSError, "bad record in shard 3 at batch 14", 14),
                "train action": (RuntimeError, "writer disk full", 20),
                "eval action": (RuntimeError, "writer disk full", 20),
                "trace": (Exception, 'parameter "kernel" in "/dense1"', 14)}[where]
    with pytest.raises(Exception) as caught:  # noqa: PT011 (the type is checked below)
        outer(train.initialize_model(SPEC), train_dataset=dataset, train_total_steps=30,
              train_loop_steps=10, eval_specs=specs)
    kind, message, step = expected
    assert isinstance(caught.value, kind) and message in str(caught.value)
    live = outer.state
    assert live is loop.stopped_state
    assert int(live.step) == step and not live.params["dense1"]["kernel"].is_deleted()
    # The docs' continue cell, on the rest of the data.
    rest = iter(data[step:])
    state, _ = outer(outer.state, train_dataset=rest, train_total_steps=30, train_loop_steps=10,
                     eval_specs=specs)
    assert int(state.step) == 30
    indices, history_steps = trained_indices(outer)
    assert history_steps == list(range(1, 31))  # no step missing or twice
    assert indices == list(range(30))
    evaluated = outer.history["eval/loss"].steps
    assert evaluated == [10, 20, 30]  # the evaluation an error cut short ran once, in full


def _grain_iterator(data):
    return iter(grain.MapDataset.source(data).to_iter_dataset())


def _generator(data):
    yield from data


@pytest.mark.parametrize("make", [iter, _generator, _grain_iterator],
                         ids=["iterator", "generator", "grain"])
def test_read_ahead_loses_no_batch_between_calls(make):
    train, _ = steps()
    data = batches(40)
    it = make(data)
    outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(train), prefetch=2)
    state, _ = outer(train.initialize_model(SPEC), train_dataset=it, train_total_steps=20,
                     train_loop_steps=10)
    state, _ = outer(state, train_dataset=it, train_total_steps=30, train_loop_steps=10)
    indices, _ = trained_indices(outer)
    assert indices == list(range(30))  # the batches read ahead at the end of call 1 came next
    assert 30 <= int(next(it)["i"][0]) <= 33  # past what the last call read ahead and kept


def test_the_checkpointed_position_and_the_continued_run_agree(tmp_path):
    train, _ = steps()
    data = batches(40)
    it = _grain_iterator(data)
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    loop = train_loop.TrainLoop(train, end_actions=[actions.CheckpointAction(manager)])
    outer = outer_loop.OuterLoop(train_loop=loop, prefetch=2)
    outer(train.initialize_model(SPEC), train_dataset=it, train_total_steps=20,
          train_loop_steps=10)
    manager.wait_until_finished()
    # A new process would resume from the checkpoint with a fresh iterator ...
    resumed_train, _ = steps()
    resumed = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(
        resumed_train, end_actions=[actions.CheckpointAction(
            checkpoint.make_manager(tmp_path / "ckpt"))]), prefetch=2)
    resumed(resumed_train.initialize_model(SPEC), train_dataset=_grain_iterator(data),
            train_total_steps=30, train_loop_steps=10)
    # ... and this one continues in process: both train on batches 20-29 next.
    outer(outer.state, train_dataset=it, train_total_steps=30, train_loop_steps=10)
    assert trained_indices(outer)[0][20:] == list(range(20, 30))
    assert trained_indices(resumed)[0][20:] == list(range(20, 30))


class StopAtBatch(IndexStep):
    """Sends this process SIGINT (a notebook's Stop) in `begin` of the execution that trains
    batch `at`."""

    at = 4

    def begin(self, state, batch):
        if self.at in np.asarray(batch["i"]).reshape(-1).tolist():
            os.kill(os.getpid(), signal.SIGINT)
        return state, batch


def test_a_batch_held_back_at_a_layout_change_is_trained_on_after_a_stop(tmp_path):
    train, _ = steps(cls=StopAtBatch)
    data = batches(12)
    data[6] = batches(7, rows=8)[6]  # batch 6 has 8 rows: another execution's layout
    it = _grain_iterator(data)
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    loop = train_loop.TrainLoop(train, steps_per_execution=4,
                                end_actions=[actions.CheckpointAction(manager)])
    outer = outer_loop.OuterLoop(train_loop=loop, prefetch=0)
    with pytest.raises(preemption.Interrupted) as stop:
        outer(train.initialize_model(SPEC), train_dataset=it, train_total_steps=12,
              train_loop_steps=12)
    assert stop.value.step == 6 and stop.value.saved  # steps 5-6 ran, batch 6 held back
    StopAtBatch.at = -1
    state, _ = outer(outer.state, train_dataset=it, train_total_steps=12, train_loop_steps=12)
    assert trained_indices(outer)[0] == list(range(12))
    # The checkpoint at step 6 resumes at batch 6, as the continued run did.
    positions = checkpoint.restore(train.initialize_model(SPEC), tmp_path / "ckpt", step=6,
                                   partitioner=train.partitioner,
                                   dataset=(fresh := _grain_iterator(data)))
    assert positions is not None and int(next(fresh)["i"][0]) == 6


class StopDuringEval(ClassifierStep):
    """An eval step whose `begin` sends SIGINT at its `at`-th batch of the `on`-th evaluation."""

    def __init__(self, *args, on, at, **kwargs):
        super().__init__(*args, **kwargs)
        self.on, self.at, self.batches, self.evaluations = on, at, 0, 0

    def begin(self, state, batch):
        self.batches += 1
        if self.batches == self.at and self.evaluations == self.on:
            os.kill(os.getpid(), signal.SIGINT)
        return state, batch


class Counting(actions.Action):
    def __init__(self):
        super().__init__(interval=1)
        self.steps = []

    def __call__(self, state, outputs, **kwargs):
        self.steps.append(int(state.step))


def test_an_interrupted_evaluation_is_no_result_and_runs_again_in_full(tmp_path):
    train, _ = steps()
    evaluate = StopDuringEval(jax.random.key(0), LinenMLP(), on=2, at=3)
    counting = Counting()
    evals = eval_loop.EvalLoop(evaluate, end_actions=[counting])

    class NewEvaluation(actions.Action):  # counts evaluations for the step's `on`
        def __call__(self, state, outputs, **kwargs):
            evaluate.evaluations += 1
            evaluate.batches = 0

    evals.begin_actions.append(NewEvaluation(interval=1))
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    outer = outer_loop.OuterLoop(
        train_loop=train_loop.TrainLoop(train, end_actions=[actions.CheckpointAction(manager)]),
        eval_loops=[evals], prefetch=0)
    data = batches(20)
    specs = [outer_loop.EvalSpec(dataset=data[:6])]
    with pytest.raises(preemption.Interrupted):
        outer(train.initialize_model(SPEC), train_dataset=iter(data), train_total_steps=20,
              train_loop_steps=5, eval_specs=specs)
    assert counting.steps == [5]  # the cut evaluation at step 10 ran no end action
    assert outer.history["eval/loss"].steps == [5]
    evaluate.on = 0
    outer(outer.state, train_dataset=iter(data[10:]), train_total_steps=20,
          train_loop_steps=5, eval_specs=specs)
    assert counting.steps == [5, 10, 15, 20]  # step 10's evaluation ran once, in full
    assert outer.history["eval/loss"].steps == [5, 10, 15, 20]


class StopsAt(actions.Action):
    """An early stop a user writes: raises StopTrainingError at `step`."""

    def __init__(self, step):
        super().__init__(interval=1)
        self.step = step

    def __call__(self, state, outputs, **kwargs):
        if int(state.step) >= self.step:
            raise stop_handler.StopTrainingError(f"done at step {int(state.step)}")


@pytest.mark.parametrize("order", ["stop first", "checkpoint first"])
def test_an_early_stop_saves_where_it_stopped_whatever_the_action_order(tmp_path, order):
    train, _ = steps()
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=None)
    ckpt = actions.CheckpointAction(manager)
    stop = StopsAt(75)
    end_actions = [stop, ckpt] if order == "stop first" else [ckpt, stop]
    outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(train, end_actions=end_actions))
    state, outputs = outer(train.initialize_model(SPEC), train_dataset=batches(10) * 10,
                           train_total_steps=100, train_loop_steps=25)
    manager.wait_until_finished()
    assert int(state.step) == 75 and outputs[outer_loop.STOP_LOOP]
    assert manager.all_steps() == [25, 50, 75]
    # A rerun resumes at 75 rather than training steps 50-75 again.
    rerun_train, _ = steps()
    rerun = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(
        rerun_train, end_actions=[actions.CheckpointAction(
            checkpoint.make_manager(tmp_path / "ckpt"))]))
    state, _ = rerun(rerun_train.initialize_model(SPEC), train_dataset=batches(10) * 10,
                     train_total_steps=80, train_loop_steps=25)
    assert int(state.step) == 80
    assert rerun.history["train/i"].steps == list(range(1, 81))  # 1-75 restored, then 76-80


def test_a_hand_written_outer_loop_copies_no_state_between_calls():
    """``state, _ = loop(state, it, n)`` in a loop: each call's first step reads the state
    where the last call left it (no copy), and the steps consume only what they made."""
    addresses = []

    class Recording(IndexStep):
        def begin(self, state, batch):  # reads a buffer's address, keeping nothing
            addresses.append(state.params["dense1"]["kernel"].unsafe_buffer_pointer())
            return state, batch

    train, _ = steps(cls=Recording)
    loop = train_loop.TrainLoop(train)
    state = train.initialize_model(SPEC)
    it = iter(batches(12))
    for _ in range(3):
        state, _ = loop(state, it, num_steps=4)
    calls = [addresses[i:i + 4] for i in range(0, 12, 4)]
    for previous, call in zip(calls, calls[1:], strict=False):
        assert call[0] == previous[-1]  # the state as the last call left it: not copied
        assert len(set(call[1:])) == 1  # then each step consumes the one before it
