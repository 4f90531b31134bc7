"""MFU (device peak table, CPU left out) and the goodput time split, measured for real."""

import time

import jax
import numpy as np
import optax
import pytest
from models import ClassifierStep, LinenMLP, toy_data

from jaxloop import actions, eval_loop, outer_loop, stat_loop, train_loop
from jaxloop.checkpointing import checkpoint
from jaxloop.diagnostics import goodput


def test_peak_table_and_mfu():
    assert goodput.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert goodput.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert goodput.peak_flops("NVIDIA H200") == 989e12
    assert goodput.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert goodput.peak_flops("TPU v4") == 275e12
    assert goodput.peak_flops("TPU v5 lite") == 197e12
    assert goodput.peak_flops("TPU v5") == 459e12
    assert goodput.peak_flops("TPU v6 lite") == 918e12
    assert goodput.peak_flops("cpu") is None and goodput.peak_flops() is None  # CPU here
    assert goodput.mfu(494.5e12, "NVIDIA H100 80GB HBM3") == pytest.approx(0.5)
    assert goodput.mfu(1e12) is None


def test_mfu_is_not_reported_on_cpu_and_bad_option_rejected():
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    state = step.initialize_model([1, 16])
    for flops in (1e6, "xla"):
        loop = stat_loop.StatLoop(step, global_batch_size=32, model_flops_per_example=flops)
        state, out = loop(state, iter([toy_data(32)] * 2), num_steps=2)
        assert stat_loop.STAT_MFU not in out and stat_loop.STAT_MFU_XLA not in out
    assert step.num_flops > 0  # 'xla' asked for the cost analysis
    with pytest.raises(ValueError, match="number or 'xla'"):
        stat_loop.StatLoop(step, model_flops_per_example="model")


class SlowInput:
    """An iterator that takes at least `delay` seconds per batch (like a slow file read)."""

    def __init__(self, n, delay):
        self.n, self.delay = n, delay

    def __iter__(self):
        return self

    def __next__(self):
        if self.n == 0:
            raise StopIteration
        self.n -= 1
        time.sleep(self.delay)
        return toy_data(32)


def test_time_split_covers_compile_input_compute_checkpoint_and_evaluation(tmp_path):
    recorder = goodput.Recorder()
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    eval_step = ClassifierStep(jax.random.key(0), LinenMLP())
    manager = checkpoint.make_manager(tmp_path / "ckpt")
    ckpt_start, ckpt_stop = recorder.span("checkpoint")
    eval_start, eval_stop = recorder.span("evaluation")
    per_loop = []

    class Keep(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            per_loop.append({k: v for k, v in outputs.items() if k.startswith("jaxloop/")})

    tl = train_loop.TrainLoop(
        step, recorder=recorder,
        end_actions=[Keep(), ckpt_start, actions.CheckpointAction(manager), ckpt_stop])
    el = eval_loop.EvalLoop(eval_step, begin_actions=[eval_start], end_actions=[eval_stop])
    # No background prefetch, so each loop waits for its own (slow) batches.
    outer = outer_loop.OuterLoop(train_loop=tl, eval_loops=[el], prefetch=0)
    outer(step.initialize_model([1, 16]), SlowInput(9, 0.02), train_total_steps=9,
          train_loop_steps=3, eval_specs=[outer_loop.EvalSpec(dataset=[toy_data(32)] * 2)])
    manager.wait_until_finished()
    manager.close()
    totals = recorder.totals()

    assert len(per_loop) == 3
    first, later = per_loop[0], per_loop[1:]
    assert first["jaxloop/time/compile_secs"] > 0  # the train step compiled in loop 1
    assert all(loop["jaxloop/time/input_secs"] >= 3 * 0.02 for loop in per_loop)
    # Loops 2 and 3 include the previous loop's checkpoint save and evaluation.
    assert all(loop["jaxloop/time/checkpoint_secs"] > 0 for loop in later)
    assert all(loop["jaxloop/time/evaluation_secs"] > 0 for loop in later)
    for split in [*per_loop, {f"jaxloop/time/{k}_secs": v for k, v in totals.items()}]:
        parts = [split[f"jaxloop/time/{c}_secs"] for c in goodput.CATEGORIES]
        assert all(p >= 0 for p in parts)
        wall = split["jaxloop/time/wall_secs"]
        assert sum(parts) + split["jaxloop/time/other_secs"] == pytest.approx(wall)
        assert split["jaxloop/time/other_secs"] >= -1e-3 * wall  # the parts are disjoint
    assert 0 < first["jaxloop/goodput"] < 1
    np.testing.assert_allclose(
        sum(loop["jaxloop/time/input_secs"] for loop in per_loop), totals["input"], rtol=1e-6)
