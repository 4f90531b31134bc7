"""`run` written the NNX way, as an NNX user writes it: the model as an nnx.Module, its
optimizer as an nnx.Optimizer, nnx metrics; train and eval modes, dropout keys from the step,
fused steps, every partitioner from NNX annotations, checkpoints and resume, the caller's
model untouched, and errors that name the fix."""

import difflib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from models import toy_data

from jaxloop import actions, data, eval_loop, outer_loop, partition, train_loop
from jaxloop import step as step_lib
from jaxloop.checkpointing import checkpoint
from jaxloop.recipes import accumulate, ema


class Net(nnx.Module):
    """Dropout and BatchNorm; the dropout layer holds the RNG stream it was built with."""

    def __init__(self, din=16, hidden=32, *, rngs, kernel_init=None, kernel_metadata=None):
        init = kernel_init or nnx.initializers.lecun_normal()
        self.dense1 = nnx.Linear(din, hidden, kernel_init=init, rngs=rngs,
                                 kernel_metadata=kernel_metadata or {})
        self.bn = nnx.BatchNorm(hidden, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.dense2 = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.drop(nnx.relu(self.bn(self.dense1(x)))))


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, logits


class NnxStep(step_lib.Step):
    def metrics(self):
        return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                               loss=nnx.metrics.Average("loss"))


class TrainStep(NnxStep):
    def run(self, model, optimizer, metrics, batch):
        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["y"])
        optimizer.update(model, grads)
        return {"logits": logits}


class EvalStep(NnxStep):
    def run(self, model, metrics, batch):
        loss, logits = loss_fn(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["y"])
        return {"logits": logits}


def train_step(model=None, **kwargs):
    return TrainStep(jax.random.key(0), model or Net(rngs=nnx.Rngs(0)),
                     optimizer=optax.adam(1e-2), train=True, **kwargs)


def batches(n, size=32):
    return [toy_data(size, seed=s) for s in range(n)]


def leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(
        jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True))


def test_run_gets_the_model_an_optimizer_and_metrics_and_trains():
    step = train_step()
    state = step.initialize_model([1, 16])
    data = batches(1)[0]
    first = None
    for _ in range(25):
        state, out = step(state, data)
        first = first or float(out["loss"].compute())
    assert int(state.step) == 25  # optimizer.update advanced the state's step
    assert float(out["loss"].compute()) < 0.5 * first
    assert 0.0 <= float(out["accuracy"].compute()) <= 1.0
    # BatchNorm's running statistics are carried in the state, as a linen model's are.
    assert not np.allclose(state.batch_stats["bn"]["mean"], 0)


def test_train_mode_draws_fresh_masks_per_step_and_eval_mode_none():
    step, evaluate = train_step(), EvalStep(jax.random.key(0), Net(rngs=nnx.Rngs(0)))
    state = step.initialize_model([1, 16])
    data = batches(1)[0]
    frozen = TrainStep(jax.random.key(0), Net(rngs=nnx.Rngs(0)), optimizer=optax.sgd(0.0),
                       train=True)
    start = frozen.initialize_model([1, 16])
    _, a = frozen(start, data)
    _, b = frozen(start.replace(step=start.step + 1), data)
    _, again = frozen(start, data)
    # Train mode: the mask is a pure function of (base key, step).
    assert not np.array_equal(a["logits"], b["logits"])
    np.testing.assert_array_equal(a["logits"], again["logits"])
    # Eval mode: no dropout, BatchNorm on its running averages (which eval leaves alone).
    _, e1 = evaluate(state, data)
    new_state, e2 = evaluate(state.replace(step=state.step + 1), data)
    np.testing.assert_array_equal(e1["logits"], e2["logits"])
    assert leaves_equal(new_state.batch_stats, state.batch_stats)
    model = nnx.merge(*nnx.split(Net(rngs=nnx.Rngs(0))))
    nnx.update(model, nnx.State({"dense1": state.params["dense1"],
                                 "dense2": state.params["dense2"],
                                 "bn": {**state.params["bn"], **state.batch_stats["bn"]}}))
    model.eval()
    np.testing.assert_allclose(e1["logits"], model(data["x"]), rtol=1e-5, atol=1e-5)
    del step


