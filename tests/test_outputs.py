"""outputs.MetricList: a loop's per-step clu metrics merged by one compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics as clu_metrics
from flax import struct

from jaxloop.engine import outputs


def test_metric_lists_of_two_lengths_merge_with_one_program_and_clu_s_result():
    traced = []

    @struct.dataclass
    class CountedAverage(clu_metrics.Average):
        """clu's Average, counting the merges traced for compilation."""

        def merge(self, other):
            if isinstance(self.total, jax.core.Tracer):
                traced.append(1)
            return super().merge(other)

    for length in (3, 7, 3):
        values = np.arange(1.0, 2 * length + 1, dtype=np.float32).reshape(length, 2)
        steps = [CountedAverage.from_model_output(jnp.asarray(v)) for v in values]
        metrics = outputs.append({}, {"m": steps[0]})
        for step in steps[1:]:
            outputs.append(metrics, {"m": step})
        assert isinstance(metrics["m"], outputs.MetricList) and len(metrics["m"]) == length
        # clu's own answer: its merges, one after the other, outside jit.
        expected = steps[0]
        for step in steps[1:]:
            expected = expected.merge(step)
        assert float(metrics["m"].compute()) == float(expected.compute()) == values.mean()
    assert len(traced) == 1  # one program for lengths 3 and 7 (and 3 again)
