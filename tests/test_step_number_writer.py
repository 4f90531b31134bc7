"""jaxloop.step_number_writer: the writer interface, the local file writer, StepNumberAction."""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, train_loop
from jaxloop.step_number_writer import LocalFileStepNumberWriter, StepNumberWriter

pytestmark = pytest.mark.timeout(120)

LINE = re.compile(r"^timestamp_ms:(\d+),step_number:(-?\d+)$")


def read_entries(path):
    lines = path.read_text().splitlines()
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    return [(int(m.group(1)), int(m.group(2))) for m in matches]


def test_file_is_created_empty_at_construction_and_lines_are_appended(tmp_path):
    path = tmp_path / "run" / "steps.txt"  # parent directories are created
    writer = LocalFileStepNumberWriter(path)
    assert path.read_text() == ""  # "started, no step yet"
    before = time.time_ns() // 1_000_000
    writer.write(10)
    writer.write(np.int64(20))
    writer.write(jnp.asarray(30, jnp.int32))
    after = time.time_ns() // 1_000_000
    entries = read_entries(path)
    assert [step for _, step in entries] == [10, 20, 30]
    stamps = [ts for ts, _ in entries]
    assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= after
    # A restarted job starts the file afresh; steps may then go backwards.
    again = LocalFileStepNumberWriter(str(path))
    assert path.read_text() == ""
    again.write(5)
    assert [step for _, step in read_entries(path)] == [5]
    with pytest.raises(TypeError, match="integer"):
        again.write(1.5)


def test_step_number_writer_is_abstract():
    with pytest.raises(TypeError):
        StepNumberWriter()

    class Recording(StepNumberWriter):
        def __init__(self):
            self.steps = []

        def write(self, step_number):
            self.steps.append(step_number)

    recording = Recording()
    recording.write(3)
    assert recording.steps == [3]


def test_step_number_action_writes_at_loop_ends_with_any_writer(tmp_path):
    data = toy_data(n=32)
    batches = [{"x": data["x"][i:i + 8], "y": data["y"][i:i + 8]} for i in range(0, 32, 8)]
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    state = step.initialize_model([1, 16])

    class Recording(StepNumberWriter):
        def __init__(self):
            self.steps = []

        def write(self, step_number):
            self.steps.append(step_number)

    recording = Recording()
    file_writer = LocalFileStepNumberWriter(tmp_path / "steps.txt")
    loop = train_loop.TrainLoop(step, end_actions=[
        actions.StepNumberAction(file_writer),
        actions.StepNumberAction(recording, interval=2),
    ])
    for _ in range(4):
        state, _ = loop(state, iter(batches), num_steps=2)
    assert [s for _, s in read_entries(tmp_path / "steps.txt")] == [2, 4, 6, 8]
    assert recording.steps == [4, 8]
    assert actions.StepNumberFileWriter is LocalFileStepNumberWriter
    with pytest.raises(TypeError, match="StepNumberWriter"):
        actions.StepNumberAction("steps.txt")
