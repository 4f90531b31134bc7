"""EvalLoop: the loop that measures the model without changing it.

Every step sees the same state (the state returned by the step is dropped), and the loop
runs until `num_steps` or the end of the dataset.

Example::

    eval_loop = EvalLoop(eval_step, end_actions=[summary_action])
    _, outputs = eval_loop(state, eval_batches)

    # 8 batches per compiled call; a last partial group runs as single steps.
    eval_loop = EvalLoop(eval_step, steps_per_execution=8)

    # Evaluate the moving average of the parameters (see `jaxloop.ema`).
    eval_loop = EvalLoop(eval_step, use_ema=True)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jaxloop import action_loop, types

Output = types.Output
State = types.TrainState


class EvalLoop(action_loop.ActionLoop):
    """An ActionLoop that keeps the state fixed across its steps.

    Arguments are those of `ActionLoop`, including ``steps_per_execution`` (default 1):
    with k > 1, k batches run in one compiled call, each on the same state.
    With ``use_ema=True`` the steps see the state's ``ema_params`` as ``params``
    (`jaxloop.ema`); the loop still returns the state it was given.
    """

    def __init__(self, *args: Any, use_ema: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.use_ema = use_ema

    def run(
        self,
        state: State,
        dataset: Iterator[Any],
        num_steps: int | None = None,
        log_num_flops: bool = False,
        **kwargs: Any,
    ) -> tuple[State, Output | None]:
        kwargs.setdefault("return_state_from_step", False)
        if not self.use_ema:
            return super().run(state, dataset, num_steps, log_num_flops=log_num_flops, **kwargs)
        from jaxloop import ema  # noqa: PLC0415

        _, outputs = super().run(
            ema.swap_in(state), dataset, num_steps, log_num_flops=log_num_flops, **kwargs
        )
        return state, outputs
