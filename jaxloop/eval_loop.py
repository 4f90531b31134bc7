"""EvalLoop: the loop that measures the model without changing it (every step sees the same
state; it runs until `num_steps` or the data ends). Example::

    eval_loop = EvalLoop(eval_step, end_actions=[summary_action], steps_per_execution=8)
    _, outputs = eval_loop(state, eval_batches)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop import action_loop, types
from jaxloop import loop as loop_lib
from jaxloop import step as step_lib
from jaxloop.launch import agreement

Loop = loop_lib.Loop
Output = types.Output
State = types.TrainState
Step = step_lib.Step


class EvalLoop(action_loop.ActionLoop):
    """An ActionLoop that keeps the state fixed across its steps.

    The outputs hold the step's own keys (and any statistics asked for). Beside them,
    `example_counts` holds the real examples of each batch (the sum of ``batch[mask_key]``,
    else the batch size), by which `SummaryAction`, the history and `scalar_metrics`
    weight per-step means. ``use_ema=True`` evaluates the state's EMA parameters
    (`jaxloop.recipes.ema`). The steps run where the step's partitioner places the state: a state
    trained elsewhere is copied there once per evaluation (counted by `state_moves`).
    """

    def __init__(self, step: Any, *args: Any, mask_key: str = "mask", use_ema: bool = False,
                 **kwargs: Any):
        if getattr(step, "train", False):
            raise ValueError(
                f"EvalLoop needs an evaluation step, got {type(step).__name__} built with "
                "train=True (it would update the state at every batch). Build a second step "
                "for evaluation with train=False, e.g. MyStep(key, model, "
                "partitioner=partitioner), and pass that to EvalLoop.")
        super().__init__(step, *args, **kwargs)
        self._mask_key = mask_key
        self.use_ema = use_ema
        # Per batch read: its example count, and whether it held this process's rows only.
        self._counts: list[tuple[Any, bool]] = []
        self._example_counts: list[Any] = []

    @property
    def example_counts(self) -> list[Any]:
        """The real examples of each step's batch in the last run, over all processes
        (set before the loop's `end`), e.g. ``[16, 16, 8]``."""
        return self._example_counts

    def _get_next_batch(self, dataset: Iterator[Any]) -> Any:
        batch = super()._get_next_batch(dataset)
        leaves = jax.tree.leaves(batch)
        # A host (numpy) batch holds this process's rows only; a placed batch is global.
        local = not any(isinstance(x, jax.Array) for x in leaves)
        if isinstance(batch, Mapping) and self._mask_key in batch:  # its real examples
            mask = batch[self._mask_key]
            count = jnp.sum(mask) if isinstance(mask, jax.Array) else int(np.sum(mask))
        else:
            count = int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 1
        self._counts.append((count, local))
        return batch

    state_moves: int = 0
    """How many evaluations copied the state to the eval step's placement."""

    def _placed(self, state: State) -> State:
        """`state` where the step's partitioner runs it (a copy only when elsewhere)."""
        partitioner = getattr(self.step, "partitioner", None)
        leaves = jax.tree.leaves(state)
        if partitioner is None or not leaves or not all(isinstance(x, jax.Array)
                                                        for x in leaves):
            return state  # host leaves: the program places them as it always has
        target = partitioner.placement(state)
        if all(x.sharding.is_equivalent_to(s, x.ndim)
               for x, s in zip(leaves, jax.tree.leaves(target), strict=True)):
            return state
        self.state_moves += 1
        return jax.device_put(state, target)

    def end(self, state: State, outputs: Output | None) -> tuple[State, Output | None]:
        """Runs the end actions, unless Ctrl-C or a preemption cut the evaluation short:
        a part of an evaluation is no result (no summary, history point or early-stopping
        update)."""
        if self.preempted:
            return state, outputs
        return super().end(state, outputs)

    def run(self, state: State, dataset: Iterator[Any], num_steps: int | None = None,
            log_num_flops: bool = False, **kwargs: Any) -> tuple[State, Output | None]:
        kwargs.setdefault("return_state_from_step", False)
        self._counts, self._example_counts = [], []
        if self.use_ema:
            from jaxloop.recipes import ema  # noqa: PLC0415
        evaluated = self._placed(ema.swap_in(state) if self.use_ema else state)
        _, outputs = super().run(evaluated, dataset, num_steps, log_num_flops=log_num_flops,
                                 **kwargs)
        counts = [count for count, _ in self._counts]
        if jax.process_count() > 1 and any(local for _, local in self._counts):
            # A host batch's count is this process's: summed over all (a collective).
            summed = agreement.summed([c if local else 0 for c, local in self._counts], np.int64)
            counts = [int(s) if local else c
                      for s, (c, local) in zip(summed, self._counts, strict=True)]
        self._example_counts = counts
        return state, outputs