class RngsStep(NnxStep):
    """Flax's tutorial way: the model holds no stream, run takes `rngs`."""

    def run(self, model, optimizer, rngs, batch):
        def loss(model, rngs):
            return model(batch["x"], rngs).mean()

        value, grads = nnx.value_and_grad(loss)(model, rngs)
        optimizer.update(model, grads)
        return {"loss": value}


class CallDropout(nnx.Module):
    def __init__(self, *, rngs):
        self.dense = nnx.Linear(16, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return self.drop(self.dense(x), rngs=rngs)


def test_rngs_passed_to_run_come_from_the_steps_key_and_step():
    def losses(seed):
        step = RngsStep(jax.random.key(seed), CallDropout(rngs=nnx.Rngs(0)),
                        optimizer=optax.sgd(0.0), train=True)
        state = step.initialize_model([1, 16])
        out = []
        for _ in range(3):
            state, o = step(state, toy_data(8))
            out.append(float(o["loss"]))
        return out

    first = losses(0)
    assert len(set(first)) == 3  # a new mask each step
    assert losses(0) == first  # the same key and steps: the same masks
    assert losses(1) != first


def test_steps_per_execution_is_bit_identical_to_one_step_per_call():
    data = batches(8)
    results = {}
    for k in (1, 4):
        step = train_step()
        loop = train_loop.TrainLoop(step, steps_per_execution=k)
        state, out = loop(step.initialize_model([1, 16]), iter(data), num_steps=8)
        results[k] = state, float(out["loss"].compute())
    assert int(results[4][0].step) == 8
    assert leaves_equal(results[1][0], results[4][0])
    assert results[1][1] == results[4][1]


def annotated(kind):
    """The model's first kernel annotated the NNX way, on mesh axes: with_partitioning or
    `sharding=` metadata."""
    if kind == "with_partitioning":
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        return Net(64, 128, rngs=nnx.Rngs(0), kernel_init=init)
    return Net(64, 128, rngs=nnx.Rngs(0), kernel_metadata={"sharding": (None, "model")})


def partitioner(name):
    devices = np.array(jax.devices())
    if name == "dp":
        return partition.DataParallelPartitioner(Mesh(devices, ("data",)))
    if name == "fsdp":
        return partition.FSDPPartitioner(Mesh(devices, ("data",)), min_weight_size=256)
    rules = [("embed", None), ("mlp", "model")] if name == "spmd-logical" else None
    return partition.SPMDPartitioner(Mesh(devices.reshape(4, 2), ("data", "model")),
                                     logical_axis_rules=rules)


def wide_data(n=3):
    return [toy_data(32, din=64, seed=s) for s in range(n)]


def losses_of(step):
    state = step.initialize_model([1, 64])
    out = []
    for batch in wide_data():
        state, o = step(state, batch)
        out.append(float(o["loss"].compute()))
    return state, out


@functools.cache
def single_device_losses():
    return losses_of(TrainStep(jax.random.key(0), Net(64, 128, rngs=nnx.Rngs(0)),
                               optimizer=optax.adam(1e-2), train=True))[1]


@pytest.mark.parametrize("name", ["dp", "fsdp", "spmd", "spmd-logical"])
def test_every_partitioner_places_and_trains_an_nnx_native_step(name):
    part = partitioner(name)
    kwargs = {}
    if name == "spmd":
        with jax.set_mesh(part.mesh):  # nnx creates annotated variables in place
            model = annotated("with_partitioning")
    elif name == "spmd-logical":  # built by the step, under the partitioner's rules
        model, kwargs = Net, {"nnx_model_args": (64, 128), "kernel_init": nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("embed", "mlp"))}
    else:
        model = Net(64, 128, rngs=nnx.Rngs(0))
    state, losses = losses_of(TrainStep(jax.random.key(0), model, optimizer=optax.adam(1e-2),
                                        partitioner=part, train=True, **kwargs))
    if name != "spmd-logical":  # the same initial values as the reference
        np.testing.assert_allclose(losses, single_device_losses(), rtol=2e-4)
    assert np.isfinite(losses).all()
    kernel = state.params["dense1"]["kernel"]
    moment = state.opt_state[0].mu["dense1"]["kernel"]
    expected = {"dp": P(), "fsdp": P(None, "data"),
                "spmd": P(None, "model"), "spmd-logical": P(None, "model")}[name]
    assert kernel.sharding.spec == expected == moment.sharding.spec
    assert kernel.sharding.mesh.size == 8


