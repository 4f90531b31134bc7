"""Runs the guide's example through run_guide.py and writes its final parameters and
outputs to a JSON file (used by tests/test_debugging.py).

Usage: python run_guide_results.py NUM_DEVICES OUT_JSON
"""

import json
import os
import runpy
import sys

here = os.path.dirname(os.path.abspath(__file__))
out_path = sys.argv[2]
sys.argv = [os.path.join(here, "run_guide.py"), sys.argv[1]]
scope = runpy.run_path(sys.argv[0])["scope"]

import jax  # noqa: E402
import numpy as np  # noqa: E402

results = {
    "params": [np.asarray(x, np.float64).ravel().tolist()
               for x in jax.tree.leaves(scope["state"].params)],
    "loss": [float(x) for x in scope["outputs"]["loss"]],
    "step": int(scope["state"].step),
}
with open(out_path, "w") as f:
    json.dump(results, f)
