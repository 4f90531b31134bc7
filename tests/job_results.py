"""How a multi-process test job hands its results to the test: one JSON file per process,
written whole (a reader never sees half a file)."""

import json
import os
from pathlib import Path

import jax


def write(result_dir: Path, result: dict) -> None:
    """Writes `result` as ``result_dir/result-<process index>.json``."""
    out = Path(result_dir) / f"result-{jax.process_index()}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)