def test_sharding_metadata_places_like_with_partitioning():
    part = partitioner("spmd")
    with jax.set_mesh(part.mesh):
        model = annotated("sharding")
    state, losses = losses_of(TrainStep(jax.random.key(0), model, optimizer=optax.adam(1e-2),
                                        partitioner=part, train=True))
    assert state.params["dense1"]["kernel"].sharding.spec == P(None, "model")
    assert np.isfinite(losses).all()


def test_the_callers_model_is_never_changed_or_deleted():
    model = Net(rngs=nnx.Rngs(0))
    arrays = (nnx.Param, nnx.BatchStat)
    before = jax.tree.map(np.array, nnx.state(model, arrays).to_pure_dict())
    step = train_step(model)
    loop = train_loop.TrainLoop(step)  # donates the states it produces
    state, _ = loop(step.initialize_model([1, 16]), iter(batches(3)), num_steps=3)
    step.compile(donate_argnums=(0,))  # every call consumes its state
    state, _ = step(step.initialize_model([1, 16]), batches(1)[0])
    after = nnx.state(model, arrays).to_pure_dict()
    assert leaves_equal(before, after)
    model.eval()
    assert model(jnp.ones((2, 16))).shape == (2, 10)


def test_checkpoint_and_resume_are_bit_identical(tmp_path):
    examples = toy_data(192)

    def run(total, directory):
        step = train_step()
        manager = checkpoint.make_manager(directory, max_to_keep=2)
        loop = train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager)])
        outer = outer_loop.OuterLoop(train_loop=loop,
                                     checkpoint_spec=outer_loop.CheckpointSpec(directory),
                                     progress=False)
        dataset = data.GlobalBatchDataset(data.ArraySource(examples), 32, seed=3)
        state, _ = outer(step.initialize_model([1, 16]), iter(dataset),
                         train_total_steps=total, train_loop_steps=3)
        manager.close()
        return state

    straight = run(6, tmp_path / "a")
    run(3, tmp_path / "b")
    resumed = run(6, tmp_path / "b")  # restarts from step 3's checkpoint
    assert int(resumed.step) == 6
    assert leaves_equal(resumed, straight)

    # Continuous evaluation of the checkpoints with an NNX-native eval step (which restores
    # no optimizer state).
    class Seen(actions.Action):
        seen = []

        def __call__(self, state, outputs, **kwargs):
            self.seen.append((int(state.step), float(outputs["accuracy"].compute())))

    evaluate = EvalStep(jax.random.key(0), Net(rngs=nnx.Rngs(0)))
    evaluator = outer_loop.OuterLoop(
        eval_loops=[eval_loop.EvalLoop(evaluate, end_actions=[Seen()])], progress=False,
        checkpoint_spec=outer_loop.CheckpointSpec(tmp_path / "b", iterate_stop_fn=lambda: True))
    evaluator(evaluate.initialize_model([1, 16]),
              eval_specs=[outer_loop.EvalSpec([toy_data(64, seed=9)])])
    assert [s for s, _ in Seen.seen] == [3, 6]
    _, direct = evaluate(resumed, toy_data(64, seed=9))
    assert Seen.seen[-1][1] == float(direct["accuracy"].compute())


