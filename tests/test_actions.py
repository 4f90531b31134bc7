"""What actions are given and what the loops leave alone: an OuterLoop's own phases (history,
evaluations, resume metadata) run without touching the user's action lists or actions, each
action gets one `ActionContext`, and a CheckpointAction still saves when called bare."""

import jax
import optax
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, data, eval_loop, outer_loop, train_loop
from jaxloop.checkpointing import checkpoint

DATA = toy_data(128)
BATCHES = [{k: v[i:i + 16] for k, v in DATA.items()} for i in range(0, 128, 16)]


def steps():
    train = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    return train, ClassifierStep(jax.random.key(0), LinenMLP())


class SeeLists(actions.Action):
    """Records the end actions of the loop it runs in, as it sees them when it is called."""

    def __init__(self):
        super().__init__(1)
        self.seen = []

    def __call__(self, state, outputs, loop=None, **kwargs):
        self.seen.append(list(loop.end_actions))


def test_outer_loop_leaves_the_users_action_lists_and_actions_as_they_were(tmp_path):
    train, evaluate = steps()
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=None)
    saver, seen_train, seen_eval = actions.CheckpointAction(manager), SeeLists(), SeeLists()
    tl = train_loop.TrainLoop(train, end_actions=[seen_train, saver])
    el = eval_loop.EvalLoop(evaluate, end_actions=[seen_eval])
    train_actions, eval_actions = tl.end_actions, el.end_actions
    saver_before = dict(vars(saver))
    outer = outer_loop.OuterLoop(tl, [el], progress=False)
    outer(train.initialize_model([1, 16]), iter(data.GlobalBatchDataset(DATA, 16, seed=0)),
          train_total_steps=6, train_loop_steps=2,
          eval_specs=[outer_loop.EvalSpec(dataset=BATCHES[:2])])
    manager.close()
    # The history recorded, the evaluations ran before the checkpoint, which holds them.
    assert outer.history["train/loss"].steps == list(range(1, 7))
    assert outer.history["eval/loss"].steps == [2, 4, 6]
    assert checkpoint.read_meta(tmp_path / "ckpt", 4)["evals_pending"] is False
    # ... and no list or action of the user's changed, during the run or after it.
    assert tl.end_actions is train_actions and train_actions == [seen_train, saver]
    assert el.end_actions is eval_actions and eval_actions == [seen_eval]
    assert seen_train.seen == [[seen_train, saver]] * 3
    assert seen_eval.seen == [[seen_eval]] * 3
    assert vars(saver) == saver_before


class Counted:
    """A user's iterator whose position (``get_state``) is counted when read."""

    def __init__(self, batches):
        self.batches, self.index, self.reads = batches, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.index == len(self.batches):
            raise StopIteration
        self.index += 1
        return self.batches[self.index - 1]

    def get_state(self):
        self.reads += 1
        return {"index": self.index}

    def set_state(self, state):
        self.index = state["index"]


def test_every_action_gets_the_loops_context():
    train, _ = steps()
    contexts = []

    class Remember(actions.Action):
        def __init__(self, read_position):
            super().__init__(1)
            self.read_position = read_position

        def __call__(self, state, outputs, context=None, **kwargs):
            position = context.data_position if self.read_position else None
            contexts.append((outputs is None, context.loop, context.loop_count,
                             context.first_step, context.step, position))

    tl = train_loop.TrainLoop(train, begin_actions=[Remember(False)],
                              end_actions=[Remember(True)])
    dataset = Counted(BATCHES)
    state = train.initialize_model([1, 16])
    for _ in range(2):
        state, _ = tl(state, dataset, num_steps=3)
    assert contexts == [(True, tl, 1, 0, 0, None), (False, tl, 1, 0, 3, {"index": 3}),
                        (True, tl, 2, 3, 3, None), (False, tl, 2, 3, 6, {"index": 6})]
    assert dataset.reads == 2  # only where an action asked


def test_checkpoint_action_called_without_a_context(tmp_path):
    train, _ = steps()
    state = train.initialize_model([1, 16])
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=None, async_save=False)
    saver = actions.CheckpointAction(manager, meta={"run": "a"})
    assert saver(state, None)  # google/jaxloop's loops call it so
    tl = train_loop.TrainLoop(train)
    dataset = Counted(BATCHES)
    state, _ = tl(state, dataset, num_steps=2)
    assert saver(state, {"loss": [0.5, 0.4]}, loop=tl)  # the loop alone: its context
    manager.close()
    bare, with_loop = (checkpoint.read_meta(tmp_path / "ckpt", s) for s in (0, 2))
    assert (bare["run"], bare["loop_count"], bare["dataset_state"]) == ("a", None, None)
    assert (with_loop["loop_count"], with_loop["dataset_state"]) == (1, {"index": 2})
    fresh = Counted(BATCHES)
    restored, _ = checkpoint.restore(state, tmp_path / "ckpt", step=2, dataset=fresh)
    assert int(restored.step) == 2 and fresh.index == 2


def test_a_loop_cut_short_is_finished_under_its_count():
    train, _ = steps()
    counts = []

    class Count(actions.Action):
        def __call__(self, state, outputs, loop_count=None, **kwargs):
            counts.append(loop_count)

    tl = train_loop.TrainLoop(train, end_actions=[Count()])
    state, _ = tl(train.initialize_model([1, 16]), iter(BATCHES), num_steps=1)
    tl.resume_count(tl.loop_count, cut_short=True)
    state, _ = tl(state, iter(BATCHES), num_steps=1)
    tl.resume_count(5)  # a checkpoint's count: the next loop is the 6th
    tl(state, iter(BATCHES), num_steps=1)
    assert counts == [1, 1, 6] and tl.loop_count == 6
