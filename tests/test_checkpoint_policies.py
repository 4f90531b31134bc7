"""Checkpoint policies: time-based saves (agreed across processes) and warm starts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from models import ClassifierStep, LinenMLP, NnxMLP, toy_data

from jaxloop import actions, data, partition, train_loop
from jaxloop.checkpointing import checkpoint

REPO = Path(__file__).resolve().parents[1]


class ManualClock:
    """A clock the test moves by hand: `clock=` is CheckpointAction's own parameter."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _train(tmp_path: Path, action_factory, loops: int = 6, on_loop=None):
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    manager = checkpoint.make_manager(tmp_path / "ckpt", max_to_keep=None, async_save=False)
    action = action_factory(manager)
    saved = []

    class Record(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            if on_loop is not None:
                on_loop()
            saved.append(bool(action(state, outputs, **kwargs)))

    loop = train_loop.TrainLoop(step, end_actions=[Record()])
    state = step.initialize_model([1, 16])
    dataset = iter(data.GlobalBatchDataset(toy_data(128), 16, seed=1))
    for _ in range(loops):
        state, _ = loop(state, dataset, num_steps=2)
    manager.close()
    return saved, checkpoint.all_steps(tmp_path / "ckpt"), state


def test_time_based_saves_happen_when_due(tmp_path):
    clock = ManualClock()

    def advance():
        clock.now += 100.0  # each loop "takes" 100 s

    saved, steps, _ = _train(
        tmp_path, lambda m: actions.CheckpointAction(m, every_secs=250, clock=clock),
        on_loop=advance,
    )
    # Due at 300 s (loop 3, step 6) and 600 s (loop 6, step 12): counted from the last save.
    assert saved == [False, False, True, False, False, True]
    assert steps == [6, 12]


def test_time_based_save_ignores_the_managers_step_policy(tmp_path):
    clock = ManualClock()
    step = ClassifierStep(jax.random.key(0), LinenMLP(), optimizer=optax.adam(1e-2), train=True)
    state = step.initialize_model([1, 16])
    manager = checkpoint.make_manager(
        tmp_path / "ckpt", max_to_keep=None, async_save=False, save_interval_steps=1000
    )
    action = actions.CheckpointAction(manager, every_secs=60, clock=clock)
    assert action(state.replace(step=3), None) is False  # not due yet
    clock.now = 61.0
    assert action(state.replace(step=7), None) is True  # due: saved off the step grid
    assert action(state.replace(step=7), None) is False  # no double save, no time reset
    clock.now = 100.0
    assert action(state.replace(step=9), None) is False  # 39 s since the save at 61 s
    # A forced save (preemption) saves and restarts the time.
    assert action(state.replace(step=10), None, force=True) is True
    clock.now = 140.0
    assert action(state.replace(step=11), None) is False
    manager.close()
    assert checkpoint.all_steps(tmp_path / "ckpt") == [7, 10]


def test_default_checkpoint_action_saves_every_call(tmp_path):
    saved, steps, _ = _train(tmp_path, lambda m: actions.CheckpointAction(m), loops=3)
    assert saved == [True, True, True]
    assert steps == [2, 4, 6]


@pytest.mark.parametrize("bad", [0, -5, "600", True])
def test_every_secs_must_be_positive(tmp_path, bad):
    manager = checkpoint.make_manager(tmp_path / "ckpt", async_save=False)
    with pytest.raises(ValueError, match="every_secs"):
        actions.CheckpointAction(manager, every_secs=bad)
    manager.close()


POLICY_JOB = REPO / "tests" / "checkpoint_policy_job.py"
POLICY_JOB_TIMEOUT = 180


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(POLICY_JOB_TIMEOUT + 60)
def test_two_processes_follow_process_zeros_clock(tmp_path):
    """Process 1's clock says a save is due at every loop, process 0's only at loops 3 and
    6: both processes save exactly where process 0 says (no hang, same checkpoints)."""
    from test_multiprocess import job_envs, run_to_success  # noqa: PLC0415

    command = [sys.executable, str(POLICY_JOB), str(tmp_path)]
    run_to_success("time-based checkpoint job", [command] * 2, job_envs(2), tmp_path / "logs",
                   timeout=POLICY_JOB_TIMEOUT)
    results = [json.loads((tmp_path / f"result-{i}.json").read_text()) for i in range(2)]
    assert [r["process_count"] for r in results] == [2, 2]
    for r in results:
        assert r["saved"] == [False, False, True, False, False, True], r
        assert r["checkpoints"] == [6, 12], r
        assert r["step"] == 12


# Warm start
# ----------------------------------------------------------------------------------------


class Classifier(nn.Module):
    """A Dense backbone and a head; `backbone_name` renames the backbone's parameters."""

    classes: int = 10
    backbone_name: str = "backbone"
    extra: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name=self.backbone_name)(x.reshape((x.shape[0], -1))))
        if self.extra:
            x = nn.Dense(32, name="adapter")(x)
        return nn.Dense(self.classes, name="head")(x)