def test_history_eval_loops_and_a_linen_style_eval_step_see_the_nnx_state():
    class LinenStyleEval(step_lib.Step):
        def run(self, state, batch):
            logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                                    batch["x"])
            return state, {"acc": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    step = train_step()
    evaluate = EvalStep(jax.random.key(0), Net(rngs=nnx.Rngs(0)))
    outer = outer_loop.OuterLoop(train_loop=train_loop.TrainLoop(step),
                                 eval_loops=[eval_loop.EvalLoop(evaluate)], progress=False)
    data = batches(4)
    state, _ = outer(step.initialize_model([1, 16]), iter(data * 3), train_total_steps=12,
                     train_loop_steps=6,
                     eval_specs=[outer_loop.EvalSpec(dataset=data[:2], num_steps=2)])
    names = outer.history.as_dict()["name"]
    # The nnx metrics are merged over each train loop, as clu metrics are.
    assert names.count("train/loss") == names.count("train/accuracy") == 2
    assert names.count("eval/accuracy") == 2
    linen_style = LinenStyleEval(jax.random.key(0), Net(rngs=nnx.Rngs(0)))
    _, out = linen_style(state, data[0])
    _, nnx_out = evaluate(state, data[0])
    np.testing.assert_allclose(float(out["acc"]), float(nnx_out["accuracy"].compute()),
                               rtol=1e-6)


def test_a_linen_style_call_without_batch_stats_names_the_fix():
    class ReadmeStep(step_lib.Step):  # the linen-style run, on an nnx model with BatchNorm
        def run(self, state, batch):
            def loss(params):
                logits = state.apply_fn({"params": params}, batch["x"])
                return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

            grads = jax.grad(loss)(state.params)
            return state.apply_gradients(grads=grads), {}

    step = ReadmeStep(jax.random.key(0), Net(rngs=nnx.Rngs(0)), optimizer=optax.sgd(0.1),
                      train=True)
    state = step.initialize_model([1, 16])
    with pytest.raises(ValueError, match=r"BatchNorm statistics.*'batch_stats'.*"
                                         r"mutable=\['batch_stats'\].*run\(self, model"):
        step(state, batches(1)[0])


def test_an_nnx_run_on_a_linen_module_names_the_fix():
    import flax.linen as nn

    step = TrainStep(jax.random.key(0), nn.Dense(10), optimizer=optax.sgd(0.1), train=True)
    state = step.initialize_model([1, 16])
    with pytest.raises(TypeError, match=r"linen module.*run\(self, state, batch\)"):
        step(state, batches(1)[0])


def test_a_dtype_policy_computes_the_nnx_layers_in_bfloat16_and_keeps_float32_params():
    model = Net(rngs=nnx.Rngs(0))
    data = batches(1)[0]
    runs = {}
    for policy in (None, "bfloat16"):
        step = train_step(model, dtype_policy=policy)
        state = step.initialize_model([1, 16])
        losses = []
        for _ in range(10):
            state, out = step(state, data)
            losses.append(float(out["loss"].compute()))
        runs[policy] = state, losses, out["logits"]
    state, losses, logits = runs["bfloat16"]
    assert logits.dtype == jnp.bfloat16  # the layers computed in bfloat16
    stored = jax.tree.leaves((state.params, state.batch_stats, state.opt_state[0].mu))
    assert {x.dtype for x in stored} == {jnp.dtype(jnp.float32)}
    assert losses[-1] < 0.6 * losses[0]
    np.testing.assert_allclose(losses, runs[None][1], rtol=0.02)  # as float32 trains
    evaluate = EvalStep(jax.random.key(0), Net(rngs=nnx.Rngs(0)), dtype_policy="bfloat16")
    assert evaluate(state, data)[1]["logits"].dtype == jnp.bfloat16
    assert model.dense1.dtype is None  # the caller's model keeps its own dtypes


class EmaTrainStep(NnxStep):
    def run(self, model, optimizer, ema, batch):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch)[0])(model)
        optimizer.update(model, grads)
        ema.update(model, 0.5)
        return {"loss": loss}


