"""Input that scales with cores: `GlobalBatchDataset` read in grain worker processes gives
the batches read in the caller's thread, resumes exactly (positions restored, SIGKILL), and
a user's own grain pipeline with workers trains through the prefetcher too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grain
import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import data, outer_loop, train_loop
from jaxloop.checkpointing import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

JOB = Path(__file__).resolve().parent / "workers_job.py"


def augment(example):
    """Per-record Python work, as a decode or augmentation would be (picklable: workers
    are new processes)."""
    x = example["x"]
    return {"x": (x[::-1] * 0.5 + np.tanh(x)).astype(np.float32), "y": example["y"]}


def test_workers_give_the_batches_read_in_the_callers_thread_and_restore_positions():
    source = data.ArraySource(toy_data(96))
    inline = data.GlobalBatchDataset(source, 16, seed=4, transform=augment, num_epochs=2)
    workers = data.GlobalBatchDataset(source, 16, seed=4, transform=augment, num_epochs=2,
                                      num_workers=2)
    expected = list(inline)
    it = iter(workers)
    got = [next(it) for _ in range(5)]
    position = it.get_state()
    assert position["next_batch"] == 5
    it.close()
    again = iter(workers)
    data.restore_iterator_state(again, position)  # workers restart at batch 5
    got += list(again)
    assert len(got) == len(expected) == 12
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a["x"], b["x"])
        np.testing.assert_array_equal(a["y"], b["y"])
    again.close()


def test_a_users_grain_pipeline_with_workers_trains_and_keeps_its_position():
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    ds = (grain.MapDataset.source(data.ArraySource(toy_data(256))).map(augment).batch(16)
          .to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
    it = iter(ds)
    outer = outer_loop.OuterLoop(train_loop.TrainLoop(step), prefetch=2)
    state, outputs = outer(step.initialize_model([1, 16]), it, train_total_steps=6,
                           train_loop_steps=3)
    assert int(state.step) == 6 and len(outputs["loss"]) == 3
    # The prefetcher handed back the batches it had read ahead: the iterator goes on at 6.
    following = next(it)
    reference = list(grain.MapDataset.source(data.ArraySource(toy_data(256))).map(augment)
                     .batch(16))[6]
    np.testing.assert_array_equal(following["x"], reference["x"])
    it.close()


def run_job(workdir, results):
    return subprocess.Popen(
        [sys.executable, str(JOB), str(workdir), str(results)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # the job and its grain workers: one process group
    )


def test_sigkill_with_workers_then_resume_is_bit_identical(tmp_path):
    whole = run_job(tmp_path / "whole", tmp_path / "whole.json")
    _, err = whole.communicate(timeout=400)
    assert whole.returncode == 0, err[-3000:]
    uninterrupted = json.loads((tmp_path / "whole.json").read_text())

    ckpt = tmp_path / "resumed" / "checkpoints"
    proc = run_job(tmp_path / "resumed", tmp_path / "resumed.json")
    deadline = time.monotonic() + 300
    while not (ckpt.exists() and any(s >= 20 for s in checkpoint.all_steps(ckpt))):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # As a scheduler ends a job: the whole group at once. (grain's workers wait on their
    # parent's stop event, so a worker outlives a parent killed alone.)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert max(checkpoint.all_steps(ckpt)) < uninterrupted["step"]
    again = run_job(tmp_path / "resumed", tmp_path / "resumed.json")
    _, err = again.communicate(timeout=400)
    assert again.returncode == 0, err[-3000:]
    assert json.loads((tmp_path / "resumed.json").read_text()) == uninterrupted
