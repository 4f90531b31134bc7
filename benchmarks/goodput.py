"""Where the wall time of a training run goes: `goodput.Recorder`'s split (compile, waiting
for input, device compute, checkpoint blocking, evaluation) against the measured wall time.
Goal: the measured parts explain at least 95% of the wall time ("other" <= 5%).

The run: the benchmarks' MLP 784-1024-1024-10 with Adam, --loops train loops of
--loop-steps steps, an evaluation of --eval-steps batches and an (async) orbax checkpoint
after every loop, input batches that take --input-delay seconds of host work each.

    python benchmarks/goodput.py
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402
from common import MLP, TrainStep, batches  # noqa: E402

from jaxloop import actions, eval_loop, outer_loop, train_loop  # noqa: E402
from jaxloop.checkpointing import checkpoint  # noqa: E402
from jaxloop.diagnostics import goodput  # noqa: E402


class EvalStep(TrainStep):
    def run(self, state, batch):
        logits = state.apply_fn({"params": state.params}, batch["x"])
        return state, {"loss": optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["y"]).mean()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loops", type=int, default=5)
    parser.add_argument("--loop-steps", type=int, default=100)
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--input-delay", type=float, default=0.002)
    args = parser.parse_args()
    logging.getLogger("absl").setLevel(logging.WARNING)
    workdir = tempfile.mkdtemp()
    step = TrainStep(jax.random.key(0), MLP(), optimizer=optax.adam(1e-3), train=True)
    eval_step = EvalStep(jax.random.key(0), MLP())
    manager = checkpoint.make_manager(os.path.join(workdir, "ckpt"))
    state = step.initialize_model([1, 784])
    eval_data = list(batches(args.batch_size, args.eval_steps))
    # The run's wall time is measured from here: model and optimizer built, training next.
    begin = time.perf_counter()
    recorder = goodput.Recorder()
    ckpt_start, ckpt_stop = recorder.span("checkpoint")
    eval_start, eval_stop = recorder.span("evaluation")
    per_loop = []

    class Keep(actions.Action):
        def __call__(self, state, outputs, **kwargs):
            per_loop.append(dict(outputs))

    tl = train_loop.TrainLoop(
        step, recorder=recorder, global_batch_size=args.batch_size,
        end_actions=[Keep(), ckpt_start, actions.CheckpointAction(manager), ckpt_stop])
    el = eval_loop.EvalLoop(eval_step, begin_actions=[eval_start], end_actions=[eval_stop])
    outer = outer_loop.OuterLoop(train_loop=tl, eval_loops=[el])
    total = args.loops * args.loop_steps
    outer(state, batches(args.batch_size, total, delay=args.input_delay),
          train_total_steps=total, train_loop_steps=args.loop_steps,
          eval_specs=[outer_loop.EvalSpec(
              dataset=eval_data)])
    with recorder.measure("checkpoint"):
        manager.wait_until_finished()  # the last save's remaining write
    manager.close()
    totals = recorder.totals()
    outside = time.perf_counter() - begin
    shutil.rmtree(workdir, ignore_errors=True)

    print(f"{args.loops} loops x {args.loop_steps} steps, eval {args.eval_steps} batches, "
          f"checkpoint each loop, {jax.devices()[0].platform}")
    names = [*goodput.CATEGORIES, "other"]
    print("  loop  " + "".join(f"{n:>12s}" for n in names) + "        wall")
    for i, split in enumerate(per_loop, 1):
        cells = "".join(f"{split[f'jaxloop/time/{n}_secs']:12.3f}" for n in names)
        print(f"  {i:4d}  {cells}  {split['jaxloop/time/wall_secs']:10.3f}")
    cells = "".join(f"{totals[n]:12.3f}" for n in names)
    print(f"  run   {cells}  {totals['wall']:10.3f}")
    measured = sum(totals[c] for c in goodput.CATEGORIES)
    print(f"  measured parts / wall: {measured / totals['wall']:.3f} (other "
          f"{totals['other'] / totals['wall']:.1%}); goodput (compute / wall) "
          f"{totals['compute'] / totals['wall']:.3f}; wall checked outside: {outside:.3f} s")


if __name__ == "__main__":
    main()