def test_an_nnx_run_updates_the_ema_and_eval_loop_evaluates_it():
    step = EmaTrainStep(jax.random.key(0), Net(rngs=nnx.Rngs(0)), optimizer=optax.adam(1e-2),
                        train=True)
    with pytest.raises(TypeError, match=r"ema\.init\(step\.initialize_model"):
        step(step.initialize_model([1, 16]), batches(1)[0])
    start = ema.init(step.initialize_model([1, 16]))
    before = jax.device_get(start.ema_params)
    state, _ = step(start, batches(1)[0])
    expected = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, before, jax.device_get(state.params))
    assert isinstance(state, ema.EmaState)
    assert jax.tree.all(jax.tree.map(np.allclose, expected, jax.device_get(state.ema_params)))
    state, _ = train_loop.TrainLoop(step)(state, iter(batches(3)), num_steps=3)
    evaluate = EvalStep(jax.random.key(0), Net(rngs=nnx.Rngs(0)))
    _, out = eval_loop.EvalLoop(evaluate, use_ema=True)(state, iter(batches(2)))
    _, averaged = eval_loop.EvalLoop(evaluate)(ema.swap_in(state), iter(batches(2)))
    _, trained = eval_loop.EvalLoop(evaluate)(state, iter(batches(2)))
    assert float(out["loss"].compute()) == float(averaged["loss"].compute())
    assert float(out["loss"].compute()) != float(trained["loss"].compute())


def mlp(rngs):
    return nnx.Sequential(nnx.Linear(16, 32, rngs=rngs), nnx.relu, nnx.Linear(32, 10, rngs=rngs))


class AccumulatingStep(NnxStep):
    def run(self, model, optimizer, batch):
        grad_fn = accumulate.nnx_value_and_grad(loss_fn, num_microbatches=4, has_aux=True,
                                                aux="stack")
        (loss, logits), grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss, "logits": logits}


def test_gradient_accumulation_in_an_nnx_run_equals_one_big_batch():
    data = batches(3)
    plain, accumulating = (cls(jax.random.key(0), mlp(nnx.Rngs(0)), optimizer=optax.adam(1e-2),
                               train=True) for cls in (TrainStep, AccumulatingStep))
    a, b = plain.initialize_model([1, 16]), accumulating.initialize_model([1, 16])
    for batch in data:
        a, out_a = plain(a, batch)
        b, out_b = accumulating(b, batch)
        np.testing.assert_allclose(float(out_b["loss"]), float(out_a["loss"].compute()),
                                   rtol=1e-5)
    assert jax.tree.all(jax.tree.map(functools.partial(np.allclose, rtol=1e-5, atol=1e-6),
                                     jax.device_get(a.params), jax.device_get(b.params)))
    # Dropout and BatchNorm: each microbatch draws its own mask (here all four hold the same
    # examples), and the statistics move.
    step = AccumulatingStep(jax.random.key(0), Net(rngs=nnx.Rngs(0)), optimizer=optax.adam(1e-2),
                            train=True)
    state = step.initialize_model([1, 16])
    same = jax.tree.map(lambda x: np.repeat(x[:2], 4, axis=0), data[0])
    new_state, out = step(state, same)
    assert out["logits"].shape == (4, 2, 10)
    assert len({np.asarray(x).tobytes() for x in out["logits"]}) == 4
    assert not np.allclose(new_state.batch_stats["bn"]["mean"], 0)


