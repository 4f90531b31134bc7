"""The examples' mixed-precision and dry-run flags, and the dry run itself: compile the
train and eval steps from abstract states and print their per-device memory, training
nothing (see `jaxloop.recipes.precision` and `diagnostics.memory.estimate`).

Example::

    @dataclasses.dataclass
    class Config(dry_run.Flags):
        batch_size: int = 32

    args = config.parse(Config)
    if args.dry_run:
        return dry_run.report(train_step, eval_step, train_spec, eval_spec, state, 32)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jaxloop import step as step_lib
from jaxloop import types
from jaxloop.diagnostics import memory


@dataclasses.dataclass
class Flags:
    """``--precision`` (float32 or bfloat16) and ``--dry-run``: a base of the examples'
    configuration dataclasses (`jaxloop.launch.config`)."""

    precision: Literal["float32", "bfloat16"] = "float32"
    """compute dtype (bfloat16: params, optimizer and loss stay float32)"""
    dry_run: bool = False
    """compile the train and eval steps, print their per-device memory, train nothing"""


def report(
    train_step: step_lib.Step, eval_step: step_lib.Step, train_spec: types.BatchSpec,
    eval_spec: types.BatchSpec, state: Any, batch_size: int, show: bool = True,
) -> dict[str, Any]:
    """Compiles both steps for their global batch specs against `state` (abstract: nothing
    is allocated, trained or written) and returns their per-device memory estimates
    (``{'dry_run': True, 'train': ..., 'eval': ...}``).

    With `show` (process 0) it prints them; the last line printed is
    ``dry-run train_total_bytes=<int> eval_total_bytes=<int>``.
    """
    estimates = {
        "train": memory.estimate(train_step, train_spec, state),
        "eval": memory.estimate(eval_step, eval_spec, state),
    }
    if show:
        for name, estimate in estimates.items():
            print(f"{name} step, global batch {batch_size}: {estimate}", flush=True)
        print(f"dry-run train_total_bytes={estimates['train'].total_bytes} "
              f"eval_total_bytes={estimates['eval'].total_bytes}", flush=True)
    return {"dry_run": True, **estimates}
