"""A loop end that no action needs waits for nothing, with the progress bar shown and a
`SummaryAction` every loop (issue 44): their values are shown and written once the device has
produced them, and the last loop's before the `OuterLoop` call returns. The step's device time
is a sleep inside the compiled program (benchmarks/async_device.py's `ffi_sleep`), so a loop
end that read the loop's last values would find them not computed yet."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from async_device import (  # noqa: E402
    RecordingWriter,
    SleepStep,
    cycle,
    ffi_sleep,
    make_batches,
    make_step_fn,
)
from test_waits import waits  # noqa: E402, F401, F811 (the fixture counting the host's waits)

from jaxloop import actions, outer_loop, train_loop  # noqa: E402

LOOP, LOOPS = 10, 2  # more than 8 steps: their values are stacked on the device


class WaitsSoFar(actions.Action):
    """A begin action noting, at each loop's start, the waits for values not yet computed:
    those of the loop end before it (its actions and the progress bar) are then counted."""

    def __init__(self, counter):
        super().__init__()
        self.waits, self.seen = counter, []

    def __call__(self, state, outputs, **kwargs):
        self.seen.append(self.waits.waited)


@pytest.mark.parametrize("summary", [False, True], ids=["progress bar", "summary"])
def test_a_loop_end_shows_and_writes_without_waiting(waits, capsys, summary):  # noqa: F811
    step = SleepStep(make_step_fn(ffi_sleep(0.02), with_outputs=True))
    writer = RecordingWriter()
    noted = WaitsSoFar(waits)
    loop = train_loop.TrainLoop(
        step, max_steps_in_flight=100, begin_actions=[noted],
        end_actions=[actions.SummaryAction(writer)] if summary else [])
    outer = outer_loop.OuterLoop(loop, progress=not summary)
    batches = make_batches()
    state, _ = outer(step.initialize_model([1, 16]), cycle(batches, LOOP),
                     train_total_steps=LOOP, train_loop_steps=LOOP)  # compiles
    writer.scalars.clear()
    capsys.readouterr()
    noted.seen.clear()
    waits.counting = True
    state, outputs = outer(state, cycle(batches, LOOP * LOOPS),
                           train_total_steps=LOOP * (LOOPS + 1), train_loop_steps=LOOP)
    waits.counting = False
    # No loop end waited for its steps (the loop's own steps-in-flight bound is not reached).
    assert noted.seen == [0] * LOOPS, noted.seen
    last = float(outputs["loss"][-1])
    if summary:  # every step written at its step before the call returned
        assert [s for s, _ in writer.scalars] == list(range(LOOP + 1, LOOP * (LOOPS + 1) + 1))
        assert writer.scalars[-1][1]["loss"] == pytest.approx(last)
    else:  # the bar's last state shows the last step's loss
        drawn = capsys.readouterr().err.split("\r")
        final = [d for d in drawn if d.startswith("train:")][-1]
        assert f"{LOOP * (LOOPS + 1)}/{LOOP * (LOOPS + 1)}" in final, final
        assert f"loss={last:.4g}" in final, final