def test_an_nnx_run_that_names_the_state_names_the_fix():
    class Mixed(step_lib.Step):
        def run(self, model, state, batch):
            return {}

    step = Mixed(jax.random.key(0), Net(rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"names 'state'.*run\(self, state, batch\)"):
        step(step.initialize_model([1, 16]), batches(1)[0])


# Flax's NNX MNIST tutorial (google/flax, docs_nnx/mnist_tutorial.md at v0.12.7, Apache-2.0):
# its loss function and step functions as written there.
TUTORIAL_STEPS = """
def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
  logits = model(batch['image'], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch['label']
  ).mean()
  return loss, logits

@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs: nnx.Rngs, batch):
  \"\"\"Train for a single step.\"\"\"
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch, rngs)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.
  optimizer.update(model, grads)  # In-place updates.

@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.
"""  # noqa: E501 (the tutorial's line lengths)

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "06_nnx.ipynb"


def test_the_tutorials_steps_run_as_jaxloop_steps_changed_only_at_the_function_boundary():
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    sources = ["".join(c["source"]) for c in cells]
    port = next(s for s in sources if "class TrainStep" in s)

    def lines(text):
        return [line.strip() for line in text.strip().splitlines()]

    diff = list(difflib.ndiff(lines(TUTORIAL_STEPS), lines(port)))
    removed = [d[2:] for d in diff if d.startswith("- ")]
    added = [d[2:] for d in diff if d.startswith("+ ")]
    assert removed == [
        "@nnx.jit",
        "def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, "
        "rngs: nnx.Rngs, batch):",
        "@nnx.jit",
        "def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):"]
    assert added == [
        "class TrainStep(DigitsSteps):",
        "def run(self, model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, "
        "rngs: nnx.Rngs, batch):",
        "class EvalStep(DigitsSteps):",
        "def run(self, model: CNN, metrics: nnx.MultiMetric, batch):"]

    # The notebook's cells up to the port (data, model, metrics, steps), then a user's loop.
    scope = {"__name__": "notebook"}
    for source in sources[1:sources.index(port) + 1]:
        exec(compile(source, str(NOTEBOOK), "exec"), scope)
    train = scope["TrainStep"](jax.random.key(0), scope["CNN"](rngs=nnx.Rngs(0)),
                               optimizer=optax.adamw(0.005, 0.9), train=True)
    state, out = train_loop.TrainLoop(train)(train.initialize_model([1, 8, 8, 1]),
                                             iter(scope["train_ds"]), num_steps=60)
    evaluate = scope["EvalStep"](jax.random.key(0), scope["CNN"](rngs=nnx.Rngs(0)))
    _, evaluated = eval_loop.EvalLoop(evaluate)(state, scope["test_ds"])
    assert int(state.step) == 60
    assert float(out["loss"].compute()) < 1.0
    assert float(evaluated["accuracy"].compute()) > 0.85


def test_features_md_nnx_snippet_runs_and_its_stream_names_hold():
    text = (Path(__file__).resolve().parent.parent / "docs" / "features.md").read_text()
    section = text.split("## nnx models\n", 1)[1].split("\n## ", 1)[0]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {"jax": jax, "nnx": nnx, "optax": optax, "step_lib": step_lib,
             "CNN": lambda rngs: CallDropout(rngs=rngs),
             "loss_fn": lambda model, batch, rngs: loss_fn(
                 lambda x: model(x, rngs), {"x": batch["image"], "y": batch["label"]})}
    exec(compile(snippet, "docs/features.md", "exec"), scope)
    step = scope["step"]
    state = step.initialize_model([1, 16])
    batch = {"image": toy_data(16)["x"], "label": toy_data(16)["y"]}
    for _ in range(2):
        state, out = step(state, batch)
    assert int(state.step) == 2 and np.isfinite(float(out["loss"].compute()))

    # The linen way: a model built with nnx.Rngs(0) draws dropout from 'default'.
    class LinenWay(step_lib.Step):
        def run(self, state, batch):
            return state, {"y": state.apply_fn({"params": state.params}, batch["x"],
                                               rngs={self.stream: self.prng_key(state.step)})}

    class Held(nnx.Module):
        def __init__(self, *, rngs):
            self.dense = nnx.Linear(16, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.dense(x))

    default = LinenWay(jax.random.key(0), Held(rngs=nnx.Rngs(0)), train=True)
    default.stream = "default"
    default(default.initialize_model([1, 16]), toy_data(8))
    dropout = LinenWay(jax.random.key(0), Held(rngs=nnx.Rngs(0)), train=True)
    dropout.stream = "dropout"
    with pytest.raises(ValueError, match=r"\['default'\].*rngs=\{'default'"):
        dropout(dropout.initialize_model([1, 16]), toy_data(8))


# An NNX user's training script: checkpoints every loop of 5 steps and resumes from them when
# run again; a slow action makes a kill land mid-run.
KILL_JOB = """
import hashlib, json, sys, time
import jax, numpy as np, optax
from flax import nnx
from jaxloop import actions, data, outer_loop, train_loop
from jaxloop import step as step_lib
from jaxloop.checkpointing import checkpoint


class Net(nnx.Module):
    def __init__(self, *, rngs):
        self.dense1 = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.dense2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.drop(nnx.relu(self.bn(self.dense1(x)))))


class TrainStep(step_lib.Step):
    def run(self, model, optimizer, batch):
        def loss_fn(model):
            logits = model(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return {"loss": loss}


class Log(actions.Action):
    def __call__(self, state, outputs, **kwargs):
        with open(sys.argv[2] + ".steps", "a") as f:
            f.write(f"{int(state.step)}\\n")
        time.sleep(float(sys.argv[3]))


workdir, result = sys.argv[1], sys.argv[2]
with open(result + ".steps", "a") as f:
    f.write("start\\n")
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype(np.float32)
examples = {"x": x, "y": np.argmax(x @ rng.normal(size=(16, 10)), -1).astype(np.int32)}
step = TrainStep(jax.random.key(0), Net(rngs=nnx.Rngs(0)), optimizer=optax.adam(1e-2),
                 train=True)
manager = checkpoint.make_manager(workdir, max_to_keep=3)
loop = train_loop.TrainLoop(step, end_actions=[actions.CheckpointAction(manager), Log()])
outer = outer_loop.OuterLoop(train_loop=loop, checkpoint_spec=outer_loop.CheckpointSpec(workdir),
                             progress=False)
state, _ = outer(step.initialize_model([1, 16]),
                 iter(data.GlobalBatchDataset(data.ArraySource(examples), 32, seed=3)),
                 train_total_steps=30, train_loop_steps=5)
manager.wait_until_finished()
manager.close()
digest = hashlib.sha256()
for leaf in jax.tree.leaves(jax.device_get((state.params, state.batch_stats, state.opt_state))):
    digest.update(np.asarray(leaf).tobytes())
with open(result, "w") as f:
    json.dump({"step": int(state.step), "fingerprint": digest.hexdigest()}, f)
"""


@pytest.mark.slow
def test_kill_9_mid_run_then_rerun_resumes_bit_identical(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(KILL_JOB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}

    def start(name, delay):
        return subprocess.Popen(
            [sys.executable, str(job), str(tmp_path / name), str(tmp_path / f"{name}.json"),
             str(delay)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def finish(proc):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]

    def result(name):
        return json.loads((tmp_path / f"{name}.json").read_text())

    finish(start("straight", 0))
    killed = start("killed", 0.3)
    deadline = time.monotonic() + 240
    while not any(p.name.isdigit() and int(p.name) >= 10
                  for p in (tmp_path / "killed").glob("*")):
        assert killed.poll() is None and time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert not (tmp_path / "killed.json").exists()  # it died before the end
    finish(start("killed", 0))  # the same command again resumes
    runs = (tmp_path / "killed.json.steps").read_text().split("start")[1:]
    assert len(runs) == 2
    first_loop_of_rerun = int(runs[1].split()[0])
    assert first_loop_of_rerun > 10  # it started from a checkpoint, not from scratch
    assert result("killed") == result("straight")
    assert result("straight")["step"] == 30


def test_an_eval_step_of_another_model_names_the_mismatch():
    state = train_step().initialize_model([1, 16])
    other = EvalStep(jax.random.key(0), CallDropout(rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"do not fit CallDropout's variables"):
        other(state, batches(1)[0])
