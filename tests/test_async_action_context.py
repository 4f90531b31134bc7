"""jaxloop.async_action_context: errors of background work reach the training thread.

Background work here is real: threads started through the context, jaxloop's AsyncWriter,
and orbax's asynchronous checkpoint saves. Nothing depends on how fast a thread runs: the
tests wait for the work they start (or for its failure to be registered) before the loop
boundary that must report it.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import shutil
import threading
import time
from concurrent import futures

import jax
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, outer_loop, train_loop
from jaxloop.async_action_context import AsyncActionContext, get_async_action_context
from jaxloop.checkpointing import checkpoint
from jaxloop.metrics import writers

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def context():
    """The process-wide context, empty before and after the test."""
    ctx = get_async_action_context()
    ctx.check_exceptions_and_raise(raise_exception=False)
    yield ctx
    ctx.check_exceptions_and_raise(raise_exception=False)


def failed(error):
    future = futures.Future()
    future.set_exception(error)
    return future


def done(value=None):
    future = futures.Future()
    future.set_result(value)
    return future


def test_first_failure_is_raised_with_a_note_then_all_are_forgotten():
    ctx = AsyncActionContext()
    ctx.add_future("metrics export", done())
    ctx.add_future("upload to bucket", failed(ValueError("no space left")))
    ctx.add_future("second failure", failed(KeyError("later")))
    with pytest.raises(ValueError, match="no space left") as info:
        ctx.check_exceptions_and_raise()
    assert any("upload to bucket" in note for note in info.value.__notes__)
    assert ctx.futures == []
    ctx.check_exceptions_and_raise()  # nothing left to raise
    with pytest.raises(TypeError, match="concurrent.futures.Future"):
        ctx.add_future("not a future", 3)


def test_every_failure_is_reported_the_first_raised_the_others_logged(caplog):
    """Issue 42.8: three pieces of background work fail; the first error is raised (as
    google/jaxloop does), and the other two are logged, each with its traceback."""
    ctx = AsyncActionContext()

    def fail(error):
        raise error

    for name, error in [("upload", ValueError("no space left")),
                        ("export", KeyError("missing column")),
                        ("thumbnail", OSError("disk gone"))]:
        futures.wait([ctx.submit(name, fail, error)])
    with caplog.at_level(logging.ERROR, logger="jaxloop.async_action_context"):
        with pytest.raises(ValueError, match="no space left") as info:
            ctx.check_exceptions_and_raise()
    notes = " ".join(info.value.__notes__)
    assert "upload" in notes and "'export', 'thumbnail'" in notes
    logged = {r.getMessage(): r.exc_info for r in caplog.records}
    assert set(logged) == {"Background work 'export' failed:",
                           "Background work 'thumbnail' failed:"}
    assert [type(e[1]) for e in logged.values()] == [KeyError, OSError]
    assert all(e[2] is not None for e in logged.values())  # with their tracebacks
    assert "in fail" in caplog.text and "disk gone" in caplog.text


def test_errors_can_be_logged_instead_of_raised(caplog):
    ctx = AsyncActionContext()
    ctx.add_exception("summary upload", RuntimeError("offline"))
    with caplog.at_level(logging.ERROR, logger="jaxloop.async_action_context"):
        ctx.check_exceptions_and_raise(raise_exception=False)
    assert "summary upload" in caplog.text and "offline" in caplog.text
    assert ctx.futures == []


def test_without_waiting_only_finished_work_is_checked():
    ctx = AsyncActionContext()
    go = threading.Event()

    def slow_then_fail():
        go.wait(60)
        raise OSError("disk gone")

    future = ctx.submit("slow save", slow_then_fail)
    ctx.check_exceptions_and_raise(wait=False)  # still running: no error, kept
    assert [name for name, _ in ctx.futures] == ["slow save"]
    go.set()
    with pytest.raises(OSError, match="disk gone") as info:
        ctx.check_exceptions_and_raise()  # waits for it
    assert future.done()
    assert any("slow save" in note for note in info.value.__notes__)
    assert ctx.discard(future) is False  # already forgotten


def test_one_process_wide_context():
    assert get_async_action_context() is get_async_action_context()


def make_loop(end_actions):
    data = toy_data(n=32)
    batches = [{"x": data["x"][i:i + 8], "y": data["y"][i:i + 8]} for i in range(0, 32, 8)]
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    state = step.initialize_model([1, 16])
    return train_loop.TrainLoop(step, end_actions=end_actions), state, batches


class FailingBackgroundAction(actions.Action):
    """Starts background work that fails, on the first loop only, and waits until it has."""

    def __call__(self, state, outputs, loop_count=None, **kwargs):
        if loop_count == 1:
            work = get_async_action_context().submit(
                "uploading step files", self._upload, int(state.step))
            futures.wait([work])

    @staticmethod
    def _upload(step):
        raise ConnectionError(f"upload of step {step} failed")


def test_background_failure_surfaces_at_the_next_loop_boundary(context):
    loop, state, batches = make_loop([FailingBackgroundAction()])
    state, _ = loop(state, iter(batches), num_steps=2)  # the work fails after this loop
    with pytest.raises(ConnectionError, match="step 2") as info:
        loop(state, iter(batches), num_steps=2)
    assert any("uploading step files" in note for note in info.value.__notes__)
    assert context.futures == []


def test_outer_loop_waits_for_background_work_when_training_ends(context):
    class LateFailure(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            if int(state.step) == 4:  # after the last loop's boundary check
                get_async_action_context().submit("final export", _fail_export)

    loop, state, batches = make_loop([LateFailure()])
    outer = outer_loop.OuterLoop(train_loop=loop, progress=False, prefetch=0)
    with pytest.raises(RuntimeError, match="export failed") as info:
        outer(state, train_dataset=iter(batches * 2), train_total_steps=4, train_loop_steps=2)
    assert any("final export" in note for note in info.value.__notes__)


def _fail_export():
    raise RuntimeError("export failed")


class BrokenWriter:
    """A metric writer whose first write finds the disk full."""

    def __init__(self):
        self.written = []

    def write_scalars(self, step, scalars):
        if not self.written:
            self.written.append(None)
            raise OSError(f"cannot write step {step}: disk full")
        self.written.append(step)

    def flush(self):
        pass

    def close(self):
        pass


def test_async_writer_failure_surfaces_at_the_next_loop_boundary_once(context):
    writer = writers.AsyncWriter(BrokenWriter())
    loop, state, batches = make_loop([actions.SummaryAction(writer)])
    state, _ = loop(state, iter(batches), num_steps=2)
    deadline = time.monotonic() + 60  # the write happens on the writer's thread
    while not context.futures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [name for name, _ in context.futures] == ["AsyncWriter(BrokenWriter).write_scalars"]
    with pytest.raises(OSError, match="disk full"):
        loop(state, iter(batches), num_steps=2)
    writer.close()  # raised once already: not again
    assert writer.writer.written[1:] == [2]  # the first loop's other write went through


def test_async_checkpoint_saves_complete_without_a_thread_of_their_own(context, tmp_path):
    manager = checkpoint.make_manager(tmp_path / "ckpt", async_save=True)
    loop, state, batches = make_loop([actions.CheckpointAction(manager)])
    state, _ = loop(state, iter(batches), num_steps=2)
    assert context.futures == []  # orbax tracks its own save; nothing waits on it here
    assert not [t for t in threading.enumerate() if t.name.startswith("jaxloop-async")]
    manager.wait_until_finished()
    assert manager.all_steps() == [2]
    manager.close()


def test_a_failed_background_save_is_raised_once_at_the_next_boundary(context, tmp_path):
    """Issue 23.14: the first save's JSON item fails in orbax's background commit (a
    datetime is not JSON). The next loop's boundary raises it on the loop's thread, once:
    neither the end-of-training checks nor closing the manager raise it again, and the
    next save succeeds."""
    manager = checkpoint.make_manager(tmp_path / "ckpt", async_save=True)
    calls = []

    def meta():
        calls.append(None)
        return {"started": datetime.datetime(2025, 1, 1)} if len(calls) == 1 else {}

    action = actions.CheckpointAction(manager, meta=meta)
    loop, state, batches = make_loop([action])
    state, _ = loop(state, iter(batches), num_steps=2)  # saves step 2: fails off-thread
    fresh = loop.step.initialize_model([1, 16])
    with pytest.raises(TypeError, match="not JSON serializable"):
        loop(state, iter(batches), num_steps=2)
    context.check_exceptions_and_raise()  # what OuterLoop does when training ends
    manager.wait_until_finished()
    assert action(fresh.replace(step=10), None)
    manager.close()
    assert checkpoint.all_steps(tmp_path / "ckpt") == [10]


def test_a_failed_save_names_its_step_and_directory_and_the_state_stays_live(context, tmp_path):
    """Issue 42.8: the checkpoint directory stops being one mid-run (as root, permissions do
    not stop a write, so a regular file takes its place). The run fails loudly, naming the
    step that was lost and the directory; outer.state is live and training goes on from it
    into another directory."""
    directory = tmp_path / "ckpt"
    manager = checkpoint.make_manager(directory)

    class DiskGoes(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            if int(state.step) == 4:
                manager.wait_until_finished()  # step 2's save is complete
                shutil.rmtree(directory)
                directory.write_text("not a directory")

    loop, state, batches = make_loop([DiskGoes(), actions.CheckpointAction(manager)])
    outer = outer_loop.OuterLoop(train_loop=loop, progress=False, prefetch=0)
    with pytest.raises(OSError) as info:
        outer(state, train_dataset=itertools.cycle(batches), train_total_steps=10,
              train_loop_steps=2)
    assert any(f"checkpoint of step 4 to {directory} failed" in note
               for note in info.value.__notes__), info.value.__notes__
    live = outer.state
    assert jax.device_get(live.params) is not None and int(live.step) >= 4
    again = checkpoint.make_manager(tmp_path / "elsewhere")
    loop.end_actions[-1] = actions.CheckpointAction(again)
    final, _ = outer(live, train_dataset=itertools.cycle(batches), train_total_steps=10,
                     train_loop_steps=2)
    assert int(final.step) == 10
    again.close()
