"""Throughput as large-model teams read it: MFU with a peak the user gives (CPU has none in
the table), model TFLOP/s per device, tokens/s from a masked LM batch, and the notice for
a device whose peak is unknown."""

import logging

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from models import ClassifierStep, LinenMLP, toy_data
from test_trainers import TinyLM

from jaxloop import partition, stat_loop, train_loop
from jaxloop.diagnostics import goodput
from jaxloop.trainers.transformer_step import TransformerStep


def test_mfu_from_a_user_given_peak_on_cpu():
    part = partition.DataParallelPartitioner(Mesh(np.array(jax.devices()), ("data",)))
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1),
                          partitioner=part, train=True)
    state = step.initialize_model([1, 16])
    flops, peak = 3 * 2 * (16 * 32 + 32 * 10), 1e9
    loop = stat_loop.StatLoop(step, global_batch_size=32, model_flops_per_example=flops,
                              peak_flops_per_device=peak)
    for _ in range(2):  # run the cell twice: each loop reports its own figures
        state, out = loop(state, iter([toy_data(32)] * 3), num_steps=3)
        per_device = flops * 32 * loop.stats[stat_loop.STAT_STEPS_PER_SEC] / 8
        assert out[stat_loop.STAT_MODEL_TFLOPS] == pytest.approx(per_device / 1e12)
        assert out[stat_loop.STAT_MFU] == pytest.approx(per_device / peak)
    assert goodput.mfu(2e12, peak=4e12) == 0.5


def test_unknown_peak_gives_tflops_and_one_notice(caplog):
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    state = step.initialize_model([1, 16])
    loop = stat_loop.StatLoop(step, global_batch_size=32, model_flops_per_example=1e6)
    state, out = loop(state, iter([toy_data(32)] * 2), num_steps=2)
    assert stat_loop.STAT_MFU not in out and out[stat_loop.STAT_MODEL_TFLOPS] > 0
    with caplog.at_level(logging.WARNING, logger="jaxloop.diagnostics.goodput"):
        assert goodput.resolved_peak(None, "Made-up accelerator 9") is None
        assert goodput.resolved_peak(None, "Made-up accelerator 9") is None
        assert goodput.resolved_peak(5e14, "Made-up accelerator 9") == 5e14
    notices = [r for r in caplog.records if "Made-up accelerator 9" in r.getMessage()]
    assert len(notices) == 1 and "peak_flops_per_device" in notices[0].getMessage()


def lm_batches(masks):
    rng = np.random.default_rng(0)
    for mask in masks:
        ids = rng.integers(0, 12, size=mask.shape).astype(np.int32)
        yield {"input_features": {"input_ids": ids, "attention_mask": mask},
               "output_features": {"labels": ids}}


def test_tokens_per_sec_of_a_masked_lm_batch_match_a_hand_count():
    rng = np.random.default_rng(1)
    # Rows of 8 tokens, each with a random number of real tokens (the rest padding).
    masks = [(np.arange(8)[None, :] < rng.integers(1, 9, size=(4, 1))).astype(np.int32)
             for _ in range(3)]
    hand_count = sum(int(m.sum()) for m in masks)
    assert hand_count < 3 * 4 * 8  # padding is not counted
    step = TransformerStep(jax.random.key(0), TinyLM(), optimizer=optax.adam(1e-2), train=True)
    state = step.initialize_model({"input_features": {"input_ids": ([4, 8], "int32"),
                                                      "attention_mask": ([4, 8], "int32")}})
    key = ("input_features", "attention_mask")
    loop = train_loop.TrainLoop(step, tokens_key=key, model_flops_per_token=6 * step.num_params,
                                peak_flops_per_device=1e9)
    state, out = loop(state, lm_batches(masks), num_steps=3)
    # Rates leave the compilation out of the loop's time.
    seconds = loop.stats[stat_loop.STAT_LOOP_TIME_SECS] - loop.compile_secs
    assert out[stat_loop.STAT_TOKENS_PER_SEC] * seconds == pytest.approx(hand_count)
    tflops = 6 * step.num_params * out[stat_loop.STAT_TOKENS_PER_SEC] / 1e12
    assert out[stat_loop.STAT_MODEL_TFLOPS] == pytest.approx(tflops)  # one device
    assert out[stat_loop.STAT_MFU] == pytest.approx(tflops * 1e12 / 1e9)
    # Batches already on the devices count there, with no per-step transfer.
    placed = [step.partitioner.shard_batch(b) for b in lm_batches(masks)]
    state, out = loop(state, iter(placed), num_steps=3)
    seconds = loop.stats[stat_loop.STAT_LOOP_TIME_SECS] - loop.compile_secs
    assert out[stat_loop.STAT_TOKENS_PER_SEC] * seconds == pytest.approx(hand_count)


def test_bad_throughput_options_are_clear_errors():
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    state = step.initialize_model([1, 16])
    with pytest.raises(ValueError, match="model_flops_per_token needs tokens_key"):
        stat_loop.StatLoop(step, model_flops_per_token=1e6)
    with pytest.raises(ValueError, match="peak_flops_per_device must be positive"):
        stat_loop.StatLoop(step, peak_flops_per_device=0)
    loop = stat_loop.StatLoop(step, tokens_key="mask")
    with pytest.raises(ValueError, match=r"no entry 'mask'.*\['x', 'y'\]"):
        loop(state, iter([toy_data(32)]), num_steps=1)


def test_the_first_loops_rates_leave_its_compilation_out_and_report_it_apart():
    """A notebook cell run twice: the first run compiles the step, the second does not.
    Steps/s (and so MFU) cover the steps only; the compilation is reported beside them."""
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.sgd(0.1), train=True)
    state = step.initialize_model([1, 16])
    loop = train_loop.TrainLoop(step, global_batch_size=32, model_flops_per_example=1e3,
                                peak_flops_per_device=1e9,
                                stat_names=[stat_loop.STAT_COMPILE_SECS])
    for run in range(2):
        state, out = loop(state, iter([toy_data(32)] * 4), num_steps=4)
        stats = loop.stats
        assert out[stat_loop.STAT_COMPILE_SECS] == loop.compile_secs
        steps_secs = stats[stat_loop.STAT_LOOP_TIME_SECS] - loop.compile_secs
        assert stats[stat_loop.STAT_STEPS_PER_SEC] == pytest.approx(4 / steps_secs)
        assert stats[stat_loop.STAT_MFU] == pytest.approx(
            1e3 * 32 * stats[stat_loop.STAT_STEPS_PER_SEC] / 1e9)
        if run == 0:
            assert 0 < loop.compile_secs < stats[stat_loop.STAT_LOOP_TIME_SECS]
        else:
            assert loop.compile_secs == 0.0