def _step(model, partitioner=None, seed=0):
    return ClassifierStep(jax.random.key(seed), model, optimizer=optax.adam(1e-2),
                          partitioner=partitioner, train=True)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """Model A (backbone + 10-class head) trained 6 steps, checkpointed the jaxloop way."""
    workdir = tmp_path_factory.mktemp("run_a")
    step = _step(Classifier(classes=10))
    manager = checkpoint.make_manager(workdir / "ckpt", async_save=False)
    loop = train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)])
    state, _ = loop(step.initialize_model([1, 16]),
                    iter(data.GlobalBatchDataset(toy_data(128), 16, seed=1)), num_steps=6)
    manager.close()
    return workdir / "ckpt", jax.device_get(state.params)


def _fresh_b(**kwargs):
    step = _step(Classifier(classes=3, **kwargs), seed=7)
    return step, step.initialize_model([1, 16])


def _equal(a, b):
    return all(jax.tree.leaves(jax.tree.map(
        lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


def test_warm_start_new_head_loads_backbone_keeps_head_and_optimizer_fresh(run_a, caplog):
    ckpt, params_a = run_a
    step_b, fresh = _fresh_b()
    with caplog.at_level("WARNING", logger="jaxloop.checkpointing.checkpoint"):
        warm = checkpoint.warm_start(fresh, ckpt, rename={"head/": None}, strict=False)
    assert _equal(warm.params["backbone"], params_a["backbone"])
    assert not _equal(fresh.params["backbone"], params_a["backbone"])
    assert _equal(warm.params["head"], fresh.params["head"])  # the 3-class head stays fresh
    assert warm.params["head"]["kernel"].shape == (32, 3)
    assert int(warm.step) == 0
    assert _equal(warm.opt_state, fresh.opt_state)
    assert "head/bias" in caplog.text and "head/kernel" in caplog.text  # listed as missing
    # The warm-started state trains.
    loop = train_loop.TrainLoop(step_b)
    trained, _ = loop(warm, iter([{"x": np.ones((4, 16), np.float32),
                                   "y": np.array([0, 1, 2, 0], np.int32)}]), num_steps=1)
    assert int(trained.step) == 1


def test_warm_start_strict_errors_name_keys_and_shapes(run_a):
    ckpt, _ = run_a
    _, fresh = _fresh_b()
    with pytest.raises(ValueError, match=r"head/kernel \(32, 10\) -> head/kernel \(32, 3\)"):
        checkpoint.warm_start(fresh, ckpt)
    with pytest.raises(ValueError, match=r"missing .*\['head/bias', 'head/kernel'\]"):
        checkpoint.warm_start(fresh, ckpt, rename={"head/": None})
    _, with_adapter = _fresh_b(extra=True)
    with pytest.raises(ValueError, match=r"\['adapter/bias', 'adapter/kernel', 'head/bias'"):
        checkpoint.warm_start(with_adapter, ckpt, rename={"head/": None})
    _, renamed = _fresh_b(backbone_name="encoder")
    with pytest.raises(ValueError, match=r"unexpected .*backbone/bias.*backbone/kernel"):
        checkpoint.warm_start(renamed, ckpt, rename={"head/": None})
    with pytest.raises(ValueError, match="no checkpoint for step 5"):
        checkpoint.warm_start(fresh, ckpt, step=5)
    with pytest.raises(TypeError, match="rename"):
        checkpoint.warm_start(fresh, ckpt, rename=["head/"])


def test_warm_start_renames_prefixes_and_by_callable(run_a):
    ckpt, params_a = run_a
    _, fresh = _fresh_b(backbone_name="encoder")
    warm = checkpoint.warm_start(fresh, ckpt, rename={"backbone/": "encoder/", "head/": None},
                                 strict=False)
    assert _equal(warm.params["encoder"], params_a["backbone"])

    def keep_backbone(name):
        return name.replace("backbone/", "encoder/") if name.startswith("backbone/") else None

    warm = checkpoint.warm_start(fresh, ckpt, rename=keep_backbone, strict=False)
    assert _equal(warm.params["encoder"], params_a["backbone"])
    assert _equal(warm.params["head"], fresh.params["head"])


def test_warm_start_from_a_guide_way_single_item_checkpoint(tmp_path):
    step = _step(Classifier(classes=10), seed=3)
    state = step.initialize_model([1, 16])
    # The Jaxloop guide's way: one unnamed item holding a whole state (step dirs ckpt_4).
    manager = ocp.CheckpointManager(tmp_path / "guide", options=ocp.CheckpointManagerOptions(
        create=True, enable_async_checkpointing=False, step_prefix="ckpt"))
    manager.save(4, args=ocp.args.PyTreeSave(state))
    manager.close()
    _, fresh = _fresh_b()
    warm = checkpoint.warm_start(fresh, tmp_path / "guide", rename={"head/": None},
                                 strict=False)
    assert _equal(warm.params["backbone"], jax.device_get(state.params["backbone"]))
    same = checkpoint.warm_start(_step(Classifier(classes=10))
                                 .initialize_model([1, 16]), tmp_path / "guide")
    assert _equal(same.params, jax.device_get(state.params))
    assert int(same.step) == 0


def test_warm_start_nnx_model_with_a_new_head(tmp_path):
    def nnx_state(classes, seed):
        model = NnxMLP(16, 32, classes, rngs=nnx.Rngs(seed))
        return _step(model, seed=seed).initialize_model([1, 16])

    source = nnx_state(10, 0)
    manager = checkpoint.make_manager(tmp_path / "ckpt", async_save=False)
    checkpoint.save(manager, 5, source)
    manager.close()
    fresh = nnx_state(3, 1)
    warm = checkpoint.warm_start(fresh, tmp_path / "ckpt", rename={"dense2/": None},
                                 strict=False)
    assert _equal(warm.params["dense1"], jax.device_get(source.params["dense1"]))
    assert _equal(warm.params["dense2"], jax.device_get(fresh.params["dense2"]))


def test_warm_start_places_params_like_the_target_state(run_a):
    ckpt, params_a = run_a
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    part = partition.FSDPPartitioner(mesh, "data", min_weight_size=64)
    step = _step(Classifier(classes=3), partitioner=part, seed=7)
    fresh = step.initialize_model([1, 16])
    warm = checkpoint.warm_start(fresh, ckpt, rename={"head/": None}, strict=False,
                                 partitioner=part)
    for new, old in zip(jax.tree.leaves(warm.params), jax.tree.leaves(fresh.params),
                        strict=True):
        assert new.sharding.is_equivalent_to(old.sharding, new.ndim), (new.sharding,
                                                                         old.sharding)
    kernel = warm.params["backbone"]["kernel"]
    assert not kernel.sharding.is_fully_replicated  # (16, 32) split over 8 devices
    assert _equal(warm.params["backbone"], params_a["backbone"])


def test_digits_checks_the_checkpoint_policy_flags(capsys):
    from jaxloop.examples import digits  # noqa: PLC0415

    with pytest.raises(SystemExit):
        digits.parse_args(["--checkpoint-every-secs", "0"])
    assert "--checkpoint-every-secs must be positive" in capsys.readouterr().err
    args = digits.parse_args(["--checkpoint-every-secs", "600", "--warm-start", "/runs/a"])
    assert args.checkpoint_every_secs == 600 and args.warm_start == "/runs/a"
    assert digits.parse_args([]).checkpoint_every_secs is None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_digits_warm_start_and_time_based_flags(tmp_path):
    eam = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from test_digits import run_digits  # noqa: PLC0415

    short = ("--train-steps", "100", "--train-loop-steps", "100")
    run_digits(tmp_path / "a", *short)
    # A new run from run a's parameters, two loops; no save falls due by its clock (the
    # run is bounded far below an hour), so only the final state is saved, at the end.
    step, _, _, _ = run_digits(tmp_path / "b", "--train-steps", "100", "--train-loop-steps",
                               "50", "--warm-start", str(tmp_path / "a" / "checkpoints"),
                               "--checkpoint-every-secs", "3600")
    assert step == 100
    assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == ["100"]
    assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["100"]
    assert (tmp_path / "b" / "checkpoints.STOPPED").exists()

    def first_loss(run):
        acc = eam.EventAccumulator(str(tmp_path / run / "train"),
                                   size_guidance={eam.SCALARS: 0})
        acc.Reload()
        return acc.Scalars("loss")[0].value

    # Run b starts where run a ended (trained), far below a's untrained first loss.
    assert first_loss("b") < 0.5 * first_loss("a"), (first_loss("a"), first_loss("b"))
